"""Compile time of whole artifacts and per-rank speed of the TVM executable against ONNX Runtime.

Per zoo builder (the small sizes of tests/test_foundation.py, batch 2):

- ``compile_s``: wall time of ``partitioner.compiler.compile`` for 2 ranks with the TVM backend,
  for the ``pipeline`` and the ``data`` plan (load, passes, partition, both rank builds, manifest);
- ``tvm_ms`` / ``ort_ms``: median time of one call of rank 0's program of the *data* plan (its rank
  programs hold no comm ops, so the shard runs alone): the TVM library (``rank0.so``, 1 thread)
  against ONNX Runtime on ``rank0.onnx`` (1 intra-op thread, all graph optimisations), same seeded
  inputs; ``ratio`` = tvm_ms / ort_ms (below 1: TVM is faster). The two outputs are compared too.

Writes ``benchmarks/results/compile_and_shard.json`` (machine, versions, settings, per model).

    .venv/bin/python benchmarks/compile_and_shard.py [--models mlp,bert] [--repeat 20]
    .venv/bin/python benchmarks/compile_and_shard.py --markdown     # table from the saved JSON
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SMALL = {
    "mlp": {}, "resnet": {"image": 32, "width": 16}, "resnet50": {"image": 32, "width": 8},
    "bert": {"seq": 8}, "gpt": {"seq": 8}, "unet": {"image": 32, "base": 8},
    "inception": {"image": 32}, "mobilenet": {"image": 32, "width_mult": 0.5},
}
BATCH = 2
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "compile_and_shard.json"


def _feeds(program, seed: int = 0) -> dict:
    import models_zoo

    return models_zoo.sample_inputs(program, seed)


def _median_ms(fn, repeat: int, warmup: int = 2, budget_s: float = 20.0) -> tuple[float, int]:
    for _ in range(warmup):
        fn()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < repeat and (time.perf_counter() - start < budget_s or len(times) < 3):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3, len(times)


def time_rank(art, repeat: int) -> dict:
    import numpy as np
    import onnxruntime as ort

    from backends.tvm.executable import TvmRankExecutable, configure_threads
    from partitioner.core.comm_ops import is_comm

    program = art.programs[0]
    if any(is_comm(n) for n in program.graph.node):
        return {"skipped": "rank 0 of the data plan has comm ops"}
    feeds = _feeds(program)
    configure_threads(1)
    exe = TvmRankExecutable(program, art.backend_file(0), threads=1)
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    opts.inter_op_num_threads = 1
    opts.log_severity_level = 3
    sess = ort.InferenceSession(str(art.root / "rank0.onnx"), opts, providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    want = dict(zip(names, sess.run(names, feeds)))
    got = exe.run(feeds, None)
    max_abs = max(float(np.max(np.abs(got[k].astype(np.float64) - want[k].astype(np.float64)))) for k in want)
    tvm_ms, n_tvm = _median_ms(lambda: exe.run(feeds, None), repeat)
    ort_ms, n_ort = _median_ms(lambda: sess.run(names, feeds), repeat)
    return {"tvm_ms": round(tvm_ms, 3), "ort_ms": round(ort_ms, 3), "ratio": round(tvm_ms / ort_ms, 2),
            "runs": {"tvm": n_tvm, "ort": n_ort}, "max_abs_vs_ort": max_abs,
            "shard_inputs": {k: list(v.shape) for k, v in feeds.items()}}


def bench_model(name: str, tmp: Path, repeat: int, jobs: int | None) -> dict:
    import models_zoo
    from partitioner.compiler import compile as compile_artifact
    from partitioner.core.errors import PartitionerError

    model = models_zoo.build(name, batch=BATCH, **SMALL[name])
    row: dict = {"model": name, "size": {"batch": BATCH, **SMALL[name]}}
    arts = {}
    for strategy in ("pipeline", "data"):
        t0 = time.perf_counter()
        try:
            arts[strategy] = compile_artifact(model, "cpu:2", strategy=strategy, backend="tvm",
                                              out_dir=tmp / f"{name}_{strategy}", jobs=jobs, progress=False)
            row[f"compile_s_{strategy}"] = round(time.perf_counter() - t0, 2)
        except PartitionerError as exc:
            row[f"compile_s_{strategy}"] = None
            row[f"error_{strategy}"] = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
    if "data" in arts:
        try:
            row.update(time_rank(arts["data"], repeat))
        except PartitionerError as exc:
            row["error_timing"] = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
    return row


def markdown(doc: dict) -> str:
    lines = ["| model | compile pipeline (s) | compile data (s) | TVM rank0 (ms) | ORT rank0 (ms) | TVM/ORT |",
             "|---|---:|---:|---:|---:|---:|"]

    def f(v):
        if v is None:
            return "-"
        return (f"{v:.3f}" if v < 10 else f"{v:.1f}") if isinstance(v, float) else str(v)

    for r in doc["models"]:
        lines.append(f"| {r['model']} | {f(r.get('compile_s_pipeline'))} | {f(r.get('compile_s_data'))} | "
                     f"{f(r.get('tvm_ms'))} | {f(r.get('ort_ms'))} | {f(r.get('ratio'))} |")
    s = doc.get("settings", {})
    lines.append("")
    lines.append(f"2 ranks, batch {s.get('batch')}, 1 thread each side; median of up to {s.get('repeat')} runs; "
                 f"machine: {doc.get('machine', {}).get('processor')} ({doc.get('machine', {}).get('cpus')} CPUs, "
                 f"load average at start {doc.get('machine', {}).get('loadavg')}).")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(SMALL))
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--jobs", type=int, default=1, help="parallel rank builds per compile (default 1)")
    ap.add_argument("--out", default=str(DEFAULT_OUT))
    ap.add_argument("--markdown", action="store_true", help="print a table from the saved JSON and exit")
    args = ap.parse_args()
    out = Path(args.out)
    if args.markdown:
        print(markdown(json.loads(out.read_text())))
        return 0

    import numpy
    import onnx
    import onnxruntime
    import tvm

    from backends.tvm.target import target_dict

    doc = {"machine": {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
                       "cpus": os.cpu_count(), "loadavg": [round(x, 2) for x in os.getloadavg()]},
           "versions": {"python": platform.python_version(), "tvm": str(tvm.__version__), "onnx": onnx.__version__,
                        "onnxruntime": onnxruntime.__version__, "numpy": numpy.__version__},
           "settings": {"devices": 2, "batch": BATCH, "backend": "tvm", "target": target_dict(None),
                        "repeat": args.repeat, "threads": 1, "jobs": args.jobs,
                        "timed": "rank 0 program of the data plan (no comm ops): rank0.so vs rank0.onnx under ORT"},
           "models": []}
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="compile-and-shard-") as tmp:
        for name in args.models.split(","):
            row = bench_model(name, Path(tmp), args.repeat, args.jobs)
            doc["models"].append(row)
            out.write_text(json.dumps(doc, indent=2) + "\n")
            print(json.dumps(row), flush=True)
    print(markdown(doc))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
