"""Run the ONNX node conformance suite through the project's whole pipeline and write JSON.

Usage (from the repository root)::

    .venv/bin/python tests/conformance/run_conformance.py --full          # all 1,884 node cases
    .venv/bin/python tests/conformance/run_conformance.py                 # the fast sample (SAMPLE)
    .venv/bin/python tests/conformance/run_conformance.py --only 'conv|pool' --ranks 1

Each case runs in a worker subprocess (``--worker``), one per job, fed case names on stdin and
answering one JSON line per result on a private pipe. A worker that dies (segfault, abort)
or stalls past ``--case-timeout`` is killed; the case in flight is recorded as ``crash`` or
``timeout`` and a fresh worker continues with the rest. Nothing is cached across runs.

Modes, per case (see :mod:`cases` for the statuses):
- ``tvm``: 1 rank, TVM only;
- ``fallback``: 1 rank, what ``partitioner compile --fallback onnxruntime`` gives a user: every
  case that did not pass in ``tvm`` mode is rerun through the product's build
  (:func:`partitioner.compiler.build_artifact` with the per-segment ONNX Runtime fallback, and
  whole-rank fallback when a TVM build fails); a case that passed keeps its ``tvm`` result (its
  programs need no fallback, so the product builds them unchanged);
- ``2rank``: ``partition(..., cpu:2)`` (auto, then fixed strategies); a case no strategy can
  split over 2 ranks is ``single-only`` (counted apart, not a failure).

An operator is *supported* in a mode when every one of its node cases passes in that mode.

Statuses (:mod:`cases` rule 4): ``refused`` only when an op or dtype is listed as unsupported
before anything is built; build, pass, shape-inference, library-load and run failures are
``error`` with their ``kind``. The report counts the passes that compiled with the case's shape
inputs baked in as constants, and what ran in the fallback row (TVM alone, TVM with ONNX Runtime
segments, or ONNX Runtime for a whole rank).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import queue
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.conformance.cases import (  # noqa: E402
    CaseResult,
    case_ops,
    load_cases,
    read_filter,
    reason_is_refusal,
    run_case,
    skip_reason,
)

RESULTS_DIR = ROOT / "benchmarks" / "results"
MARK = "@@CONF "
MODES = ("tvm", "fallback", "2rank")
CRASH_ENV = "PARTITIONER_CONFORMANCE_CRASH_ON"

# The fast sample: common operators, used by `pytest tests/conformance` and the default run.
SAMPLE: tuple[str, ...] = (
    "test_add", "test_add_bcast", "test_sub", "test_mul", "test_div", "test_pow",
    "test_matmul_2d", "test_matmul_3d", "test_matmul_4d",
    "test_gemm_default_no_bias", "test_gemm_all_attributes", "test_gemm_transposeA",
    "test_conv_with_strides_padding", "test_conv_with_strides_no_padding", "test_basic_conv_with_padding",
    "test_convtranspose", "test_relu", "test_leakyrelu", "test_sigmoid", "test_tanh", "test_elu", "test_gelu_default_1",
    "test_softmax_axis_0", "test_softmax_axis_1", "test_softmax_default_axis", "test_logsoftmax_axis_1",
    "test_reshape_negative_dim", "test_reshape_one_dim",
    "test_transpose_default", "test_transpose_all_permutations_3", "test_concat_2d_axis_0", "test_concat_3d_axis_1",
    "test_batchnorm_example", "test_batchnorm_epsilon", "test_maxpool_2d_default", "test_maxpool_2d_pads",
    "test_averagepool_2d_default", "test_globalaveragepool", "test_layer_normalization_2d_axis1",
    "test_layer_normalization_4d_axis_negative_1", "test_flatten_axis1", "test_squeeze", "test_unsqueeze_axis_0",
    "test_slice", "test_gather_0", "test_split_equal_parts_1d_opset18", "test_reduce_mean_default_axes_keepdims_example",
    "test_reduce_sum_keepdims_example", "test_reduce_max_keepdims_example", "test_sqrt", "test_exp", "test_log",
    "test_clip_default_inbounds", "test_where_example", "test_cast_FLOAT_to_FLOAT16", "test_expand_dim_changed", "test_tile",
    "test_constant_pad", "test_identity", "test_erf", "test_abs", "test_neg",
)


# -- worker ------------------------------------------------------------------------------------


def worker_main(ranks: list[int], fallback: str | None) -> int:
    """Read case names on stdin; write ``MARK start|result ...`` lines on the protocol pipe.

    fd 1 is pointed at stderr so that anything TVM or onnx prints cannot corrupt the protocol.
    """
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    from backends.tvm.executable import configure_threads

    configure_threads(1)
    cases = load_cases()
    crash_on = os.environ.get(CRASH_ENV, "")  # test hook: die like a segfault on this case
    proto.write(MARK + "ready\n")
    for line in sys.stdin:
        name = line.strip()
        if not name:
            continue
        proto.write(MARK + "start " + name + "\n")
        case = cases[name]
        if name == crash_on:
            os.abort()
        results: list[CaseResult] = []
        if 1 in ranks:
            tvm, _ = run_case(case, ranks=1)
            results.append(tvm)
            if fallback:
                if tvm.status != "pass":
                    results.append(run_case(case, ranks=1, fallback=fallback)[0])
                else:
                    results.append(CaseResult(**{**tvm.to_json(), "mode": "fallback"}))
        if 2 in ranks:
            results.append(run_case(case, ranks=2)[0])
        for r in results:
            proto.write(MARK + "result " + json.dumps(r.to_json()) + "\n")
        proto.write(MARK + "done " + name + "\n")
    return 0


# -- supervisor --------------------------------------------------------------------------------


class Supervisor:
    """Feeds one worker process at a time with a list of cases; restarts it after a crash."""

    def __init__(self, names: list[str], args: argparse.Namespace, on_result) -> None:
        self.names = names
        self.args = args
        self.on_result = on_result
        self.restarts = 0

    def _modes(self) -> list[str]:
        modes = []
        if 1 in self.args.ranks:
            modes.append("tvm")
            if self.args.fallback:
                modes.append("fallback")
        if 2 in self.args.ranks:
            modes.append("2rank")
        return modes

    def _spawn(self, names: list[str], log) -> tuple[subprocess.Popen, queue.Queue]:
        env = dict(os.environ, TVM_NUM_THREADS="1", OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
        env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker",
               "--ranks", ",".join(map(str, self.args.ranks)), "--fallback", self.args.fallback or "none"]
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True, cwd=ROOT,
                                env=env)
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write("".join(n + "\n" for n in names))
        proc.stdin.close()
        lines: queue.Queue = queue.Queue()

        def pump() -> None:
            for line in proc.stdout:
                if line.startswith(MARK):
                    lines.put(line[len(MARK):].rstrip("\n"))
            lines.put(None)

        threading.Thread(target=pump, daemon=True).start()
        return proc, lines

    def run(self) -> None:
        todo = list(self.names)
        while todo:
            with tempfile.TemporaryFile("w+") as log:
                proc, lines = self._spawn(todo, log)
                current, got = None, set()
                timeout = self.args.load_timeout
                while True:
                    try:
                        msg = lines.get(timeout=timeout)
                    except queue.Empty:
                        proc.kill()
                        proc.wait()
                        if current is None:
                            raise SystemExit(f"conformance worker gave no sign of life within {timeout:.0f} s")
                        self._lost(current, got, "timeout", f"no result within {timeout:.0f} s; worker killed")
                        break
                    if msg is None:
                        rc = proc.wait()
                        if current is not None:
                            log.seek(0)
                            tail = [ln for ln in log.read().strip().splitlines() if ln.strip()][-1:] or [""]
                            self._lost(current, got, "crash", f"worker died with exit status {rc}: {tail[0][:300]}")
                        elif todo and rc != 0:
                            log.seek(0)
                            raise SystemExit(f"conformance worker failed before any case (exit {rc}):\n{log.read()[-2000:]}")
                        break
                    kind, _, rest = msg.partition(" ")
                    if kind == "ready":
                        timeout = self.args.case_timeout
                    elif kind == "start":
                        current, got = rest, set()
                    elif kind == "result":
                        data = json.loads(rest)
                        got.add(data["mode"])
                        self.on_result(CaseResult(**data))
                    elif kind == "done":
                        todo.remove(rest)
                        current = None
                if current is not None:
                    todo.remove(current)
                    self.restarts += 1

    def _lost(self, name: str | None, got: set[str], status: str, reason: str) -> None:
        if name is None:
            return
        for mode in self._modes():
            if mode not in got:
                self.on_result(CaseResult(name, mode, status, reason=reason))


# -- report ------------------------------------------------------------------------------------


def _status_for_totals(r: CaseResult) -> str:
    return "single-only" if r.mode == "2rank" and r.strategy == "single-only" else r.status


def build_report(cases: dict[str, Any], ops: dict[str, str], selected: list[str], skipped: dict[str, str],
                 results: list[CaseResult], args: argparse.Namespace, seconds: float, restarts: int) -> dict[str, Any]:
    import onnx
    import onnxruntime
    import tvm

    from tests.conformance.backend import host_target

    by_mode: dict[str, dict[str, CaseResult]] = defaultdict(dict)
    for r in results:
        by_mode[r.mode][r.name] = r
    modes = [m for m in MODES if by_mode.get(m)]
    totals: dict[str, Counter] = {m: Counter() for m in modes}
    per_op: dict[str, dict[str, Any]] = defaultdict(lambda: {"cases": 0, **{m: Counter() for m in modes}})
    for name in [*selected, *skipped]:
        op = ops[name]
        per_op[op]["cases"] += 1
        for m in modes:
            st = "skip" if name in skipped else (_status_for_totals(by_mode[m][name]) if name in by_mode[m] else "missing")
            per_op[op][m][st] += 1
            totals[m][st] += 1

    def supported(mode: str) -> list[str]:
        return sorted(op for op, d in per_op.items() if d[mode]["pass"] == d["cases"])

    def listing(mode: str, statuses: tuple[str, ...]) -> list[dict[str, str]]:
        return [{"name": r.name, "op": ops[r.name], "status": r.status, "kind": r.kind, "reason": r.reason}
                for r in sorted(by_mode[mode].values(), key=lambda r: r.name) if r.status in statuses]

    report: dict[str, Any] = {
        "format": "partitioner.conformance/2",
        "suite": "onnx node tests (onnx.backend.test.loader.load_model_tests(kind='node'))",
        "selection": args.selection,
        "cases_total": len(cases),
        "cases_selected": len(selected) + len(skipped),
        "cases_skipped_by_filter": len(skipped),
        "seconds": round(seconds, 1),
        "jobs": args.jobs,
        "worker_restarts": restarts,
        "machine": {"platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count(),
                    "target": host_target()},
        "versions": {"onnx": onnx.__version__, "onnxruntime": onnxruntime.__version__, "tvm": str(tvm.__version__)},
        "rule": "an op is supported in a mode when all of its node cases pass in that mode; skipped cases count as not passed",
        "totals": {m: dict(sorted(totals[m].items())) for m in modes},
        "pass": {m: totals[m]["pass"] for m in modes},
        "pass_with_specialised_shape_inputs": {m: sum(1 for r in by_mode[m].values() if r.status == "pass" and r.specialised)
                                               for m in modes},
        "errors_by_kind": {m: dict(Counter(r.kind or "?" for r in by_mode[m].values() if r.status == "error"))
                           for m in modes},
        "pass_by_engine": {m: dict(Counter(r.engine or "?" for r in by_mode[m].values() if r.status == "pass"))
                           for m in modes},
        "fallback_rule": "per-segment ONNX Runtime fallback as `partitioner compile --fallback onnxruntime` "
                         "(compiler.build_artifact), whole rank when its TVM build fails",
        "supported_ops": {m: supported(m) for m in modes},
        "supported_op_count": {m: len(supported(m)) for m in modes},
        "op_count": len(per_op),
        "ops": {op: {"cases": d["cases"], **{m: dict(sorted(d[m].items())) for m in modes}}
                for op, d in sorted(per_op.items())},
        "mismatches": {m: listing(m, ("mismatch",)) for m in modes},
        "crashes_and_errors": {m: listing(m, ("crash", "timeout", "error")) for m in modes},
        "refusals": {m: listing(m, ("refused",)) for m in modes if m != "2rank"},
        "skipped": [{"name": n, "op": ops[n], "reason": why} for n, why in sorted(skipped.items())],
    }
    if "2rank" in modes:
        split = [r for r in by_mode["2rank"].values() if r.strategy not in ("", "single-only")]
        report["2rank_strategies"] = dict(Counter(r.strategy for r in split))
        report["2rank_split_cases"] = [{"name": r.name, "op": ops[r.name], "strategy": r.strategy, "status": r.status}
                                       for r in sorted(split, key=lambda r: r.name)]
        report["2rank_note"] = ("a case no strategy splits over 2 ranks (node cases are tiny: batch 1 or 3, no weights) "
                                "is single-only and covered by the 1-rank figures")
        report["refusals"]["2rank"] = [x for x in listing("2rank", ("refused",))
                                       if by_mode["2rank"][x["name"]].strategy != "single-only"]
    return report


# -- main --------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sel = p.add_mutually_exclusive_group()
    sel.add_argument("--full", action="store_true", help="run all node cases (default: the fast sample)")
    sel.add_argument("--only", metavar="REGEX", help="run the cases whose name matches REGEX (re.search)")
    p.add_argument("--limit", type=int, default=0, help="run at most N of the selected cases (0: all)")
    p.add_argument("--ranks", default="1,2", help="comma list of rank counts to run: 1, 2 or 1,2 (default)")
    p.add_argument("--fallback", default="onnxruntime", choices=("onnxruntime", "none"),
                   help="rerun TVM-unsupported-op refusals on ONNX Runtime and report both figures (default)")
    p.add_argument("--jobs", type=int, default=2, help="worker processes (default 2)")
    p.add_argument("--case-timeout", type=float, default=180.0, help="seconds one case may take before its worker is killed")
    p.add_argument("--load-timeout", type=float, default=300.0, help="seconds a worker may take to load the cases")
    p.add_argument("--out", type=Path, help="JSON output (default benchmarks/results/conformance[_sample].json)")
    p.add_argument("--no-filter", action="store_true", help="ignore filter.txt")
    p.add_argument("--markdown", nargs="?", const=RESULTS_DIR / "conformance.json", type=Path, metavar="JSON",
                   help="print the README table from a results JSON (default benchmarks/results/conformance.json) and exit")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    try:
        args.ranks = sorted({int(x) for x in args.ranks.split(",") if x.strip()})
    except ValueError:
        p.error(f"--ranks {args.ranks!r}: give 1, 2 or 1,2")
    if not args.ranks or any(r not in (1, 2) for r in args.ranks):
        p.error(f"--ranks {args.ranks}: give 1, 2 or 1,2")
    args.fallback = None if args.fallback == "none" else args.fallback
    if args.jobs < 1:
        p.error("--jobs must be at least 1")
    return args


MODE_LABELS = {"tvm": "1 rank, TVM only", "fallback": "1 rank, TVM + ONNX Runtime fallback (per segment)",
               "2rank": "2 ranks (cpu:2), TVM only"}
OLD_FALLBACK_LABEL = "1 rank, TVM + whole-program ONNX Runtime fallback (format-1 run)"


def _split_old_refusals(report: dict[str, Any], mode: str, totals: dict[str, int]) -> tuple[int, int]:
    """Format 1 counted every PartitionerError as refused: re-derive (refused, error) from the
    recorded reasons with :func:`cases.reason_is_refusal`."""
    listed = report.get("refusals", {}).get(mode, [])
    really = sum(1 for r in listed if reason_is_refusal(r["reason"]))
    return really, totals.get("error", 0) + totals.get("refused", 0) - really


def markdown_table(report: dict[str, Any]) -> str:
    """The README table of a results JSON: per mode, node cases passed out of the selected total
    (and how many of those compiled with shape inputs baked in as constants), supported ops,
    crashes (worker deaths and timeouts), errors, refusals and mismatches; then the errors by
    kind and what ran in the fallback row."""
    total = report["cases_selected"]
    old = report.get("format") == "partitioner.conformance/1"
    baked = report.get("pass_with_specialised_shape_inputs", {})
    lines = [f"ONNX node conformance ({report['selection']}, onnx {report['versions']['onnx']}, "
             f"apache-tvm {report['versions']['tvm']}; {report['cases_skipped_by_filter']} cases skipped by design):",
             "",
             "| mode | node cases passed | of which shape inputs baked in | supported ops | crashes | errors "
             "| refused | mismatches |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for mode, totals in report["totals"].items():
        passed = totals.get("pass", 0)
        extra = ""
        if mode == "2rank":
            extra = f" (split over 2 ranks: {len(report.get('2rank_split_cases', []))}; single-only: {totals.get('single-only', 0)})"
        if old:
            refused, errors = _split_old_refusals(report, mode, totals)
        else:
            refused, errors = totals.get("refused", 0), totals.get("error", 0)
        label = OLD_FALLBACK_LABEL if old and mode == "fallback" else MODE_LABELS.get(mode, mode)
        lines.append(f"| {label} | {passed:,} / {total:,}{extra} | {baked.get(mode, 0):,} | "
                     f"{report['supported_op_count'][mode]} / {report['op_count']} | "
                     f"{totals.get('crash', 0) + totals.get('timeout', 0)} | {errors} | "
                     f"{refused} | {totals.get('mismatch', 0)} |")
    lines.append("")
    if old:
        lines.append("Refused = an op or dtype listed as unsupported before any build; errors = build, pass, "
                     "shape-inference, library-load and run failures (this run predates the split: it is "
                     "re-derived from the recorded reasons, and its fallback row ran whole programs on ONNX "
                     "Runtime; `make conformance` reruns it with the product's per-segment fallback).")
    else:
        kinds = "; ".join(f"{MODE_LABELS.get(m, m)}: " + ", ".join(f"{k} {v}" for k, v in sorted(c.items()))
                          for m, c in report.get("errors_by_kind", {}).items() if c)
        engines = report.get("pass_by_engine", {}).get("fallback", {})
        lines.append("Refused = an op or dtype listed as unsupported before any build; errors = build, pass, "
                     "shape-inference, library-load and run failures" + (f" ({kinds})" if kinds else "") + "."
                     + (" Fallback-row passes by what ran: " + ", ".join(f"{k} {v}" for k, v in sorted(engines.items()))
                        + "." if engines else ""))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.markdown is not None:
        if not args.markdown.is_file():
            print(f"conformance: {args.markdown}: no results JSON; run with --full first", file=sys.stderr)
            return 2
        print(markdown_table(json.loads(args.markdown.read_text())))
        return 0
    if args.worker:
        return worker_main(args.ranks, args.fallback)
    import re

    t_start = time.perf_counter()
    print("conformance: loading the onnx node cases ...", file=sys.stderr, flush=True)
    cases = load_cases()
    ops = case_ops(cases)
    if args.full:
        names, args.selection = sorted(cases), "full"
    elif args.only:
        names, args.selection = sorted(n for n in cases if re.search(args.only, n)), f"only:{args.only}"
    else:
        names, args.selection = [n for n in SAMPLE if n in cases], "sample"
    if args.limit:
        names = names[: args.limit]
        args.selection += f" (first {args.limit})"
    rules = () if args.no_filter else read_filter()
    skipped = {n: why for n in names if (why := skip_reason(n, rules))}
    selected = [n for n in names if n not in skipped]
    out = args.out or RESULTS_DIR / ("conformance.json" if args.full else "conformance_sample.json")

    results: list[CaseResult] = []
    lock = threading.Lock()
    done_cases: Counter = Counter()
    tvm_pass = Counter()
    tty = sys.stderr.isatty()
    n_modes = (2 if 1 in args.ranks and args.fallback else 1 if 1 in args.ranks else 0) + (1 if 2 in args.ranks else 0)

    def on_result(r: CaseResult) -> None:
        with lock:
            results.append(r)
            if r.status == "pass":
                tvm_pass[r.mode] += 1
            done_cases[r.name] += 1
            if done_cases[r.name] == n_modes:
                k = sum(1 for v in done_cases.values() if v == n_modes)
                line = (f"[{k}/{len(selected)}] {time.perf_counter() - t_start:5.0f}s pass: "
                        + " ".join(f"{m}={tvm_pass[m]}" for m in MODES if m in tvm_pass or m == "tvm") + f"  {r.name}")
                if tty:
                    print("\r" + line[:150].ljust(150), end="", file=sys.stderr, flush=True)
                elif k % 25 == 0 or k == len(selected):
                    print(line, file=sys.stderr, flush=True)

    jobs = max(1, min(args.jobs, len(selected) or 1))
    parts = [selected[i::jobs] for i in range(jobs)]
    sups = [Supervisor(p, args, on_result) for p in parts if p]
    threads = [threading.Thread(target=s.run) for s in sups]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if tty:
        print(file=sys.stderr)
    seconds = time.perf_counter() - t_start
    report = build_report(cases, ops, selected, skipped, results, args, seconds, sum(s.restarts for s in sups))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    summary = "; ".join(f"{m}: " + ", ".join(f"{k} {v}" for k, v in t.items()) for m, t in report["totals"].items())
    print(f"conformance: {len(selected) + len(skipped)} cases in {seconds:.0f} s; {summary}", file=sys.stderr)
    print(f"conformance: supported ops " + ", ".join(f"{m} {n}/{report['op_count']}"
                                                   for m, n in report["supported_op_count"].items()), file=sys.stderr)
    print(f"conformance: wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
