"""Paired A/B of a schedule knob on GEMMs, 1 thread (or ``--threads``): the packed GEMM built with the defaults
(new) and with ``--baseline`` knobs set (old; default schedules/vector.py rule 1 off, i.e. the
vector width from TVM's llvm_get_vector_width), and ONNX Runtime, timed in interleaved rounds
with thread CPU time (median per side; wall time for more than 1 thread).

    PYTHONPATH=$PWD python benchmarks/gemm_vector_width_ab.py [--rounds 9] [--json FILE]
        [--baseline backends.tvm.schedules.gemm_packed.PACK_A_16_REGISTERS=False ...] [--new ...]
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import importlib
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Iterator

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

SHAPES = [(512, 512, 512), (1024, 1024, 1024), (2048, 2048, 2048), (512, 128, 128), (512, 128, 512), (512, 512, 128)]


DEFAULT_BASELINE = "backends.tvm.schedules.vector.VECTOR_WIDTH_FROM_FEATURES=False"


def _knobs(specs: list[str]) -> list[tuple[Any, str, Any]]:
    """``MODULE.ATTR=VALUE`` -> (module, attr, value); VALUE a Python literal (else a string).
    Bad input: one-line error, exit 2."""
    out = []
    for spec in specs:
        path, sep, raw = spec.partition("=")
        mod_name, _, attr = path.rpartition(".")
        try:
            mod = importlib.import_module(mod_name) if sep and mod_name else None
        except ImportError:
            mod = None
        if mod is None or not hasattr(mod, attr):
            print(f"error: knob {spec!r}: want MODULE.ATTR=VALUE with an existing module attribute", file=sys.stderr)
            sys.exit(2)
        try:
            value = ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            value = raw
        out.append((mod, attr, value))
    return out


@contextlib.contextmanager
def _set(knobs: list[tuple[Any, str, Any]]) -> Iterator[None]:
    """Set the knobs for the duration of a build, then put the previous values back."""
    saved = [(mod, attr, getattr(mod, attr)) for mod, attr, _ in knobs]
    try:
        for mod, attr, value in knobs:
            setattr(mod, attr, value)
        yield
    finally:
        for mod, attr, value in saved:
            setattr(mod, attr, value)


def main() -> int:
    import numpy as np
    import onnxruntime as ort
    import tvm

    import gemm as G
    from backends.tvm.executable import configure_threads
    from backends.tvm.target import resolve_target

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--shapes", default="", help="MxKxN,... (default: 512^3, 1024^3, 2048^3, bert's three)")
    ap.add_argument("--peak", type=float, default=73e9, help="FMA FLOP/s per core for the %% of peak")
    ap.add_argument("--threads", type=int, default=1,
                    help="threads for both (above 1: wall-clock medians, %% of peak per core)")
    ap.add_argument("--json", default="")
    ap.add_argument("--baseline", action="append", default=[],
                    help=f"MODULE.ATTR=VALUE set while building 'old' (repeatable; default {DEFAULT_BASELINE})")
    ap.add_argument("--new", action="append", default=[], help="MODULE.ATTR=VALUE set while building 'new' (repeatable)")
    args = ap.parse_args()
    baseline = _knobs(args.baseline or [DEFAULT_BASELINE])
    candidate = _knobs(args.new)
    shapes = [tuple(map(int, s.split("x"))) for s in args.shapes.split(",")] if args.shapes else SHAPES
    target = resolve_target(None)
    configure_threads(args.threads)
    clock = time.thread_time if args.threads == 1 else time.perf_counter
    rng = np.random.default_rng(0)
    rows = []
    load_before = open("/proc/loadavg").read().split()[0]
    for m, k, n in shapes:
        a = rng.standard_normal((m, k), dtype=np.float32)
        b = rng.standard_normal((k, n), dtype=np.float32)
        model = G._model((), m, k, n, b)
        fns = {}
        for name, knobs in (("new", candidate), ("old", baseline)):
            with _set(knobs):
                fn = G._tvm(model, target, True)
            ta = tvm.runtime.tensor(a)
            res = fn(ta)
            got = (res if isinstance(res, tvm.runtime.Tensor) else res[0]).numpy()
            np.testing.assert_allclose(got, a @ b, rtol=1e-4, atol=1e-5 * np.sqrt(k))
            fns[name] = lambda fn=fn, ta=ta: fn(ta)
        so = ort.SessionOptions()
        so.intra_op_num_threads = args.threads
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
                c0 = clock()
                for _ in range(reps[name]):
                    f()
                samples[name].append((clock() - c0) / reps[name])
        flops = 2.0 * m * n * k
        med = {name: statistics.median(s) for name, s in samples.items()}
        row = {"m": m, "k": k, "n": n, "flops": flops, "median_s": med,
               "min_s": {name: min(s) for name, s in samples.items()},
               "gflops": {nm: flops / t / 1e9 for nm, t in med.items()},
               "pct_of_peak": {nm: 100 * flops / t / args.peak / args.threads for nm, t in med.items()},
               "new_over_old": med["new"] / med["old"], "new_over_ort": med["new"] / med["ort"]}
        rows.append(row)
        print(f"{m}x{k}x{n}: " + "  ".join(f"{nm} {t * 1e3:8.3f} ms ({row['pct_of_peak'][nm]:5.1f}%)" for nm, t in med.items())
              + f"  new/old {row['new_over_old']:.2f}  new/ort {row['new_over_ort']:.2f}", flush=True)
    out = {"target": str(target), "rounds": args.rounds, "threads": args.threads,
           "clock": "thread_time" if args.threads == 1 else "wall",
           "baseline": args.baseline or [DEFAULT_BASELINE], "new": args.new, "peak_flops_assumed": args.peak,
           "loadavg_1min": [load_before, open("/proc/loadavg").read().split()[0]], "rows": rows}
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
