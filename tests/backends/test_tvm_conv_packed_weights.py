"""Direct convolutions read co-blocked weight panels packed at build time
(backends/tvm/schedules/contraction.py, ``PACK_CONV_WEIGHTS`` / ``_pack_conv_weights``).

Each build matches ONNX Runtime (rtol 1e-4, atol 1e-5, seeded random weights and inputs) for the
kernel shapes the rule covers (3x3, strided, 1x7 / 7x1, 5x5, grouped, batch > 1), and the
built module has the build-time pack: a ``*_weight_prepack`` function and a conv kernel that reads
the 5-D ``[co // panel, kh, kw, ci, panel]`` weight; with the knob off there is neither.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import tvm
from onnx import TensorProto, helper, numpy_helper
from tvm import relax

from backends.tvm.lower import lower_program
from backends.tvm.pipeline import run_pipeline
from backends.tvm.schedules import contraction as C
from backends.tvm.target import detect_host_target


def _conv(ci: int, hw: int, co: int, kh: int, kw: int, s: int, batch: int, group: int = 1) -> onnx.ModelProto:
    rng = np.random.default_rng(ci * 31 + co * 7 + kh * 5 + kw * 3 + s + batch + group)
    w = (rng.standard_normal((co, ci // group, kh, kw)) * np.sqrt(2.0 / (ci // group * kh * kw))).astype(np.float32)
    b = rng.standard_normal(co).astype(np.float32) * 0.1
    node = helper.make_node("Conv", ["x", "w", "b"], ["c"], kernel_shape=[kh, kw], strides=[s, s],
                            pads=[(kh - 1) // 2, (kw - 1) // 2, (kh - 1) // 2, (kw - 1) // 2], group=group)
    g = helper.make_graph([node, helper.make_node("Relu", ["c"], ["y"])], "conv",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, ci, hw, hw])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                          [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")])
    return onnx.shape_inference.infer_shapes(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]))


def _build(m: onnx.ModelProto) -> tuple[Any, Any]:
    target = tvm.target.Target(detect_host_target())
    mod = run_pipeline(lower_program(m).mod, "scheduled", target)
    return mod, relax.VirtualMachine(tvm.compile(mod, target), tvm.cpu())


def _check(m: onnx.ModelProto) -> Any:
    x = np.random.default_rng(0).standard_normal(
        [d.dim_value for d in m.graph.input[0].type.tensor_type.shape.dim]).astype(np.float32)
    ref = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    mod, vm = _build(m)
    res = vm["main"](tvm.runtime.tensor(x))
    got = (res if isinstance(res, tvm.runtime.Tensor) else res[0]).numpy()
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-5)
    return mod


def _prepacked(mod: Any) -> list[str]:
    return [gv.name_hint for gv, f in mod.functions_items()
            if isinstance(f, tvm.tirx.PrimFunc) and gv.name_hint.endswith("_weight_prepack")]


@pytest.mark.parametrize("ci,hw,co,kh,kw,s,batch,group", [
    (32, 7, 256, 3, 3, 1, 1, 1),   # a late-stage 3x3 (many output channels)
    (16, 9, 64, 3, 3, 2, 2, 1),    # stride 2, batch 2
    (24, 8, 48, 1, 7, 1, 1, 1),    # Inception's 1x7
    (24, 8, 48, 7, 1, 1, 1, 1),    # and 7x1
    (8, 10, 32, 5, 5, 1, 1, 1),    # 5x5
    (32, 6, 64, 3, 3, 1, 1, 2),    # grouped (not depthwise)
    (64, 2, 128, 3, 3, 1, 2, 1),   # narrow map (the _narrow_tile panel)
], ids=["3x3-256", "3x3s2-b2", "1x7", "7x1", "5x5", "grouped", "narrow-2x2"])
def test_packed_convs_match_ort(ci: int, hw: int, co: int, kh: int, kw: int, s: int, batch: int, group: int) -> None:
    _check(_conv(ci, hw, co, kh, kw, s, batch, group))


def test_3x3_conv_weights_are_packed_at_build_time(monkeypatch: pytest.MonkeyPatch) -> None:
    m = _conv(32, 7, 256, 3, 3, 1, 1)
    mod = _check(m)
    assert _prepacked(mod), "no build-time weight pack for a 3x3 conv"
    conv = next(f.script() for f in mod.functions.values()
                if isinstance(f, tvm.tirx.PrimFunc) and "conv2d_nhwc_update" in f.script())
    # the kernel's weight parameter is 5-D: [co // panel, 3, 3, 32, panel]
    five_d = r"T\.Buffer\(\(T\.int64\(\d+\), T\.int64\(3\), T\.int64\(3\), T\.int64\(32\), T\.int64\(\d+\)\)"
    assert re.search(five_d, conv)
    monkeypatch.setattr(C, "PACK_CONV_WEIGHTS", False)
    assert not _prepacked(_check(m))


def test_runtime_weights_are_packed_by_a_scheduled_copy() -> None:
    """Weights given at run time (the external-data path: weights as parameters of ``main``)
    cannot be folded: the pack runs per call, so it is a vectorised copy, not a scalar loop
    nest (measured, 3x3 512 -> 512 on 4x4, batch 1: unscheduled it made the call 1.2x slower
    than reading HWIO in place; scheduled, on par). Matches ORT."""
    g = helper.make_graph([helper.make_node("Conv", ["x", "w"], ["y"], kernel_shape=[3, 3], pads=[1, 1, 1, 1])], "c",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 32, 6, 6]),
                           helper.make_tensor_value_info("w", TensorProto.FLOAT, [64, 32, 3, 3])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    m = onnx.shape_inference.infer_shapes(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]))
    rng = np.random.default_rng(3)
    feeds = {"x": rng.standard_normal((1, 32, 6, 6)).astype(np.float32),
             "w": (rng.standard_normal((64, 32, 3, 3)) * 0.1).astype(np.float32)}
    ref = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    mod, vm = _build(m)
    res = vm["main"](tvm.runtime.tensor(feeds["x"]), tvm.runtime.tensor(feeds["w"]))
    got = (res if isinstance(res, tvm.runtime.Tensor) else res[0]).numpy()
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-5)
    packs = [f.script() for gv, f in mod.functions_items() if gv.name_hint.endswith("_weight_prepack")]
    assert packs and all("T.vectorized" in p for p in packs)
