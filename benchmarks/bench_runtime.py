"""Runtime benchmark: zoo ResNet-18, BERT and MobileNet (batch 8) on 2 ranks, data and pipeline (8 micro-batches),
each row with the cost model's predicted step time and per-rank peak memory beside the measured ones.

For each (model, strategy) it compiles an artifact for ``cpu:2`` (this machine's calibrated figures:
the script calibrates the backend once if the per-machine cache has none, ``--recalibrate`` forces
it), then runs ``--rounds`` (default 3) rounds of ``partitioner bench``; each round runs, one after
the other, the partitioned artifact (every rank one thread, profiled per rank), ONNX Runtime on the
source model with the same total threads and, with ``--baseline single``, the same model compiled
for 1 rank with the same backend on the same total cores (2 threads) and on 1 thread (the 2-rank
artifacts are built for 1 thread per rank, without parallel loops, and the 1-rank one for both
cores: ``partitioner.cost.threads.build_threads``, this machine's cores // ranks). Rounds are
interleaved, so a burst of other load on the machine hits every variant alike; the JSON keeps each
round and ``rounds`` gives min/median/max over them of every median step and speed-up.
It writes ``benchmarks/results/runtime_<model>_<strategy>.json``.

The same run also measures the per-micro-batch runtime overhead on a tiny model (a 2-stage
pipeline of a 2-layer MLP, 64 micro-batches of 1 sample), in the same interleaved rounds against
its 1-rank build: the slot per micro-batch minus the slowest stage's kernel time, into
``runtime_overhead.json`` (``--no-overhead`` skips it; ``--only-overhead`` runs only it). So one
run writes every row of the table.

Each timed variant repeats at least ``--repeat`` steps and at least ``--min-seconds`` of steps (by
the planner's predicted step): a sub-millisecond step timed 10 times gives a median that one
burst of other load moves by 30% (the BERT rows of 2026-12-01: round medians 0.46–0.83 ms).

The predicted peak memory of a row is the runtime's memory rule priced with the constants each
rank's library holds as built (``partitioner/bench.py`` rule 8: a Winograd conv holds 4x its
weights, which the plan, made before the build chooses, does not know); the plan's own figure is
in the JSON beside it (``memory[*].plan_predicted_bytes``).

``--markdown`` prints the README table from the JSON files already in the results folder.

The final table needs a quiet machine (nothing else running; the load average is recorded in
each row). One command (``make runtime-table``), then it regenerates the README:

    .venv/bin/python benchmarks/bench_runtime.py --recalibrate && .venv/bin/python benchmarks/readme_tables.py

    .venv/bin/python benchmarks/bench_runtime.py [--backend tvm|onnxruntime] [--baseline single]
        [--repeat N] [--min-seconds S] [--rounds R] [--models resnet,bert,mobilenet] [--strategies data,pipeline]
        [--no-overhead | --only-overhead] [--recalibrate] [--markdown]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CASES = {"resnet": {"batch": 8}, "bert": {"batch": 8}, "mobilenet": {"batch": 8}}
STRATEGIES = {"data": {}, "pipeline": {"microbatches": 8}}
OVERHEAD_MODEL = {"batch": 64, "layers": 2, "hidden": 16, "in_features": 16, "out_features": 8}
OVERHEAD_MICROBATCHES = 64
TARGET_ERROR = 0.25  # issue 13: predicted within 25% of measured, time and memory, every row


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.1f}"


def _spread(values: list[float]) -> dict[str, float] | None:
    return ({"min": min(values), "median": statistics.median(values), "max": max(values), "n": len(values)}
            if values else None)


def rounds_summary(docs: list[dict[str, Any]]) -> dict[str, Any]:
    """min/median/max over the rounds of each variant's median step, of the speed-ups against the
    partitioned run, and of the measured peak memory of the fullest rank."""
    out: dict[str, Any] = {"rounds": len(docs), "median_s": {}, "speedup": {}}
    for name in docs[0]["results"]:
        out["median_s"][name] = _spread([d["results"][name]["median_s"] for d in docs if name in d["results"]])
        if name != "partitioned":
            out["speedup"][name] = _spread([d["results"][name]["median_s"] / d["results"]["partitioned"]["median_s"]
                                            for d in docs if name in d["results"]])
    out["measured_peak_memory_bytes"] = _spread([d["prediction"]["measured_peak_memory_bytes"] for d in docs
                                                 if d["prediction"].get("measured_peak_memory_bytes")])
    return out


def _cell_spread(sp: dict[str, float] | None, scale: float = 1e3, fmt: str = "{:.1f}", unit: str = "") -> str:
    if not sp:
        return "-"
    f = lambda v: fmt.format(v * scale) + unit  # noqa: E731
    return f"{f(sp['median'])} ({f(sp['min'])}–{f(sp['max'])})" if sp["n"] > 1 else f(sp["median"])


def _error(pred: float | None, meas: float | None) -> str:
    if not pred or not meas:
        return "-"
    e = pred / meas - 1
    return f"{e * 100:+.0f}%" + ("" if abs(e) <= TARGET_ERROR else " ✗")


def _split(doc: dict[str, Any]) -> str:
    """Measured compute / comm / idle ms per step, per rank (worker ``--profile``, last round)."""
    return " ; ".join(f"{_ms(r.get('compute_s'))} / {_ms(r.get('comm_s'))} / {_ms(r.get('idle_s'))}"
                      for r in doc.get("breakdown") or [] if r.get("compute_s") is not None) or "-"


def _overhead(doc: dict[str, Any]) -> str:
    mb = doc.get("per_microbatch") or {}
    if not mb:
        return "-"
    return f"{mb['overhead_s'] * 1e6:.0f}" + (f" (best {mb['best_overhead_s'] * 1e6:.0f})" if "best_overhead_s" in mb else "")


def _row(path: Path, doc: dict[str, Any]) -> str:
    case, res, st = doc.get("case", {}), doc["results"], doc["settings"]
    part = res["partitioned"]
    rounds = doc.get("rounds") or rounds_summary([doc])
    pred = doc["prediction"]
    step = rounds["median_s"]["partitioned"]
    mem_meas = (rounds.get("measured_peak_memory_bytes") or {}).get("median") or pred.get("measured_peak_memory_bytes")
    mem_pred = pred.get("predicted_peak_memory_bytes")
    strategy = st["strategy"] + (f" x{st['microbatches']}" if st["microbatches"] > 1 else "")
    mib = lambda b: "-" if not b else f"{b / 2**20:.1f}"  # noqa: E731
    cells = [f"{case.get('model', path.stem)} (batch {st['batch']})", strategy, st["backend"],
             f"{part['ranks']} x {part['threads'] // max(1, part['ranks'])}", str(rounds["rounds"]),
             _cell_spread(step), _ms(pred["predicted_step_s"]), _error(pred["predicted_step_s"], step["median"]),
             _cell_spread(rounds["speedup"].get("single"), 1, "{:.2f}", "x"),
             _cell_spread(next((v for k, v in rounds["speedup"].items() if k.startswith("single_")), None), 1,
                          "{:.2f}", "x"),
             _cell_spread(rounds["speedup"].get("onnxruntime"), 1, "{:.2f}", "x"),
             mib(mem_pred), mib(mem_meas), _error(mem_pred, mem_meas), _split(doc), _overhead(doc),
             str((doc.get("machine") or {}).get("load_average_1_5_15min") or "-")]
    return "| " + " | ".join(cells) + " |"


def markdown(results_dir: Path) -> str:
    """The README table, from ``runtime_*.json`` (one row per case): median (min–max) over the
    interleaved rounds; speed-ups are 1-rank (or ORT) step / partitioned step, so > 1 means the
    split is faster; errors are predicted / measured - 1, marked ✗ beyond 25%."""
    rows = ["| model | strategy | backend | ranks x threads | rounds | step ms | predicted ms | time error "
            "| vs 1 rank, same cores | vs 1 rank, 1 thread | vs ORT, same cores | predicted peak MiB/rank "
            "| measured peak MiB/rank | memory error | compute / comm / idle ms per rank | overhead us/micro-batch "
            "| load avg |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for path in sorted(results_dir.glob("runtime_*.json")):
        doc = json.loads(path.read_text())
        if "results" in doc:
            rows.append(_row(path, doc))
    return "\n".join(rows)


def _compile(model_path: Path, cluster: str, strategy: str, backend: str, out: Path, **kw: Any) -> Any:
    from partitioner.compiler import compile as compile_artifact

    return compile_artifact(str(model_path), cluster, strategy=strategy, backend=backend, fallback="onnxruntime",
                            out_dir=out, progress=False, **kw)


def ensure_calibration(backend: str, force: bool) -> str:
    """This machine's calibration for ``backend`` (run once, or again with ``force``); returns the
    cache file's path, which ``cpu:N`` then reads."""
    from partitioner.calibrate import calibrate_and_cache
    from partitioner.calibrate_cache import cache_path, load_cached

    if force or load_cached(backend) is None:
        print(f"calibrating the {backend} backend on this machine ...", flush=True)
        calibrate_and_cache(backend, quick=False)
    return str(cache_path(backend))


def repeat_for(art: Any, args: argparse.Namespace) -> int:
    """Steps per timed variant: ``--repeat``, raised so the steps last ``--min-seconds`` by the
    planner's predicted step (the prediction only sizes the run; the measurement is the median)."""
    pred = (art.manifest.get("prediction") or {}).get("step_latency_s") or 0.0
    return max(args.repeat, min(2000, math.ceil(args.min_seconds / pred)) if pred > 0 else args.repeat)


def overhead(args: argparse.Namespace, tmp: Path, out_dir: Path) -> None:
    """The overhead row: a tiny MLP pipeline of 64 micro-batches, rounds as every other row."""
    import onnx

    from models_zoo import build
    from partitioner.bench import format_table

    path = tmp / "tiny.onnx"
    onnx.save(build("mlp", **OVERHEAD_MODEL), path)
    art = _compile(path, "cpu:2", "pipeline", args.backend, tmp / "tiny_pp", microbatches=OVERHEAD_MICROBATCHES)
    single = _compile(path, "cpu:1", "single", args.backend, tmp / "tiny_single").root if args.baseline == "single" else None
    doc = bench_case(art, single, args)
    doc["case"] = {"model": "mlp", **OVERHEAD_MODEL, "strategy": "pipeline", "microbatches": OVERHEAD_MICROBATCHES,
                   "requested_backend": args.backend, "fallback": art.manifest.get("fallback"),
                   "target_overhead_s": 100e-6}
    (out_dir / "runtime_overhead.json").write_text(json.dumps(doc, indent=2, default=str) + "\n")
    print(f"== overhead: tiny mlp pipeline x2, {OVERHEAD_MICROBATCHES} micro-batches ({args.backend})")
    print(format_table(doc))


def bench_case(art: Any, single_dir: Path | None, args: argparse.Namespace) -> dict[str, Any]:
    """``--rounds`` interleaved rounds of ``bench_artifact``; the last round's document, with
    every round's results and their min/median/max (``rounds``)."""
    from partitioner.bench import bench_artifact

    repeat = repeat_for(art, args)
    docs = [bench_artifact(art.root, repeat=repeat, warmup=args.warmup,
                           baseline="single" if single_dir else "onnxruntime", single_dir=single_dir)
            for _ in range(args.rounds)]
    doc = docs[-1]
    doc["rounds"] = rounds_summary(docs)
    doc["per_round"] = [{"results": {k: {"median_s": v["median_s"]} for k, v in d["results"].items()},
                         "memory": d["memory"], "load_average": d["machine"].get("load_average_1_5_15min")}
                        for d in docs]
    return doc


def _args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", choices=("tvm", "onnxruntime"), default="tvm")
    ap.add_argument("--baseline", choices=("onnxruntime", "single"), default="single")
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--min-seconds", type=float, default=0.5,
                    help="each timed variant runs at least this long (by the predicted step)")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds per case (min/median/max; >= 3)")
    ap.add_argument("--models", default="resnet,bert,mobilenet")
    ap.add_argument("--strategies", default="data,pipeline")
    ap.add_argument("--recalibrate", action="store_true", help="calibrate the backend again before compiling")
    ap.add_argument("--overhead", action="store_true", help=argparse.SUPPRESS)  # the default now; kept for old scripts
    ap.add_argument("--no-overhead", action="store_true", help="skip the per-micro-batch overhead row")
    ap.add_argument("--only-overhead", action="store_true", help="measure only the overhead")
    ap.add_argument("--markdown", action="store_true", help="print the README table from the JSON files and exit")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    return ap.parse_args()


def main() -> int:
    args = _args()
    out_dir = Path(args.out)
    if args.markdown:
        print(markdown(out_dir))
        return 0

    import onnx

    from models_zoo import build
    from partitioner.bench import format_table
    from partitioner.core.errors import PartitionerError

    out_dir.mkdir(parents=True, exist_ok=True)
    calibration = ensure_calibration(args.backend, args.recalibrate)
    with tempfile.TemporaryDirectory(prefix="bench-runtime-") as tmp_name:
        tmp = Path(tmp_name)
        if not args.no_overhead or args.only_overhead:
            overhead(args, tmp, out_dir)
        if args.only_overhead:
            return 0
        for name in args.models.split(","):
            model_path = tmp / f"{name}.onnx"
            onnx.save(build(name, **CASES[name]), model_path)
            single_dir = None
            if args.baseline == "single":
                try:
                    single_dir = _compile(model_path, "cpu:1", "single", args.backend, tmp / f"{name}_single").root
                except PartitionerError as exc:
                    print(f"{name} single ({args.backend}): skipped: {exc}")
            for strategy in args.strategies.split(","):
                label = f"{name} {strategy} x2 ({args.backend})"
                try:
                    art = _compile(model_path, "cpu:2", strategy, args.backend, tmp / f"{name}_{strategy}",
                                   **STRATEGIES[strategy])
                    doc = bench_case(art, single_dir, args)
                except PartitionerError as exc:
                    print(f"{label}: skipped: {exc}")
                    continue
                doc["case"] = {"model": name, **CASES[name], "strategy": strategy, **STRATEGIES[strategy],
                               "requested_backend": args.backend, "fallback": art.manifest.get("fallback"),
                               "calibration": calibration, "cluster_notes": art.manifest.get("cluster", {}).get("notes")}
                path = out_dir / f"runtime_{name}_{strategy}.json"
                path.write_text(json.dumps(doc, indent=2, default=str) + "\n")
                print(f"== {label} -> {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}")
                print(format_table(doc), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
