"""Speed of an LSTM model on the TVM backend (``passes.expand_recurrent`` unrolls it) against
ONNX Runtime's own LSTM kernel, one thread.

    python benchmarks/recurrent.py [--quick] [--runs 15] [--configs seq:batch:hidden,...]

Model: :func:`models_zoo.lstm.build_lstm` (2 stacked LSTM layers, input 64, a linear head),
for each (seq, batch, hidden) of ``--configs`` (default: seq 64 and 128, batch 1 and 8, hidden
128 and 256). TVM: the default build (``scheduled`` pipeline, untuned), run through the backend's
own executable; ONNX Runtime: CPUExecutionProvider, ``intra_op_num_threads=1``. Both run on one
thread. Timing: one warm-up each, then ``--runs`` rounds, each timing TVM and ORT back to back
(interleaved, so load changes hit both); the figures are the medians. ``tvm_vs_ort`` is
``ort_ms / tvm_ms`` (speed relative to ORT; >= 0.8 is the goal). Every TVM output is checked
against ORT (rtol 1e-4, atol 1e-5). Results: ``benchmarks/results/recurrent.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "recurrent.json"
CONFIGS = [(s, b, h) for s in (64, 128) for b in (1, 8) for h in (128, 256)]
QUICK = [(64, 1, 128), (64, 8, 256)]
INPUT, LAYERS, CLASSES = 64, 2, 32


def bench(seq: int, batch: int, hidden: int, runs: int, work: Path) -> dict[str, Any]:
    import onnxruntime as ort

    from backends.tvm.build import build
    from backends.tvm.executable import configure_threads, load
    from models_zoo.lstm import build_lstm
    from partitioner.runtime.comm_local import LocalWorld

    m = build_lstm(seq=seq, batch=batch, input_size=INPUT, hidden=hidden, layers=LAYERS, classes=CLASSES)
    x = np.random.default_rng(0).standard_normal((seq, batch, INPUT)).astype(np.float32)
    so = ort.SessionOptions()
    so.intra_op_num_threads, so.inter_op_num_threads = 1, 1
    sess = ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])
    path = work / f"lstm_s{seq}_b{batch}_h{hidden}.so"
    t0 = time.perf_counter()
    build(m, path, options={"pipeline": "scheduled"})
    compile_s = time.perf_counter() - t0
    configure_threads(1)
    exe, comm = load(m, path), LocalWorld(1).communicator(0)
    want = sess.run(None, {"x": x})[0]
    got = exe.run({"x": x}, comm)["y"]
    tvm_t, ort_t = [], []
    for _ in range(runs):
        t0 = time.perf_counter()
        exe.run({"x": x}, comm)
        t1 = time.perf_counter()
        sess.run(None, {"x": x})
        t2 = time.perf_counter()
        tvm_t.append(t1 - t0)
        ort_t.append(t2 - t1)
    tvm_ms, ort_ms = 1e3 * statistics.median(tvm_t), 1e3 * statistics.median(ort_t)
    return {"seq": seq, "batch": batch, "hidden": hidden, "input": INPUT, "layers": LAYERS, "threads": 1,
            "tvm_ms": round(tvm_ms, 3), "ort_ms": round(ort_ms, 3), "tvm_vs_ort": round(ort_ms / tvm_ms, 3),
            "compile_s": round(compile_s, 1), "max_abs_err": float(np.max(np.abs(got - want))),
            "matches_ort": bool(np.allclose(got, want, rtol=1e-4, atol=1e-5)), "runs": runs}


def main(argv: list[str] | None = None) -> int:
    from benchmarks.per_device import machine

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help=f"only {QUICK}")
    ap.add_argument("--configs", default=None, help="seq:batch:hidden,... (default: the full grid)")
    ap.add_argument("--runs", type=int, default=15)
    ap.add_argument("--json", default=str(RESULTS), help="where to write the results")
    args = ap.parse_args(argv)
    configs = QUICK if args.quick else CONFIGS
    if args.configs:
        configs = [tuple(int(v) for v in c.split(":")) for c in args.configs.split(",")]  # type: ignore[misc]
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-recurrent-") as tmp:
        for seq, batch, hidden in configs:
            row = bench(seq, batch, hidden, args.runs, Path(tmp))
            print(json.dumps(row), file=sys.stderr, flush=True)
            rows.append(row)
    data = {"machine": machine(), "settings": {"runs": args.runs, "configs": configs, "model": "models_zoo.lstm.build_lstm",
                                               "tvm_build": "scheduled (default, untuned)", "timing": "interleaved medians"},
            "rows": rows, "worst_tvm_vs_ort": min(r["tvm_vs_ort"] for r in rows)}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(data, indent=1) + "\n")
    print(f"worst TVM/ORT speed ratio: {data['worst_tvm_vs_ort']:.2f} -> {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
