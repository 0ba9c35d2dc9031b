"""Depthwise conv + BN + ReLU6 kernels: the depthwise rule against the generic Contraction rule
and ONNX Runtime, on the depthwise layers of MobileNetV2 (224x224 input, width 1), at batch 1 or ``--batch``.

    python benchmarks/depthwise.py [--threads 1,2] [--repeats 7] [--batch 1] [--layers C:HW:K:S,...] [--json FILE]

For each layer: the fused TVM kernel (conv, batch norm, clamp) scheduled by
:class:`~backends.tvm.schedules.depthwise.Depthwise` (the default: input tiled per kernel row at
stride 1, ``TILE_INPUT``, else the padding inlined; ``inline``: the padding inlined also at stride 1) and by
:class:`~backends.tvm.schedules.contraction.Contraction` (and the depthwise rule with a padded
copy per output row / once, what it does with ``PAD_INLINE`` off), called directly on TVM tensors, and
ONNX Runtime on the one-layer ONNX model (whose NCHW layout is ORT's own choice). Times are
medians over interleaved rounds (wall and, for 1 thread, the calling thread's CPU time, which
a shared machine's time slicing does not inflate); GB/s counts the input read once and the
output written once (a memory-bound kernel's floor). Every TVM kernel's output is checked
against numpy first (rtol 1e-4, atol 1e-5). Results: ``benchmarks/results/depthwise.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "depthwise.json"
#: (channels, input size, kernel, stride): MobileNetV2's depthwise layers at 224x224
LAYERS = [(32, 112, 3, 1), (96, 112, 3, 2), (144, 56, 3, 1), (144, 56, 3, 2), (192, 28, 3, 1), (192, 28, 3, 2),
          (384, 14, 3, 1), (576, 14, 3, 1), (576, 14, 3, 2), (960, 7, 3, 1), (240, 28, 5, 1)]


def _layer_model(c: int, hw: int, k: int, s: int, batch: int = 1) -> Any:
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(c + hw + k + s)
    f32 = np.float32
    inits = [numpy_helper.from_array((rng.standard_normal((c, 1, k, k)) * 0.4).astype(f32), "w"),
             numpy_helper.from_array(rng.uniform(0.5, 1.5, c).astype(f32), "scale"),
             numpy_helper.from_array((rng.standard_normal(c) * 0.3).astype(f32), "shift"),
             numpy_helper.from_array((rng.standard_normal(c) * 0.1).astype(f32), "mean"),
             numpy_helper.from_array(rng.uniform(0.5, 1.5, c).astype(f32), "var"),
             numpy_helper.from_array(np.array(0, f32), "lo"), numpy_helper.from_array(np.array(6, f32), "hi")]
    p = (k - 1) // 2
    nodes = [helper.make_node("Conv", ["x", "w"], ["dw"], group=c, kernel_shape=[k, k], strides=[s, s], pads=[p] * 4),
             helper.make_node("BatchNormalization", ["dw", "scale", "shift", "mean", "var"], ["bn"]),
             helper.make_node("Clip", ["bn", "lo", "hi"], ["y"])]
    g = helper.make_graph(nodes, "dw", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, c, hw, hw])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], initializer=inits)
    return onnx.shape_inference.infer_shapes(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]))


def _param_shapes(func: Any) -> list[list[int]]:
    """The parameter buffers' shapes, read from the function's signature (TVMScript)."""
    import re

    sig = func.script().split("):\n", 1)[0]
    return [[int(d) for d in re.findall(r"T\.int64\((\d+)\)", part.split('), "')[0])]
            for part in sig.split("T.Buffer((")[1:]]


def _kernels(model: Any, target: Any) -> tuple[dict[str, Callable[[], Any]], list[Any]]:
    """The fused conv kernel compiled under each rule, and its argument tensors (random)."""
    import tvm
    from tvm import s_tir

    from backends.tvm import pipeline as P
    from backends.tvm.lower import lower_program
    from backends.tvm.schedules import Contraction, Depthwise

    mod = P.pre_legalize(lower_program(model).mod, target)
    with target:
        mod = tvm.transform.Sequential(P.legalize_passes(target))(mod)
    func = next(f for gv, f in mod.functions_items() if gv.name_hint.startswith("fused_conv2d"))
    rng = np.random.default_rng(0)
    args = [tvm.runtime.tensor((rng.standard_normal(shape) * 0.5 + 1.0).astype(np.float32)) for shape in _param_shapes(func)]
    fns: dict[str, Callable[[], Any]] = {}
    outs = []
    import backends.tvm.schedules.depthwise as dmod

    for name, rule, per_row, tile in (("depthwise", Depthwise(), None, True), ("inline", Depthwise(), None, False),
                                      ("pad_per_row", Depthwise(), True, False), ("pad_once", Depthwise(), False, False),
                                      ("contraction", Contraction(), None, False)):
        dmod.PAD_PER_ROW, dmod.PAD_INLINE, dmod.TILE_INPUT = per_row, per_row is None, tile
        with target:
            sch = rule._apply(s_tir.Schedule(func), target)
        dmod.PAD_PER_ROW, dmod.PAD_INLINE, dmod.TILE_INPUT = None, True, True
        lib = tvm.compile(sch.mod["main"].with_attr("global_symbol", "main"), target)
        f = lib["main"]
        f(*args)
        outs.append(args[-1].numpy().copy())
        fns[name] = lambda f=f: f(*args)
    for o in outs[1:]:
        np.testing.assert_allclose(outs[0], o, rtol=1e-4, atol=1e-5)
    return fns, args


def _interleaved(fns: dict[str, Callable[[], Any]], repeats: int) -> dict[str, dict[str, float]]:
    reps = {}
    for name, f in fns.items():
        f()
        t0 = time.perf_counter()
        f()
        reps[name] = max(1, int(0.02 / max(time.perf_counter() - t0, 1e-7)))
    wall: dict[str, list[float]] = {n: [] for n in fns}
    cpu: dict[str, list[float]] = {n: [] for n in fns}
    for _ in range(repeats):
        for name, f in fns.items():
            c0, t0 = time.thread_time(), time.perf_counter()
            for _ in range(reps[name]):
                f()
            wall[name].append((time.perf_counter() - t0) / reps[name])
            cpu[name].append((time.thread_time() - c0) / reps[name])
    return {n: {"wall_us": 1e6 * statistics.median(wall[n]), "thread_cpu_us": 1e6 * statistics.median(cpu[n])}
            for n in fns}


def run(threads_list: list[int], repeats: int, batch: int = 1) -> dict[str, Any]:
    import onnxruntime as ort
    import tvm

    from backends.tvm.executable import configure_threads
    from backends.tvm.target import detect_host_target

    target = tvm.target.Target(detect_host_target())
    rows = []
    for c, hw, k, s in LAYERS:
        model = _layer_model(c, hw, k, s, batch)
        fns, _args = _kernels(model, target)
        x = np.random.default_rng(1).standard_normal((batch, c, hw, hw)).astype(np.float32)
        out_hw = (hw + 2 * ((k - 1) // 2) - k) // s + 1
        moved = 4.0 * batch * (c * hw * hw + c * out_hw * out_hw)
        for threads in threads_list:
            configure_threads(threads)
            so = ort.SessionOptions()
            so.intra_op_num_threads, so.inter_op_num_threads = threads, 1
            sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
            times = _interleaved({**fns, "ort": lambda: sess.run(None, {"x": x})}, repeats)
            row = {"channels": c, "size": hw, "kernel": k, "stride": s, "batch": batch, "threads": threads, **{
                f"{n}_{key}": v for n, t in times.items() for key, v in t.items()}}
            for n in times:
                row[f"{n}_gb_s"] = moved / (times[n]["wall_us"] * 1e-6) / 1e9
            rows.append(row)
            print(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()}), file=sys.stderr)
    return {"target": str(target), "repeats": repeats, "batch": batch, "rows": rows}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--batch", type=int, default=1, help="batch of every layer (mobilenet's b8 rows: 8)")
    ap.add_argument("--layers", default="", metavar="C:HW:K:S,...",
                    help="only these layers (channels:input size:kernel:stride), e.g. 144:28:3:1")
    ap.add_argument("--json", default=str(RESULTS))
    args = ap.parse_args(argv)
    if args.layers:
        LAYERS[:] = [tuple(int(v) for v in item.split(":")) for item in args.layers.split(",")]
    data = run([int(t) for t in args.threads.split(",")], args.repeats, args.batch)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(data, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
