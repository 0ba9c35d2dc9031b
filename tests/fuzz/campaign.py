"""Tallies of a fuzzing campaign and the JSON summary it writes.

The summary (``benchmarks/results/fuzz_summary.json``) records: examples run, the strategies and
device counts exercised, what ``auto`` chose, how many examples that matched were really split
over 2+ ranks (``split``: an ``auto`` run that chose ``single`` matched but split nothing, so it
is counted apart, in ``matched_unsplit``), not-applicable counts and their (normalised)
reasons, the operator histogram of the generated graphs, how many examples also ran through TVM,
and every mismatch and crash with its plan, the ops of its graph and a one-line detail.
"""

from __future__ import annotations

import json
import platform
import re
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .differential import ATOL, RTOL, Outcome
from .graph_strategy import FuzzGraph

SUMMARY_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "fuzz_summary.json"


def _reason_key(detail: str) -> str:
    """Strip names and numbers so that reasons group: ``node 'Add_n3' ...`` -> ``node '#' ...``."""
    return re.sub(r"\d+", "#", re.sub(r"'[^']*'", "'#'", detail))[:120]


@dataclass
class Campaign:
    seed: int
    started: float = field(default_factory=time.time)
    examples: int = 0
    tvm_examples: int = 0
    by_strategy: dict[str, Counter] = field(default_factory=dict)
    tvm_by_status: Counter = field(default_factory=Counter)
    devices: Counter = field(default_factory=Counter)
    microbatches: Counter = field(default_factory=Counter)
    auto_chose: Counter = field(default_factory=Counter)
    split: Counter = field(default_factory=Counter)  # strategy -> ok outcomes whose plan had >= 2 ranks
    unsplit: Counter = field(default_factory=Counter)  # strategy -> ok outcomes on 1 rank
    tvm_split: int = 0
    not_applicable_reasons: Counter = field(default_factory=Counter)
    ops: Counter = field(default_factory=Counter)
    input_ranks: Counter = field(default_factory=Counter)
    failures: list[dict[str, Any]] = field(default_factory=list)

    def record(self, fg: FuzzGraph, outcome: Outcome, *, backend: str = "onnxruntime") -> None:
        if backend == "tvm":
            self.tvm_examples += 1
            self.tvm_by_status[outcome.status] += 1
            self.tvm_split += outcome.status == "ok" and outcome.world_size > 1
        else:
            if outcome.status == "ok":
                (self.split if outcome.world_size > 1 else self.unsplit)[outcome.strategy] += 1
            self.examples += 1
            self.by_strategy.setdefault(outcome.strategy, Counter())[outcome.status] += 1
            self.devices[str(outcome.devices)] += 1
            self.microbatches[str(outcome.microbatches or 1)] += 1
            self.ops.update(fg.ops)
            self.input_ranks[str(len(fg.model.graph.input[0].type.tensor_type.shape.dim))] += 1
            if outcome.strategy == "auto" and outcome.chosen:
                self.auto_chose[outcome.chosen] += 1
        if outcome.status == "not_applicable" and backend != "tvm":
            self.not_applicable_reasons[_reason_key(outcome.detail)] += 1
        if outcome.status in ("mismatch", "crash"):
            self.failures.append({"backend": backend, "status": outcome.status, "strategy": outcome.strategy,
                                  "devices": outcome.devices, "microbatches": outcome.microbatches,
                                  "chosen": outcome.chosen, "ops": list(fg.ops), "detail": outcome.detail})

    def count(self, status: str) -> int:
        return sum(f["status"] == status for f in self.failures)

    def summary(self) -> dict[str, Any]:
        import onnx
        import onnxruntime

        return {
            "examples_run": self.examples,
            "tvm_examples_run": self.tvm_examples,
            "seed": self.seed,
            "wall_s": round(time.time() - self.started, 1),
            "tolerance": {"rtol": RTOL, "atol": f"{ATOL} * max(1, max|want|) * max(1, sqrt(L/16)), "
                                                  "L = longest reduction in the graph"},
            "strategies_exercised": {k: dict(v) for k, v in sorted(self.by_strategy.items())},
            "not_applicable": sum(v["not_applicable"] for v in self.by_strategy.values()),
            "not_applicable_reasons": dict(self.not_applicable_reasons.most_common(25)),
            "auto_chose": dict(self.auto_chose),
            "split": dict(sorted(self.split.items())),
            "matched_unsplit": dict(sorted(self.unsplit.items())),
            "tvm_split": self.tvm_split,
            "devices": dict(self.devices),
            "microbatches": dict(self.microbatches),
            "input_ranks": dict(self.input_ranks),
            "ops_exercised": dict(self.ops.most_common()),
            "tvm": dict(self.tvm_by_status),
            "mismatches_found": self.count("mismatch"),
            "crashes_found": self.count("crash"),
            "failures": self.failures[:200],
            "machine": {"python": platform.python_version(), "platform": platform.platform(),
                        "onnx": onnx.__version__, "onnxruntime": onnxruntime.__version__},
        }

    def write(self, path: Path = SUMMARY_PATH) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.summary(), indent=2, sort_keys=False) + "\n")
        tmp.replace(path)
        return path
