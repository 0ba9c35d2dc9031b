"""The GEMM weight gradient's two im2col forms (``linear.IM2COL_CHANNELS_FIRST``) per resnet layer
shape at a pipeline micro-batch, on TVM, one thread, paired.

Per shape (the zoo resnet-18 at 64x64: layer1 64->64 @16x16, layer2 128 @8x8, layer3 256 @4x4,
layer4 512 @2x2, 3x3 convs, pad 1), a one-Conv model (+ Relu, Flatten, MSE loss) is built into a
1-rank training step (``--backend``, default TVM) twice, with the columns channels first and without; the two steps run in
interleaved rounds (thread CPU, median). Only the weight gradient differs between them.

    .venv/bin/python benchmarks/pipeline_wgrad_forms.py [--batch 2] [--rounds 15]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SHAPES = {"layer1": (64, 16), "layer2": (128, 8), "layer3": (256, 4), "layer4": (512, 2)}


def _model(c: int, hw: int, batch: int):
    from onnx import TensorProto, helper, numpy_helper

    w = numpy_helper.from_array((np.random.default_rng(0).standard_normal((c, c, 3, 3)) * 0.05).astype(np.float32), "w")
    nodes = [helper.make_node("Conv", ["input", "w"], ["y"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["y"], ["out"])]
    g = helper.make_graph(nodes, "conv", [helper.make_tensor_value_info("input", TensorProto.FLOAT, [batch, c, hw, hw])],
                          [helper.make_tensor_value_info("out", TensorProto.FLOAT, [batch, c, hw, hw])], [w])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--layers", default=",".join(SHAPES))
    p.add_argument("--backend", default="tvm", choices=["tvm", "onnxruntime"])
    args = p.parse_args(argv)
    from partitioner.training import SGD
    from partitioner.training.rules import linear
    from partitioner.training.runner import StepRunner
    from partitioner.training.step import build_training_graph

    with tempfile.TemporaryDirectory() as tmp:
        for layer in args.layers.split(","):
            c, hw = SHAPES[layer]
            model = _model(c, hw, args.batch)
            runners = {}
            linear.IM2COL_MIN_ROWS_PER_CHANNEL = 0  # both forms on every shape
            for on in (True, False):
                linear.IM2COL_CHANNELS_FIRST = on
                step = build_training_graph(model, loss="mse", optimizer=SGD(lr=1e-3))
                runners[on] = StepRunner(step, backend=args.backend, workdir=Path(tmp) / f"{layer}{on}")
            linear.IM2COL_CHANNELS_FIRST = True
            rng = np.random.default_rng(1)
            x = rng.standard_normal((args.batch, c, hw, hw)).astype(np.float32)
            y = rng.standard_normal((args.batch, c, hw, hw)).astype(np.float32)
            times = {True: [], False: []}
            for r in runners.values():
                r.step({"input": x}, y)
            for i in range(args.rounds):
                for on in ((True, False) if i % 2 else (False, True)):
                    t = time.thread_time()
                    runners[on].step({"input": x}, y)
                    times[on].append(time.thread_time() - t)
            a, b = (statistics.median(times[k]) * 1e3 for k in (True, False))
            print(f"{args.backend} {layer} {c}ch @{hw}x{hw} batch {args.batch}: channels first {a:.3f} ms, other {b:.3f} ms "
                  f"({b / a:.2f}x), load {os.getloadavg()[0]:.1f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
