"""Direct convolutions on wide maps whose input is larger than one core's L2 take a register tile
of 2 x 2 pixels x 4 channel vectors (backends/tvm/schedules/contraction.py, ``_wide_input_rows``
with ``_narrow_tile``) instead of 8 pixels x 2 vectors, so the channel tiles sweep the input half
as often; every build matches ONNX Runtime (rtol 1e-4, atol 1e-5, seeded random weights/input)."""

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

# the expected tiles are AVX-512's (16 lanes, 32 registers); AVX2 gets other tiles from _narrow_tile
pytestmark = pytest.mark.skipif(vector_lanes(tvm.target.Target(detect_host_target())) != 16,
                                reason="register tiles asserted for 16-lane vectors")


def _model(ci: int, co: int, hw: int, batch: int, stride: int = 1) -> onnx.ModelProto:
    """Conv 3x3 (padded) + bias + ReLU, then a 1x1 conv to 4 channels (keeps the first conv NHWC)."""
    rng = np.random.default_rng(ci * co + hw + stride)
    w = (rng.standard_normal((co, ci, 3, 3)) * np.sqrt(2.0 / (9 * ci))).astype(np.float32)
    b = (rng.standard_normal(co) * 0.1).astype(np.float32)
    w2 = (rng.standard_normal((4, co, 1, 1)) * np.sqrt(2.0 / co)).astype(np.float32)
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], kernel_shape=[3, 3], pads=[1, 1, 1, 1],
                              strides=[stride, stride]),
             helper.make_node("Relu", ["c"], ["r"]),
             helper.make_node("Conv", ["r", "w2"], ["y"], kernel_shape=[1, 1])]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, ci, hw, hw])
    g = helper.make_graph(nodes, "c", [x], [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                          [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b"),
                           numpy_helper.from_array(w2, "w2")])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    return onnx.shape_inference.infer_shapes(model)


_register_tile = conv3x3_register_tile


def test_conv_with_input_over_l2_takes_two_pixels_by_four_vectors(monkeypatch: pytest.MonkeyPatch) -> None:
    # 64 -> 64 on 32x32 at batch 4: the padded input is 4 x 34 x 34 x 64 floats = 1.13 MiB > 1 MiB
    m = _model(64, 64, 32, 4)
    assert _register_tile(build_and_compare(m)) == [2, 2, 4]  # 2 rows x 2 pixels x 4 vectors
    monkeypatch.setattr(C, "WIDE_INPUT_TILE", False)
    assert _register_tile(build_and_compare(m)) == [2, 8]  # the default: 8 pixels x 2 vectors


@pytest.mark.parametrize("stride", [1, 2])
def test_wide_input_tile_matches_ort(monkeypatch: pytest.MonkeyPatch, stride: int) -> None:
    monkeypatch.setattr(C, "WIDE_INPUT_BYTES", 1 << 14)  # a small conv, so the test stays cheap
    m = _model(32, 128, 16, 2, stride)
    assert _register_tile(build_and_compare(m)) == [2, 2, 4]


def test_not_for_inputs_that_fit_l2_nor_batch_1(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _register_tile(build_and_compare(_model(64, 64, 16, 2))) == [2, 8]  # 0.16 MiB input
    monkeypatch.setattr(C, "WIDE_INPUT_BYTES", 1 << 14)
    assert _register_tile(build_and_compare(_model(64, 64, 16, 1))) == [2, 8]  # rows outermost at batch 1
