"""Runtime benchmark: zoo ResNet-18 and BERT (batch 8) on 2 ranks, data and pipeline (8 micro-batches).

For each (model, strategy) it compiles an artifact, runs ``partitioner bench`` (warm-up + median of
N; every rank one thread; the partitioned run profiled per rank) against ONNX Runtime on the source
model with the same total thread count and, with ``--baseline single``, against the same model
compiled for 1 rank with the same backend (built once per model, run with all the threads), and
writes ``benchmarks/results/runtime_<model>_<strategy>.json``.

``--overhead`` also measures the per-micro-batch runtime overhead on a tiny model (a 2-stage
pipeline of a 2-layer MLP, 64 micro-batches of 1 sample): the slot per micro-batch minus the
slowest stage's kernel time, into ``runtime_overhead.json``.

``--markdown`` prints the README table from the JSON files already in the results folder.

    .venv/bin/python benchmarks/bench_runtime.py [--backend tvm|onnxruntime] [--baseline single]
        [--repeat N] [--models resnet,bert] [--strategies data,pipeline] [--overhead] [--markdown]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CASES = {"resnet": {"batch": 8}, "bert": {"batch": 8}}
STRATEGIES = {"data": {}, "pipeline": {"microbatches": 8}}
OVERHEAD_MODEL = {"batch": 64, "layers": 2, "hidden": 16, "in_features": 16, "out_features": 8}
OVERHEAD_MICROBATCHES = 64


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.1f}"


def markdown(results_dir: Path) -> str:
    """The README table, from ``runtime_*.json`` (one row per case)."""
    rows = ["| model | strategy | backend | ranks x threads | step ms | samples/s | 1-rank ms (threads) "
            "| vs 1 rank | 1-rank ms, 1 thread | vs 1 rank, 1 thread | ORT ms (threads) | predicted ms | compute / comm / idle ms per rank "
            "| overhead us/micro-batch | load avg |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for path in sorted(results_dir.glob("runtime_*.json")):
        doc = json.loads(path.read_text())
        if "results" not in doc:
            continue
        case, res, st = doc.get("case", {}), doc["results"], doc["settings"]
        part, single, ort = res["partitioned"], res.get("single"), res.get("onnxruntime")
        single1 = res.get("single_1thread")
        split = " ; ".join(f"{_ms(r.get('compute_s'))} / {_ms(r.get('comm_s'))} / {_ms(r.get('idle_s'))}"
                           for r in doc.get("breakdown") or [] if r.get("compute_s") is not None) or "-"
        mb = doc.get("per_microbatch") or {}
        overhead = "-"
        if mb:
            overhead = f"{mb['overhead_s'] * 1e6:.0f}"
            if "best_overhead_s" in mb:
                overhead += f" (best {mb['best_overhead_s'] * 1e6:.0f})"
        strategy = st["strategy"] + (f" x{st['microbatches']}" if st["microbatches"] > 1 else "")
        cells = [f"{case.get('model', path.stem)} (batch {st['batch']})", strategy, st["backend"],
                 f"{part['ranks']} x {part['threads'] // max(1, part['ranks'])}", _ms(part["median_s"]),
                 f"{part['throughput_per_s']:.1f}",
                 f"{_ms(single['median_s'])} ({single['threads']})" if single else "-",
                 f"{single['median_s'] / part['median_s']:.2f}x" if single else "-",
                 _ms(single1["median_s"]) if single1 else "-",
                 f"{single1['median_s'] / part['median_s']:.2f}x" if single1 else "-",
                 f"{_ms(ort['median_s'])} ({ort['threads']})" if ort else "-",
                 _ms(doc["prediction"]["predicted_step_s"]), split, overhead,
                 str((doc.get("machine") or {}).get("load_average_1_5_15min") or "-")]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def _compile(model_path: Path, cluster: str, strategy: str, backend: str, out: Path, **kw: Any) -> Any:
    from partitioner.compiler import compile as compile_artifact

    return compile_artifact(str(model_path), cluster, strategy=strategy, backend=backend, fallback="onnxruntime",
                            out_dir=out, progress=False, **kw)


def overhead(backend: str, repeat: int, warmup: int, tmp: Path, out_dir: Path) -> None:
    import onnx

    from models_zoo import build
    from partitioner.bench import bench_artifact, format_table

    path = tmp / "tiny.onnx"
    onnx.save(build("mlp", **OVERHEAD_MODEL), path)
    art = _compile(path, "cpu:2", "pipeline", backend, tmp / "tiny_pp", microbatches=OVERHEAD_MICROBATCHES)
    doc = bench_artifact(art.root, repeat=repeat, warmup=warmup)
    doc["case"] = {"model": "mlp", **OVERHEAD_MODEL, "strategy": "pipeline", "microbatches": OVERHEAD_MICROBATCHES,
                   "requested_backend": backend, "fallback": art.manifest.get("fallback"),
                   "target_overhead_s": 100e-6}
    (out_dir / "runtime_overhead.json").write_text(json.dumps(doc, indent=2, default=str) + "\n")
    print(f"== overhead: tiny mlp pipeline x2, {OVERHEAD_MICROBATCHES} micro-batches ({backend})")
    print(format_table(doc))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", choices=("tvm", "onnxruntime"), default="tvm")
    ap.add_argument("--baseline", choices=("onnxruntime", "single"), default="single")
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--models", default="resnet,bert")
    ap.add_argument("--strategies", default="data,pipeline")
    ap.add_argument("--overhead", action="store_true", help="also measure the per-micro-batch runtime overhead")
    ap.add_argument("--only-overhead", action="store_true", help="measure only the overhead")
    ap.add_argument("--markdown", action="store_true", help="print the README table from the JSON files and exit")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = ap.parse_args()
    out_dir = Path(args.out)
    if args.markdown:
        print(markdown(out_dir))
        return 0

    import onnx

    from models_zoo import build
    from partitioner.bench import bench_artifact, format_table
    from partitioner.core.errors import PartitionerError

    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="bench-runtime-") as tmp_name:
        tmp = Path(tmp_name)
        if args.overhead or args.only_overhead:
            overhead(args.backend, max(args.repeat, 20), args.warmup, tmp, out_dir)
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
                    doc = bench_artifact(art.root, repeat=args.repeat, warmup=args.warmup,
                                         baseline="single" if single_dir else "onnxruntime", single_dir=single_dir)
                except PartitionerError as exc:
                    print(f"{label}: skipped: {exc}")
                    continue
                doc["case"] = {"model": name, **CASES[name], "strategy": strategy, **STRATEGIES[strategy],
                               "requested_backend": args.backend, "fallback": art.manifest.get("fallback")}
                path = out_dir / f"runtime_{name}_{strategy}.json"
                path.write_text(json.dumps(doc, indent=2, default=str) + "\n")
                print(f"== {label} -> {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}")
                print(format_table(doc), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
