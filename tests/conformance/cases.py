"""The ONNX node conformance cases, what operator each one tests, the skip list, and how one
case is run and classified.

Rules:
1. Cases are ``onnx.backend.test.loader.load_model_tests(kind="node")`` (built in memory by the
   installed onnx; 1,884 with onnx 1.23), keyed by name.
2. A case's operator: the op type of its single node; for a function-expanded case
   (``..._expanded...``) the operator of the case it expands; else the op type of its last node.
3. ``filter.txt`` lists skipped cases ORT-style: one regular expression per line (``re.search``
   on the case name), a ``# reason`` after it; blank and comment-only lines are ignored. A
   skipped case is listed with its reason, never dropped silently.
4. A run is classified as exactly one of: ``pass``; ``mismatch`` (outputs differ from the
   case's expected outputs under the case's own rtol/atol, compared by onnx's
   ``Runner.assert_similar_outputs``); ``refused`` (a clean refusal before anything is built:
   the op or dtype is listed as unsupported, :class:`UnsupportedOpError` from the loader or
   :class:`UnsupportedByBackendError` from the TVM lowering; on 2 ranks also "no strategy splits
   it", counted as ``single-only``); ``error`` (everything else that went wrong, with its
   ``kind``, :func:`classify_failure`: a TVM build failure, a failure of our shape inference or
   of a pass, a library that fails to load, a run failure, a plan failure, or a Python exception
   that is a project bug); ``crash``/``timeout`` are set by the runner when a worker process
   dies or stalls. Any :class:`PartitionerError` used to count as a refusal: that hid ~120
   errors (a build or pass failure is not a decision to refuse).
"""

from __future__ import annotations

import re
import time
import traceback
import warnings
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from partitioner.core.errors import PartitionerError

FILTER_PATH = Path(__file__).with_name("filter.txt")
STATUSES = ("pass", "mismatch", "refused", "error", "crash", "timeout", "skip")
UNSUPPORTED_MARK = "TVM cannot import"  # backends.tvm.lower.check_supported's refusal


@lru_cache(maxsize=1)
def load_cases() -> dict[str, Any]:
    """All node cases by name (takes ~10 s: onnx runs every case generator)."""
    from onnx.backend.test.loader import load_model_tests

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return {c.name: c for c in load_model_tests(kind="node")}


def case_ops(cases: dict[str, Any]) -> dict[str, str]:
    """Operator of each case (rule 2)."""
    single = {name: c.model.graph.node[0].op_type for name, c in cases.items() if len(c.model.graph.node) == 1}
    ops = {}
    for name, c in cases.items():
        if name in single:
            ops[name] = single[name]
            continue
        base = name.split("_expanded")[0]
        if "_expanded" in name and base in single:
            ops[name] = single[base]
        elif c.model.graph.node:
            ops[name] = c.model.graph.node[-1].op_type
        else:
            ops[name] = "<no node>"
    return ops


@dataclass(frozen=True)
class FilterRule:
    pattern: str
    reason: str


def read_filter(path: Path = FILTER_PATH) -> tuple[FilterRule, ...]:
    """Parse ``filter.txt`` (rule 3)."""
    rules = []
    if not path.exists():
        return ()
    for lineno, raw in enumerate(path.read_text().splitlines(), 1):
        pattern, _, reason = raw.partition("#")
        pattern = pattern.strip()
        if not pattern:
            continue
        try:
            re.compile(pattern)
        except re.error as exc:
            raise PartitionerError(f"{path}:{lineno}: bad pattern {pattern!r}: {exc}") from None
        rules.append(FilterRule(pattern, reason.strip() or "no reason given"))
    return tuple(rules)


def skip_reason(name: str, rules: tuple[FilterRule, ...]) -> str | None:
    for rule in rules:
        if re.search(rule.pattern, name):
            return rule.reason
    return None


@dataclass(frozen=True)
class CaseResult:
    """One case run one way. ``mode`` is ``tvm``, ``fallback`` or ``2rank``."""

    name: str
    mode: str
    status: str
    engine: str = ""  # tvm | onnxruntime, where it ran
    strategy: str = ""  # 2rank: the strategy that split it; "single-only" when none does
    reason: str = ""
    seconds: float = 0.0
    specialised: bool = False  # shape inputs were bound to the case's values (backend.SHAPE_SLOTS)
    kind: str = ""  # error: what failed (classify_failure); refused: "unsupported" or "strategy"

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:400]}"


ERROR_KINDS = ("tvm-build", "tvm-import", "library-load", "shape-inference", "pass", "load", "plan", "run", "backend", "other", "bug")


def classify_failure(exc: BaseException) -> tuple[str, str]:
    """``(status, kind)`` of an exception raised while preparing or running a case (rule 4)."""
    from partitioner.core.errors import (BackendError, ModelLoadError, PassError, PlanError, RunFailed,
                                    StrategyNotApplicable, UnsupportedByBackendError, UnsupportedOpError)

    msg = str(exc)
    if isinstance(exc, (UnsupportedOpError, UnsupportedByBackendError)):
        return "refused", "unsupported"
    if isinstance(exc, StrategyNotApplicable):
        return "refused", "strategy"
    if isinstance(exc, PassError):
        return "error", "shape-inference" if "shape_inference" in msg or "shape inference" in msg else "pass"
    if isinstance(exc, ModelLoadError):
        return "error", "shape-inference" if "shape inference" in msg else "load"
    if isinstance(exc, RunFailed):
        return "error", "run"
    if isinstance(exc, PlanError):
        return "error", "plan"
    if isinstance(exc, BackendError):
        if "cannot load" in msg:
            return "error", "library-load"
        if "build failed" in msg:
            return "error", "tvm-build"
        if "importer failed" in msg:
            return "error", "tvm-import"
        return "error", "backend"
    if isinstance(exc, PartitionerError):
        return "error", "other"
    return "error", "bug"


def run_case(case: Any, *, ranks: int = 1, fallback: str | None = None) -> tuple[CaseResult, Any]:
    """Prepare and run ``case`` through :class:`PartitionerBackend`; returns the result and the
    exception that caused a non-pass (None on pass)."""
    from onnx.backend.test.runner import Runner, _normalize_tensor

    from .backend import PartitionerBackend

    mode = "2rank" if ranks == 2 else ("fallback" if fallback else "tvm")
    t0 = time.perf_counter()
    engine, strategy, spec = "", "", False
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            rep = PartitionerBackend.prepare(case.model, "CPU", ranks=ranks, fallback=fallback)
            spec = bool(rep.specialised)
            for inputs, refs in case.data_sets:
                outs = rep.run([_normalize_tensor(x) for x in inputs])
                engine, strategy = rep.compiled.engine, rep.compiled.strategy
                Runner.assert_similar_outputs([_normalize_tensor(x) for x in refs], list(outs),
                                              rtol=case.rtol, atol=case.atol)
    except AssertionError as exc:
        return CaseResult(case.name, mode, "mismatch", engine, strategy, _one_line(exc),
                          time.perf_counter() - t0, spec), exc
    except PartitionerError as exc:
        status, kind = classify_failure(exc)
        if ranks == 2 and kind == "strategy":
            strategy = "single-only"
        return CaseResult(case.name, mode, status, engine, strategy, _one_line(exc),
                          time.perf_counter() - t0, spec, kind), exc
    except Exception as exc:  # a bug somewhere in the pipeline: listed, never fatal
        tb = traceback.extract_tb(exc.__traceback__)
        where = f" at {Path(tb[-1].filename).name}:{tb[-1].lineno}" if tb else ""
        return CaseResult(case.name, mode, "error", engine, strategy, _one_line(exc) + where,
                          time.perf_counter() - t0, spec, "bug"), exc
    return CaseResult(case.name, mode, "pass", engine, strategy, "", time.perf_counter() - t0, spec), None


# Old results (format 1) recorded every PartitionerError as "refused"; these texts mark the ones
# that really were refusals (rule 4), so an old JSON can be shown with the split re-derived.
REFUSAL_TEXTS = ("TVM cannot import", "has the sub-byte type", "not a typed tensor", "UnsupportedOpError")


def reason_is_refusal(reason: str) -> bool:
    return any(t in reason for t in REFUSAL_TEXTS)


def is_unsupported_op_refusal(result: CaseResult) -> bool:
    """True when TVM's importer lacks an op (the refusal the ORT fallback covers)."""
    return result.status == "refused" and UNSUPPORTED_MARK in result.reason

