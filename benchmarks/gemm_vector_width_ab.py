"""Paired A/B of schedules/vector.py rule 1 on GEMMs, 1 thread: the packed GEMM built with the
vector width from the CPU features (new) and from TVM's llvm_get_vector_width (old), and ONNX
Runtime, timed in interleaved rounds with thread CPU time (median per side).

    PYTHONPATH=$PWD python benchmarks/gemm_vector_width_ab.py [--rounds 9] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

SHAPES = [(512, 512, 512), (1024, 1024, 1024), (2048, 2048, 2048), (512, 128, 128), (512, 128, 512), (512, 512, 128)]


def main() -> int:
    import numpy as np
    import onnxruntime as ort
    import tvm

    import gemm as G
    from backends.tvm.executable import configure_threads
    from backends.tvm.schedules import vector
    from backends.tvm.target import resolve_target

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--shapes", default="", help="MxKxN,... (default: 512^3, 1024^3, 2048^3, bert's three)")
    ap.add_argument("--peak", type=float, default=73e9, help="FMA FLOP/s per core for the %% of peak")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    shapes = [tuple(map(int, s.split("x"))) for s in args.shapes.split(",")] if args.shapes else SHAPES
    target = resolve_target(None)
    configure_threads(1)
    rng = np.random.default_rng(0)
    rows = []
    load_before = open("/proc/loadavg").read().split()[0]
    for m, k, n in shapes:
        a = rng.standard_normal((m, k), dtype=np.float32)
        b = rng.standard_normal((k, n), dtype=np.float32)
        model = G._model((), m, k, n, b)
        fns = {}
        for name, on in (("new", True), ("old", False)):
            vector.VECTOR_WIDTH_FROM_FEATURES = on
            try:
                fn = G._tvm(model, target, True)
            finally:
                vector.VECTOR_WIDTH_FROM_FEATURES = True
            ta = tvm.runtime.tensor(a)
            res = fn(ta)
            got = (res if isinstance(res, tvm.runtime.Tensor) else res[0]).numpy()
            np.testing.assert_allclose(got, a @ b, rtol=1e-4, atol=1e-5 * np.sqrt(k))
            fns[name] = lambda fn=fn, ta=ta: fn(ta)
        so = ort.SessionOptions()
        so.intra_op_num_threads = 1
        so.inter_op_num_threads = 1
        sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
        fns["ort"] = lambda sess=sess, a=a: sess.run(None, {"a": a})
        reps = {}
        for name, f in fns.items():
            f()
            t0 = time.perf_counter()
            f()
            reps[name] = max(1, int(0.05 / max(time.perf_counter() - t0, 1e-7)))
        samples = {name: [] for name in fns}
        for _ in range(args.rounds):
            for name, f in fns.items():
                c0 = time.thread_time()
                for _ in range(reps[name]):
                    f()
                samples[name].append((time.thread_time() - c0) / reps[name])
        flops = 2.0 * m * n * k
        med = {name: statistics.median(s) for name, s in samples.items()}
        row = {"m": m, "k": k, "n": n, "flops": flops, "thread_cpu_median_s": med,
               "gflops": {nm: flops / t / 1e9 for nm, t in med.items()},
               "pct_of_peak": {nm: 100 * flops / t / args.peak for nm, t in med.items()},
               "new_over_old": med["new"] / med["old"], "new_over_ort": med["new"] / med["ort"]}
        rows.append(row)
        print(f"{m}x{k}x{n}: " + "  ".join(f"{nm} {t * 1e3:8.3f} ms ({row['pct_of_peak'][nm]:5.1f}%)" for nm, t in med.items())
              + f"  new/old {row['new_over_old']:.2f}  new/ort {row['new_over_ort']:.2f}", flush=True)
    out = {"target": str(target), "rounds": args.rounds, "peak_flops_assumed": args.peak,
           "loadavg_1min": [load_before, open("/proc/loadavg").read().split()[0]], "rows": rows}
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
