"""The conv weight gradient's im2col alone, three forms, as standalone programs (session 18).

Forms (3x3 kernel, pad 1): ``nchw`` (``rules/linear.py``'s NCHW form: Pad, 9 Slices, Unsqueeze,
Concat on axis 2, the 5-D transpose to ``[N*Ho*Wo, C*K]``), ``nhwc`` (the NHWC form on an NHWC
input: what a stage's ``B`` reads with pipeline rule 14's stash), ``nchw_in_nhwc`` (the NHWC form
behind a Transpose of an NCHW input: what the rule builds). Each program is built by the
project's runner (``pipeline_runner.executable``, 1 thread) and called in interleaved rounds;
the figure is thread CPU per call (the call's own Python included), medians. The outputs are
checked equal (the NHWC columns are ``(k, c)``-ordered, the NCHW ones ``(c, k)``).

    .venv/bin/python benchmarks/im2col_forms_micro.py --backend tvm --json out.json
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

import numpy as np
from onnx import TensorProto, helper, numpy_helper

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

FORMS = ("nchw", "nhwc", "nchw_in_nhwc")
#: (N, C, H, W, stride): resnet-18 on 64x64 at a micro-batch of 2 (layer1, layer2, layer2's
#: stride-2 conv) and layer1 at the 1-rank batch 16
SHAPES = ((2, 64, 16, 16, 1), (2, 128, 8, 8, 1), (2, 64, 16, 16, 2), (16, 64, 16, 16, 1))


def program(form: str, n: int, c: int, h: int, w: int, s: int = 1, p: int = 1):
    ho, wo = (h + 2 * p - 3) // s + 1, (w + 2 * p - 3) // s + 1
    nodes, inits = [], []

    def const(name, v):
        inits.append(numpy_helper.from_array(np.array(v, np.int64), name))
        return name

    nhwc_axes = form != "nchw"
    if form == "nhwc":
        x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [n, h, w, c])
        src = "x"
    else:
        x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [n, c, h, w])
        src = "x"
        if form == "nchw_in_nhwc":
            nodes.append(helper.make_node("Transpose", ["x"], ["xt"], perm=[0, 2, 3, 1]))
            src = "xt"
    pads = [0, p, p, 0, 0, p, p, 0] if nhwc_axes else [0, 0, p, p, 0, 0, p, p]
    nodes.append(helper.make_node("Pad", [src, const("pads", pads)], ["xp"]))
    parts = []
    for kh in range(3):
        for kw in range(3):
            k = kh * 3 + kw
            ends = [kh + (ho - 1) * s + 1, kw + (wo - 1) * s + 1]
            ins = ["xp", const(f"s{k}", [kh, kw]), const(f"e{k}", ends), const("ax", [1, 2] if nhwc_axes else [2, 3]),
                   const("st", [s, s])]
            nodes.append(helper.make_node("Slice", ins, [f"sl{k}"]))
            if nhwc_axes:
                parts.append(f"sl{k}")
            else:
                nodes.append(helper.make_node("Unsqueeze", [f"sl{k}", const("u", [2])], [f"u{k}"]))
                parts.append(f"u{k}")
    if nhwc_axes:
        nodes.append(helper.make_node("Concat", parts, ["cat"], axis=3))
        last = "cat"
    else:
        nodes.append(helper.make_node("Concat", parts, ["cat"], axis=2))
        nodes.append(helper.make_node("Transpose", ["cat"], ["t"], perm=[0, 3, 4, 1, 2]))
        last = "t"
    nodes.append(helper.make_node("Reshape", [last, const("shp", [n * ho * wo, c * 9])], ["cols"]))
    out = helper.make_tensor_value_info("cols", TensorProto.FLOAT, [n * ho * wo, c * 9])
    return helper.make_model(helper.make_graph(nodes, form, [x], [out], inits),
                             opset_imports=[helper.make_opsetid("", 17)])


def measure(backend: str, rounds: int, reps: int) -> dict:
    from partitioner.training.pipeline_runner import executable

    rows = []
    load0 = list(os.getloadavg())
    with tempfile.TemporaryDirectory() as tmp:
        for n, c, h, w, s in SHAPES:
            exes = {f: executable(program(f, n, c, h, w, s), backend, Path(tmp) / f"{f}_{n}_{c}_{h}_{s}", 1)
                    for f in FORMS}
            xin = np.random.default_rng(0).standard_normal((n, c, h, w)).astype(np.float32)
            feeds = {"nchw": {"x": xin}, "nhwc": {"x": np.ascontiguousarray(xin.transpose(0, 2, 3, 1))},
                     "nchw_in_nhwc": {"x": xin}}
            outs = {}
            for f in FORMS:
                got = exes[f].run(feeds[f], None)
                outs[f] = np.asarray(list(got.values())[0] if isinstance(got, dict) else got[0])
            ref = outs["nchw"].reshape(-1, c, 9).transpose(0, 2, 1).reshape(-1, 9 * c)
            assert np.array_equal(ref, outs["nhwc"]) and np.array_equal(ref, outs["nchw_in_nhwc"])
            t: dict[str, list[float]] = {f: [] for f in FORMS}
            for _ in range(rounds):
                for f in FORMS:
                    t0 = time.thread_time()
                    for _ in range(reps):
                        exes[f].run(feeds[f], None)
                    t[f].append((time.thread_time() - t0) / reps * 1e6)
            row = {"shape_nchw_stride": [n, c, h, w, s], "median_us": {f: statistics.median(v) for f, v in t.items()},
                   "rounds_us": t}
            print(row["shape_nchw_stride"], {f: round(v, 1) for f, v in row["median_us"].items()}, "us/call")
            rows.append(row)
    return {"backend": backend, "rounds": rounds, "reps": reps, "rows": rows, "load_before": load0,
            "load_after": list(os.getloadavg()), "machine": platform.processor() or platform.machine()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--backend", default="tvm", choices=["tvm", "onnxruntime"])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--reps", type=int, default=200)
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args()
    doc = measure(a.backend, a.rounds, a.reps)
    print("load", doc["load_before"], "->", doc["load_after"])
    if a.json is not None:
        a.json.write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
