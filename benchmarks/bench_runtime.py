"""Runtime benchmark: zoo ResNet (batch 8) and BERT on 2 ranks, data and pipeline (8 micro-batches).

For each (model, strategy) it compiles an artifact, runs ``partitioner bench`` (warm-up + median of
N, against ONNX Runtime on the source model with the same total thread count) and writes
``benchmarks/results/runtime_<model>_<strategy>.json``.

    .venv/bin/python benchmarks/bench_runtime.py [--backend tvm|onnxruntime] [--repeat N] [--models resnet,bert]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CASES = {"resnet": {"batch": 8}, "bert": {"batch": 8}}
STRATEGIES = {"data": {}, "pipeline": {"microbatches": 8}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", choices=("tvm", "onnxruntime"), default="tvm")
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--models", default="resnet,bert")
    ap.add_argument("--strategies", default="data,pipeline")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = ap.parse_args()

    import onnx

    from models_zoo import build
    from partitioner.artifact import compile as compile_artifact
    from partitioner.commands.bench import bench_artifact, format_table
    from partitioner.errors import PartitionerError

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="bench-runtime-") as tmp:
        for name in args.models.split(","):
            model_path = Path(tmp) / f"{name}.onnx"
            onnx.save(build(name, **CASES[name]), model_path)
            for strategy in args.strategies.split(","):
                label = f"{name} {strategy} x2 ({args.backend})"
                try:
                    art = compile_artifact(str(model_path), "cpu:2", strategy=strategy, backend=args.backend,
                                           fallback="onnxruntime", out_dir=Path(tmp) / f"{name}_{strategy}",
                                           progress=False, **STRATEGIES[strategy])
                    doc = bench_artifact(art.root, repeat=args.repeat, warmup=args.warmup)
                except PartitionerError as exc:
                    print(f"{label}: skipped: {exc}")
                    continue
                doc["case"] = {"model": name, **CASES[name], "strategy": strategy, **STRATEGIES[strategy],
                               "requested_backend": args.backend, "fallback": art.manifest.get("fallback")}
                path = out_dir / f"runtime_{name}_{strategy}.json"
                path.write_text(json.dumps(doc, indent=2, default=str) + "\n")
                print(f"== {label} -> {path.relative_to(ROOT)}")
                print(format_table(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
