"""A strided conv's input gradient on TVM, four ways, on the zoo resnet-18's (64x64) shapes, paired.

The six strided ``ConvTranspose(dY, W)`` of the resnet step (layer2-4's first 3x3 conv, stride 2,
pads 1, and their 1x1 stride-2 downsample, output padding 1) in one program per form, at a batch:

- ``conv_transpose``: as the autodiff emits it (TVM's conv2d_transpose, ``W`` an input);
- ``phase``: hoist rule 4's phase form, ``DepthToSpace(Conv(dY, W_phase))``, its weight made from
  ``W`` inside the program (a 1-rank or data-parallel step: once per step);
- ``phase_hoisted``: the same with ``W_phase`` an input (a pipeline stage: hoisted by rule 1);
- ``dilate``: ``dY`` zero-inserted (Reshape, Pad, Reshape) then a stride-1 Conv of the flipped
  weight (an input), four times the phase form's multiply-adds.

All forms are built once and timed in interleaved rounds (one call each per round, the thread's
CPU time); medians per call, and each form checked against ONNX Runtime's ConvTranspose. The
weights are read-only feeds the executable copies once (``reuse_readonly_inputs``, as in a pipeline
stage), so a call's time is its kernels plus the copy of ``dY``.

    .venv/bin/python benchmarks/strided_conv_transpose.py [--batches 16,2] [--rounds 15]
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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import onnx  # noqa: E402
from onnx import TensorProto, helper  # noqa: E402

#: (dY channels, dX channels, dY map, kernel, pads): the resnet-18 64x64 strided convs' input gradients
SHAPES = [(128, 64, 8, 3, 1), (256, 128, 4, 3, 1), (512, 256, 2, 3, 1),
          (128, 64, 8, 1, 0), (256, 128, 4, 1, 0), (512, 256, 2, 1, 0)]


def _model(batch: int, form: str) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    from partitioner.training.hoist import conv_transpose_as_conv

    rng = np.random.default_rng(0)
    nodes, inputs, outputs, inits, feeds = [], [], [], [], {}
    for i, (m, c, h, k, p) in enumerate(SHAPES):
        dy, w, dx = f"dy{i}", f"w{i}", f"dx{i}"
        feeds[dy] = rng.standard_normal((batch, m, h, h)).astype(np.float32)
        feeds[w] = (rng.standard_normal((m, c, k, k)) * 0.05).astype(np.float32)
        inputs += [helper.make_tensor_value_info(dy, TensorProto.FLOAT, [batch, m, h, h]),
                   helper.make_tensor_value_info(w, TensorProto.FLOAT, [m, c, k, k])]
        outputs.append(helper.make_tensor_value_info(dx, TensorProto.FLOAT, [batch, c, 2 * h, 2 * h]))
        if form == "dilate":
            z = f"z{i}"
            inits += [helper.make_tensor(f"{z}.s6", TensorProto.INT64, [6], [batch, m, h, 1, h, 1]),
                      helper.make_tensor(f"{z}.pad", TensorProto.INT64, [12], [0] * 6 + [0, 0, 0, 1, 0, 1]),
                      helper.make_tensor(f"{z}.s4", TensorProto.INT64, [4], [batch, m, 2 * h, 2 * h])]
            nodes += [helper.make_node("Reshape", [dy, f"{z}.s6"], [f"{z}.a"]),
                      helper.make_node("Pad", [f"{z}.a", f"{z}.pad"], [f"{z}.b"]),
                      helper.make_node("Reshape", [f"{z}.b", f"{z}.s4"], [z]),
                      helper.make_node("Conv", [z, f"{w}.flip"], [dx], kernel_shape=[k, k],
                                       pads=[k - 1 - p, k - 1 - p, k - 1 - p + 1 - 1, k - 1 - p + 1 - 1])]
            feeds[f"{w}.flip"] = np.ascontiguousarray(feeds.pop(w).transpose(1, 0, 2, 3)[:, :, ::-1, ::-1])
            inputs[-1] = helper.make_tensor_value_info(f"{w}.flip", TensorProto.FLOAT, [c, m, k, k])
        else:
            nodes.append(helper.make_node("ConvTranspose", [dy, w], [dx], name=f"ct{i}", strides=[2, 2],
                                          pads=[p] * 4, output_padding=[1, 1]))
    g = helper.make_graph(nodes, f"ct_{form}_b{batch}", inputs, outputs, inits)
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    if form.startswith("phase"):
        conv_transpose_as_conv(model, {f"w{i}" for i in range(len(SHAPES))})
    if form == "phase_hoisted":
        model, feeds = _hoisted(model, feeds)
    return model, feeds


def _hoisted(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """The phase form with its weight-only nodes run once here (ONNX Runtime) and fed as inputs."""
    import onnxruntime as ort

    g = model.graph
    prep = [n for n in g.node if n.op_type in ("Reshape", "Pad", "Gather", "Transpose")]
    made = [n.output[0] for n in prep if n.op_type == "Reshape" and n.input[0].endswith(".wt")]
    pm = onnx.ModelProto()
    pm.CopyFrom(model)
    del pm.graph.output[:]
    pm.graph.output.extend(helper.make_tensor_value_info(v, TensorProto.FLOAT, None) for v in made)
    values = ort.InferenceSession(pm.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        made, feeds)
    keep = [n for n in g.node if n not in prep]
    del g.node[:]
    g.node.extend(keep)
    kept = [vi for vi in g.input if not vi.name.startswith("w")]
    del g.input[:]
    g.input.extend(kept + [helper.make_tensor_value_info(v, TensorProto.FLOAT, a.shape)
                           for v, a in zip(made, values)])
    feeds = {k: v for k, v in feeds.items() if not k.startswith("w")} | dict(zip(made, values))
    return model, feeds


def main() -> None:
    import onnxruntime as ort

    from partitioner.training.pipeline_runner import executable

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="16,2")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--forms", default="conv_transpose,phase,phase_hoisted,dilate")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="ct-bench-"))
    result = {"load_before": os.getloadavg(), "shapes": SHAPES, "batches": {}}
    for batch in [int(b) for b in a.batches.split(",")]:
        ref_model, ref_feeds = _model(batch, "conv_transpose")
        session = ort.InferenceSession(ref_model.SerializeToString(), providers=["CPUExecutionProvider"])
        ref = session.run(None, ref_feeds)
        runs = {}
        for form in a.forms.split(","):
            model, feeds = _model(batch, form)
            exe = executable(model, "tvm", work / form, 1)
            exe.reuse_readonly_inputs = True  # weights (read-only) copied once, as a pipeline stage does
            for k, v in feeds.items():
                v.flags.writeable = k.startswith("dy")
            out = exe.run(feeds, None)
            err = max(float(np.max(np.abs(out[f"dx{i}"] - r))) for i, r in enumerate(ref))
            runs[form] = (exe, feeds, err, [])
        for _ in range(a.rounds):
            for form, (exe, feeds, _, times) in runs.items():
                t = time.thread_time()
                exe.run(feeds, None)
                times.append(time.thread_time() - t)
        result["batches"][batch] = {f: {"ms": statistics.median(t) * 1e3, "max_abs_err": e}
                                    for f, (_, _, e, t) in runs.items()}
        for f, r in result["batches"][batch].items():
            print(f"batch {batch:3d} {f:15s} {r['ms']:8.2f} ms  max|err| {r['max_abs_err']:.1e}", flush=True)
    result["load_after"] = os.getloadavg()
    print("load", result["load_before"], result["load_after"])
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
