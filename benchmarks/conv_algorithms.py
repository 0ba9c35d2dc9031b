"""Direct vs im2col+GEMM vs Winograd for the 3x3 convolutions of ResNet, on this CPU, with the
TVM backend's default schedules (no tuning).

The survey (Ben-Nun & Hoefler, section 4.2) lists three ways to compute a convolution: direct,
im2col followed by one GEMM, and Winograd's minimal filtering F(m x m, 3 x 3), which trades
multiplications for transforms. This script builds each one as Relax/TE for one NHWC conv+ReLU
(stride 1, pad 1, the weights constant and transformed at compile time), schedules it with
``backends.tvm.schedules`` exactly as a model build would, times it (median of ``--runs`` after
a warm-up, ``--threads`` TVM threads) and checks it against ONNX Runtime's Conv (max error
relative to the output's max |value|; Winograd's transforms round differently).

- ``direct``: ``relax.op.nn.conv2d`` NHWC/HWIO, what the backend builds;
- ``im2col``: a ``[N*H*W, 9*C]`` patch matrix (injective) times the ``[9*C, CO]`` weights;
- ``winograd``: input transform ``B^T d B``, 36 batched GEMMs over channels, output transform
  ``A^T M A`` (F(4x4, 3x3)).

These are the stages ``--conv-algorithm`` builds (the TE comes from
``backends/tvm/conv_algorithms.py``); ``auto`` makes the same comparison per conv at compile time.

Shapes: the 3x3 layers of the benchmark's resnet18 (112x112 input) at batch 8.
Writes ``benchmarks/results/conv_algorithms.json``; ``--markdown`` renders the README table.

    .venv/bin/python benchmarks/conv_algorithms.py [--threads 1] [--runs 10]
    .venv/bin/python benchmarks/conv_algorithms.py --markdown
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "conv_algorithms.json"
# (N, H, W, C, CO): resnet18 at 112x112 has its 3x3 stages at 28, 14, 7 and 4 pixels
SHAPES = [(8, 28, 28, 64, 64), (8, 14, 14, 128, 128), (8, 7, 7, 256, 256), (8, 4, 4, 512, 512)]
ALGORITHMS = ("direct", "im2col", "winograd")


def _module(shape, w_np, algorithm: str):
    """One conv + ReLU as Relax; the algorithms' TE stages are the backend's own
    (backends/tvm/conv_algorithms.py), so the benchmark measures what a build would run."""
    from tvm import relax

    from backends.tvm.conv_algorithms import _emit

    n, h, w, c, co = shape
    p = {"strides": (1, 1), "dilation": (1, 1), "padding": (1, 1, 1, 1), "out": [n, h, w, co]}
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((n, h, w, c), "float32"))
    with bb.function("main", [x]):
        if algorithm == "direct":
            y = bb.emit(relax.op.nn.conv2d(x, relax.const(w_np), padding=[1, 1, 1, 1], data_layout="NHWC",
                                           kernel_layout="HWIO"))
        else:
            y = _emit(bb, algorithm, x, relax.const(w_np), p)
        bb.emit_func_output(bb.emit(relax.op.nn.relu(y)))
    return bb.get()


def _build(mod, target):
    import tvm
    from tvm import relax

    from backends.tvm import parallel_scope
    from backends.tvm.pipeline import run_pipeline

    with target:
        mod = relax.transform.FoldConstant()(mod)
    ex = parallel_scope.compile(run_pipeline(mod, "scheduled", target), target)  # as backends/tvm/build.py
    return relax.VirtualMachine(ex, tvm.cpu())


def _ort_conv(x_nhwc: np.ndarray, w_hwio: np.ndarray) -> np.ndarray:
    import onnx
    import onnxruntime as ort
    from onnx import helper, numpy_helper

    n, h, w, c = x_nhwc.shape
    g = helper.make_graph([helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]), helper.make_node("Relu", ["c"], ["y"])],
                          "conv", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [n, c, h, w])],
                          [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)],
                          [numpy_helper.from_array(np.ascontiguousarray(w_hwio.transpose(3, 2, 0, 1)), "w")])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    feeds = {"x": np.ascontiguousarray(x_nhwc.transpose(0, 3, 1, 2))}
    y = sess.run(None, feeds)[0].transpose(0, 2, 3, 1)
    ts = []
    for _ in range(5):
        t0 = time.perf_counter()
        sess.run(None, feeds)
        ts.append(time.perf_counter() - t0)
    return y, statistics.median(ts)


def bench(shape, runs: int, target) -> dict[str, Any]:
    import tvm

    rng = np.random.default_rng(0)
    n, h, w, c, co = shape
    x_np = rng.standard_normal((n, h, w, c)).astype(np.float32)
    w_np = (rng.standard_normal((3, 3, c, co)) / np.sqrt(9 * c)).astype(np.float32)
    ref, ort_s = _ort_conv(x_np, w_np)
    makers: dict[str, Callable[[], Any]] = {a: (lambda a=a: _module(shape, w_np, a)) for a in ALGORITHMS}
    row: dict[str, Any] = {"shape": list(shape), "gflop": 2 * n * h * w * c * co * 9 / 1e9, "ort_ms": ort_s * 1e3}
    xt = tvm.runtime.tensor(x_np)
    for name, make in makers.items():
        vm = _build(make(), target)
        out = vm["main"](xt).numpy()
        ts = []
        vm["main"](xt)
        for _ in range(runs):
            t0 = time.perf_counter()
            vm["main"](xt)
            ts.append(time.perf_counter() - t0)
        row[f"{name}_ms"] = statistics.median(ts) * 1e3
        row[f"{name}_rel_err"] = float(np.abs(out - ref).max() / np.abs(ref).max())
        print(f"  {shape} {name}: {row[f'{name}_ms']:.2f} ms, rel err {row[f'{name}_rel_err']:.1e}", file=sys.stderr, flush=True)
    row["fastest"] = min(ALGORITHMS, key=lambda a: row[f"{a}_ms"])
    return row


def render_markdown(data: dict[str, Any]) -> str:
    head = "| N, H, W, C -> CO | GFLOP | " + " | ".join(f"{a} (ms)" for a in ALGORITHMS) + " | ORT (ms) | fastest | worst rel. error |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in data["rows"]:
        n, h, w, c, co = r["shape"]
        cells = " | ".join(f"{r[f'{a}_ms']:.2f}" for a in ALGORITHMS)
        err = max(r[f"{a}_rel_err"] for a in ALGORITHMS)
        lines.append(f"| {n}, {h}, {w}, {c} -> {co} | {r['gflop']:.2f} | {cells} | {r['ort_ms']:.2f} | {r['fastest']} | {err:.1e} |")
    m = data["machine"]
    lines += ["", f"{m['cpu']}, {data['settings']['threads']} thread(s), TVM {m['tvm']}; 3x3 conv + ReLU, stride 1, NHWC, "
              f"default schedules (no tuning), median of {data['settings']['runs']} runs; ORT: NCHW Conv+Relu, 1 thread."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--json", default=str(RESULTS))
    ap.add_argument("--markdown", action="store_true", help="print the saved results as a markdown table and exit")
    args = ap.parse_args(argv)
    if args.markdown:
        print(render_markdown(json.loads(Path(args.json).read_text())))
        return 0
    os.environ["TVM_NUM_THREADS"] = str(args.threads)
    import tvm

    from backends.tvm.target import _cpuinfo, detect_host_target

    target = tvm.target.Target(detect_host_target())
    t0 = time.perf_counter()
    rows = [bench(s, args.runs, target) for s in SHAPES]
    data = {"machine": {"cpu": _cpuinfo()[0], "cores": os.cpu_count(), "platform": platform.platform(), "tvm": str(tvm.__version__)},
            "settings": {"threads": args.threads, "runs": args.runs}, "wall_s": round(time.perf_counter() - t0, 1), "rows": rows}
    Path(args.json).write_text(json.dumps(data, indent=1) + "\n")
    print(render_markdown(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
