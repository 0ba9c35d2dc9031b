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
- ``winograd_m``: input transform ``B^T d B``, 16 or 36 batched GEMMs over channels,
  output transform ``A^T M A`` (tile m = 2: F(2x2,3x3); m = 4: F(4x4,3x3)).

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
ALGORITHMS = ("direct", "im2col", "winograd_2", "winograd_4")


def _direct(shape, w_np):
    from tvm import relax

    n, h, w, c, co = shape
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((n, h, w, c), "float32"))
    with bb.function("main", [x]):
        y = bb.emit(relax.op.nn.conv2d(x, relax.const(w_np), padding=[1, 1, 1, 1], data_layout="NHWC",
                                       kernel_layout="HWIO"))
        bb.emit_func_output(bb.emit(relax.op.nn.relu(y)))
    return bb.get()


def _im2col(shape, w_np):
    from tvm import relax, te, topi

    n, h, w, c, co = shape

    def cols(x):
        pad = topi.nn.pad(x, [0, 1, 1, 0], [0, 1, 1, 0], name="pad")
        return te.compute((n * h * w, 9 * c), lambda p, k: pad[p // (h * w), (p // w) % h + k // (3 * c),
                                                               p % w + (k // c) % 3, k % c], name="im2col")

    def gemm(a, b):
        k = te.reduce_axis((0, 9 * c), "k")
        return te.compute((n * h * w, co), lambda p, j: te.sum(a[p, k] * b[k, j], axis=[k]), name="gemm")

    def out(y):
        return te.compute((n, h, w, co), lambda b, i, j, o: te.max(y[(b * h + i) * w + j, o], 0.0), name="out")

    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((n, h, w, c), "float32"))
    with bb.function("main", [x]):
        a = bb.emit_te(cols, x)
        y = bb.emit_te(gemm, a, relax.const(w_np.reshape(9 * c, co)))
        bb.emit_func_output(bb.emit_te(out, y))
    return bb.get()


def _winograd(shape, w_np, m: int):
    from tvm import relax, te, topi
    from tvm.topi.nn.winograd_util import winograd_transform_matrices

    n, h, w, c, co = shape
    r, alpha = 3, m + 2
    nh, nw = (h + m - 1) // m, (w + m - 1) // m
    p_tiles = n * nh * nw

    def kernel_pack(wt):
        _, _, g = winograd_transform_matrices(m, r, "float32")
        rh, rw = te.reduce_axis((0, r), "rh"), te.reduce_axis((0, r), "rw")
        return te.compute((alpha, alpha, c, co), lambda e, v, ci, o: te.sum(g[e, rh] * wt[rh, rw, ci, o] * g[v, rw],
                                                                            axis=[rh, rw]), name="kernel_pack")

    def data_pack(x):
        _, b, _ = winograd_transform_matrices(m, r, "float32")
        pad = topi.nn.pad(x, [0, 1, 1, 0], [0, nh * m + 1 - h, nw * m + 1 - w, 0], name="pad")
        tile = te.compute((alpha, alpha, p_tiles, c),
                          lambda e, v, p, ci: pad[p // (nh * nw), (p // nw) % nh * m + e, p % nw * m + v, ci],
                          name="input_tile")
        ra, rb = te.reduce_axis((0, alpha), "ra"), te.reduce_axis((0, alpha), "rb")
        return te.compute((alpha, alpha, p_tiles, c), lambda e, v, p, ci: te.sum(tile[ra, rb, p, ci] * b[ra, e] * b[rb, v],
                                                                                 axis=[ra, rb]), name="data_pack")

    def bgemm(d, k):
        ci = te.reduce_axis((0, c), "ci")
        return te.compute((alpha, alpha, p_tiles, co), lambda e, v, p, o: te.sum(d[e, v, p, ci] * k[e, v, ci, o], axis=[ci]),
                          name="bgemm")

    def inverse(bg):
        a, _, _ = winograd_transform_matrices(m, r, "float32")
        ra, rb = te.reduce_axis((0, alpha), "ra"), te.reduce_axis((0, alpha), "rb")
        return te.compute((m, m, p_tiles, co), lambda i, j, p, o: te.sum(bg[ra, rb, p, o] * a[ra, i] * a[rb, j], axis=[ra, rb]),
                          name="inverse")

    def out(inv):
        return te.compute((n, h, w, co), lambda b, i, j, o: te.max(inv[i % m, j % m, (b * nh + i // m) * nw + j // m, o], 0.0),
                          name="out")

    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((n, h, w, c), "float32"))
    with bb.function("main", [x]):
        k = bb.emit_te(kernel_pack, relax.const(w_np))  # constant: FoldConstant transforms it at compile time
        d = bb.emit_te(data_pack, x)
        g = bb.emit_te(bgemm, d, k)
        bb.emit_func_output(bb.emit_te(out, bb.emit_te(inverse, g)))
    return bb.get()


def _build(mod, target):
    import tvm
    from tvm import relax

    from backends.tvm.pipeline import run_pipeline

    with target:
        mod = relax.transform.FoldConstant()(mod)
    ex = tvm.compile(run_pipeline(mod, "scheduled", target), target)
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
    makers: dict[str, Callable[[], Any]] = {
        "direct": lambda: _direct(shape, w_np), "im2col": lambda: _im2col(shape, w_np),
        "winograd_2": lambda: _winograd(shape, w_np, 2), "winograd_4": lambda: _winograd(shape, w_np, 4)}
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
