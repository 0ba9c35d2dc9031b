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
from tvm_build_check import build_and_compare


def _model(ci: int, co: int, hw: int, batch: int) -> onnx.ModelProto:
    """Conv 3x3 (padded) + ReLU, then a 1x1 conv to 4 channels (keeps the first conv NHWC)."""
    rng = np.random.default_rng(ci * co + hw)
    w = (rng.standard_normal((co, ci, 3, 3)) * np.sqrt(2.0 / (9 * ci))).astype(np.float32)
    w2 = (rng.standard_normal((4, co, 1, 1)) * np.sqrt(2.0 / co)).astype(np.float32)
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c"], ["r"]),
             helper.make_node("Conv", ["r", "w2"], ["y"], kernel_shape=[1, 1])]
    g = helper.make_graph(nodes, "c", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, ci, hw, hw])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                          [numpy_helper.from_array(w, "w"), numpy_helper.from_array(w2, "w2")])
    return onnx.shape_inference.infer_shapes(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]))


def _accumulators(mod: tvm.IRModule, co: int) -> int:
    """Lanes of the register tile of the 3x3 conv (unrolled x vectorised loops around its update
    block), divided by the vector width of the tile: its number of vector accumulators."""
    from tvm import s_tir

    for gv, f in mod.functions.items():
        if isinstance(f, tvm.tirx.PrimFunc) and "conv2d" in gv.name_hint and "conv2d_nhwc_update" in f.script():
            sch = s_tir.Schedule(f)
            loops = [sch.get(lp) for lp in sch.get_loops(sch.get_sblock("conv2d_nhwc_update"))]
            if int(loops[-1].extent) == 4 or co % int(loops[-1].extent):  # the 1x1 conv to 4 channels
                continue
            if sum(int(lp.extent) for lp in loops if lp.extent.value == 3) < 2:  # not the 3x3 one
                continue
            unrolled = [int(lp.extent) for lp in loops if int(lp.kind) == int(tvm.tirx.ForKind.UNROLLED)]
            return int(np.prod(unrolled))
    raise AssertionError("no 3x3 conv update block found")


@pytest.mark.parametrize("ci,co,hw,batch", [(12, 24, 16, 2), (24, 40, 8, 1), (6, 12, 10, 1), (16, 8, 12, 2)],
                         ids=["12-24", "24-40", "6-12", "16-8"])
def test_few_channel_convs_match_ort(ci: int, co: int, hw: int, batch: int) -> None:
    build_and_compare(_model(ci, co, hw, batch))


def test_24_channels_take_more_accumulators(monkeypatch: pytest.MonkeyPatch) -> None:
    lanes = vector_lanes(tvm.target.Target(detect_host_target()))
    if 24 % lanes == 0:
        pytest.skip(f"{lanes}-lane vectors divide 24: full vectors, rule not used")
    m = _model(12, 24, 16, 2)
    assert _accumulators(build_and_compare(m), 24) >= 16  # twice the 8 of one narrow vector x 8 pixels
    monkeypatch.setattr(C, "FEW_CHANNELS_ACCUMULATORS", 0)
    assert _accumulators(build_and_compare(m), 24) < 16
