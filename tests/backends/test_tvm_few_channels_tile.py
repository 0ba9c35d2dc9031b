"""Direct convolutions whose output channels are not a multiple of the vector width (24 = 3 x 8
lanes on AVX-512) take a register tile of at least ``FEW_CHANNELS_ACCUMULATORS`` accumulators
(backends/tvm/schedules/contraction.py, ``_few_channels_tile``) instead of 8 pixels x 1 narrow
vector; every build matches ONNX Runtime (rtol 1e-4, atol 1e-5, seeded random weights/input)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import tvm
from onnx import TensorProto, helper, numpy_helper

from backends.tvm.schedules import contraction as C
from backends.tvm.schedules.vector import vector_lanes
from backends.tvm.target import detect_host_target
from tvm_build_check import build_and_compare, conv3x3_register_tile


def _model(ci: int, co: int, hw: int, batch: int) -> onnx.ModelProto:
    """Conv 3x3 (padded) + ReLU, then a 1x1 conv to 4 channels (keeps the first conv NHWC)."""
    rng = np.random.default_rng(ci * co + hw)
    w = (rng.standard_normal((co, ci, 3, 3)) * np.sqrt(2.0 / (9 * ci))).astype(np.float32)
    w2 = (rng.standard_normal((4, co, 1, 1)) * np.sqrt(2.0 / co)).astype(np.float32)
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c"], ["r"]),
             helper.make_node("Conv", ["r", "w2"], ["y"], kernel_shape=[1, 1])]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, ci, hw, hw])
    g = helper.make_graph(nodes, "c", [x], [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                          [numpy_helper.from_array(w, "w"), numpy_helper.from_array(w2, "w2")])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    return onnx.shape_inference.infer_shapes(model)


def _accumulators(mod: tvm.IRModule) -> int:
    """Vector accumulators of the 3x3 conv's register tile: the product of the unrolled loops
    (pixels x channel vectors) around its update block."""
    return int(np.prod(conv3x3_register_tile(mod)))


@pytest.mark.parametrize("ci,co,hw,batch", [(12, 24, 16, 2), (24, 40, 8, 1), (6, 12, 10, 1), (16, 8, 12, 2)],
                         ids=["12-24", "24-40", "6-12", "16-8"])
def test_few_channel_convs_match_ort(ci: int, co: int, hw: int, batch: int) -> None:
    build_and_compare(_model(ci, co, hw, batch))


def test_24_channels_take_more_accumulators(monkeypatch: pytest.MonkeyPatch) -> None:
    lanes = vector_lanes(tvm.target.Target(detect_host_target()))
    if 24 % lanes == 0:
        pytest.skip(f"{lanes}-lane vectors divide 24: full vectors, rule not used")
    m = _model(12, 24, 16, 2)
    assert _accumulators(build_and_compare(m)) >= 16  # twice the 8 of one narrow vector x 8 pixels
    monkeypatch.setattr(C, "FEW_CHANNELS_ACCUMULATORS", 0)
    assert _accumulators(build_and_compare(m)) < 16
