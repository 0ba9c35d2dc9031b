"""Session 25's copy kernels alone: transposes with a reshape or elementwise work fused in, plain
layout transposes, and Exp, each built by the TVM backend with the rule on and off, checked
against numpy, and timed in interleaved rounds in one process.

What each knob is: ``backends/tvm/schedules/transpose_tiles.py`` (``TILE_LINEAR_TRANSPOSE``,
``ROW_TILE_BY_SOURCE``, ``TILE_STRIDED_TRANSPOSE``) and ``backends/tvm/pipeline.py``
(``_fast_exp``; "exact" legalises Exp with TVM's default, a scalar ``expf`` per element).
Times are wall per call (``Executable.run``, output allocation included), the median over
``--rounds`` rounds of each variant's median of ``--calls`` calls.

    .venv/bin/python benchmarks/copy_kernels_micro.py [--threads 1] [--rounds 5] [--calls 20] [--json F]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# name -> (input shape, model kind (:func:`model`), {variant: knob settings applied to its build})
LINEAR = {"default": {}, "linear off": {"transpose_tiles.TILE_LINEAR_TRANSPOSE": False}}
CASES = {
    "bert X^T [32,64,1024]->[1024,2048]": ([32, 64, 1024], "reshape_t", LINEAR),
    "bert X^T [32,64,256]->[256,2048]": ([32, 64, 256], "reshape_t", LINEAR),
    "stem x*s+b NCHW->HWNC [64,64,32,32]": ([64, 64, 32, 32], "affine_t", LINEAR),
    "NHWC->NCHW [16,32,32,64]": ([16, 32, 32, 64], "nchw", {
        "default": {}, "second-innermost row": {"transpose_tiles.ROW_TILE_BY_SOURCE": False},
        "untiled": {"transpose_tiles.TILE_STRIDED_TRANSPOSE": False}}),
    "NHWC->NCHW [64,32,32,64]": ([64, 32, 32, 64], "nchw", {
        "default": {}, "second-innermost row": {"transpose_tiles.ROW_TILE_BY_SOURCE": False},
        "untiled": {"transpose_tiles.TILE_STRIDED_TRANSPOSE": False}}),
    "bert K^T batch 8 [8,64,128]->[8,4,32,64]": ([8, 64, 128], "kt", LINEAR),
    "exp(-x^2)*x [2048,1024]": ([2048, 1024], "exp", {"default": {}, "exact": {"exact_exp": True}}),
}


def model(shape: list[int], kind: str):
    """The case's ONNX model (input ``x``, output ``y``) and its numpy reference. Kinds: ``reshape_t``
    (Reshape to 2-D, Transpose), ``kt`` (split heads, Transpose to K^T), ``affine_t`` (per-channel
    x * s + b, Transpose NCHW -> HWNC), ``nchw`` (Transpose NHWC -> NCHW), ``exp`` (exp(-x^2) * x)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    n = helper.make_node
    inits, rng = [], np.random.default_rng(1)
    if kind == "reshape_t":
        merged = [shape[0] * shape[1], shape[2]]
        inits = [numpy_helper.from_array(np.array(merged, np.int64), "shape")]
        nodes, ref = [n("Reshape", ["x", "shape"], ["r"]), n("Transpose", ["r"], ["y"], perm=[1, 0])], \
            lambda x: x.reshape(merged).T
    elif kind == "kt":
        split = [shape[0], shape[1], 4, shape[2] // 4]
        inits = [numpy_helper.from_array(np.array(split, np.int64), "shape")]
        nodes, ref = [n("Reshape", ["x", "shape"], ["r"]), n("Transpose", ["r"], ["y"], perm=[0, 2, 3, 1])], \
            lambda x: x.reshape(split).transpose(0, 2, 3, 1)
    elif kind == "affine_t":
        s, b = (rng.standard_normal([1, shape[1], 1, 1]).astype(np.float32) for _ in range(2))
        inits = [numpy_helper.from_array(s, "s"), numpy_helper.from_array(b, "b")]
        nodes = [n("Mul", ["x", "s"], ["m"]), n("Add", ["m", "b"], ["a"]),
                 n("Transpose", ["a"], ["y"], perm=[2, 3, 0, 1])]
        ref = lambda x: (x * s + b).transpose(2, 3, 0, 1)  # noqa: E731
    elif kind == "nchw":
        nodes, ref = [n("Transpose", ["x"], ["y"], perm=[0, 3, 1, 2])], lambda x: x.transpose(0, 3, 1, 2)
    else:  # exp
        nodes = [n("Mul", ["x", "x"], ["s"]), n("Neg", ["s"], ["ng"]), n("Exp", ["ng"], ["e"]),
                 n("Mul", ["e", "x"], ["y"])]
        ref = lambda x: np.exp(-x.astype(np.float64) ** 2) * x  # noqa: E731
    out = list(ref(np.zeros(shape, np.float32)).shape)
    g = helper.make_graph(nodes, kind, [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, out)], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), ref


def built(m, settings: dict, work: Path):
    """``m`` built and loaded with ``settings`` applied during the build (restored after)."""
    import backends.tvm as bt
    from backends.tvm import pipeline
    from backends.tvm.schedules import transpose_tiles

    saved, fast_map = {}, pipeline._fast_math_map
    for key, value in settings.items():
        if key == "exact_exp":
            pipeline._fast_math_map = lambda: {k: v for k, v in fast_map().items() if k != "relax.exp"}
            continue
        attr = key.split(".")[1]
        saved[attr] = getattr(transpose_tiles, attr)
        setattr(transpose_tiles, attr, value)
    try:
        path = work / f"{len(list(work.iterdir()))}.so"
        bt.build(m, path)
        return bt.load(m, path)
    finally:
        pipeline._fast_math_map = fast_map
        for attr, value in saved.items():
            setattr(transpose_tiles, attr, value)


def run_case(name: str, rounds: int, calls: int, work: Path) -> dict:
    from partitioner.runtime.comm_local import LocalWorld

    shape, kind, variants = CASES[name]
    m, ref = model(shape, kind)
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    comm = LocalWorld(1).communicator(0)
    exes = {v: built(m, s, work) for v, s in variants.items()}
    for v, ex in exes.items():  # every build checked before it is timed
        got = ex.run({"x": x}, comm)["y"]
        np.testing.assert_allclose(got, ref(x), rtol=1e-5, atol=1e-6, err_msg=f"{name}: {v}")
    per_round: dict[str, list[float]] = {v: [] for v in exes}
    for r in range(rounds):
        for v in (list(exes) if r % 2 == 0 else list(exes)[::-1]):
            ts = []
            for _ in range(calls):
                t = time.perf_counter()
                exes[v].run({"x": x}, comm)
                ts.append(time.perf_counter() - t)
            per_round[v].append(statistics.median(ts))
    row = {"case": name, "ms": {v: statistics.median(t) * 1e3 for v, t in per_round.items()},
           "ms_per_round": {v: [t * 1e3 for t in ts] for v, ts in per_round.items()}}
    print(f"{name:42s} " + "  ".join(f"{v} {ms:.3f} ms" for v, ms in row["ms"].items()), flush=True)
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args(argv)
    from backends.tvm.executable import configure_threads

    configure_threads(a.threads)
    with tempfile.TemporaryDirectory() as tmp:
        rows = [run_case(name, a.rounds, a.calls, Path(tmp)) for name in CASES]
    doc = {"threads": a.threads, "rounds": a.rounds, "calls": a.calls, "load_after": os.getloadavg(),
           "rows": rows, "note": "wall ms per call, median over rounds of each round's median; "
                                 "every build checked against numpy"}
    if a.json:
        a.json.write_text(json.dumps(doc, indent=1))
        print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
