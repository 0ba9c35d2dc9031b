"""Injective loops whose innermost extent the vector width does not divide (24 channels on
AVX-512) are vectorised by half or a quarter of it (backends/tvm/schedules/injective.py,
``NARROW_VECTORS``): the padded input of a 24-channel 3x3 conv is copied with 8-lane vectors,
and the build matches ONNX Runtime (rtol 1e-4, atol 1e-5, seeded random weights and inputs)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import tvm
from onnx import TensorProto, helper, numpy_helper

from backends.tvm.schedules import injective as I
from backends.tvm.schedules.vector import vector_lanes
from backends.tvm.target import detect_host_target
from tvm_build_check import build_and_compare


def _model(c: int, hw: int, batch: int) -> onnx.ModelProto:
    rng = np.random.default_rng(c + hw + batch)
    w = (rng.standard_normal((c, c, 3, 3)) * np.sqrt(2.0 / (9 * c))).astype(np.float32)
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c"], ["r"]),
             helper.make_node("Conv", ["r", "w"], ["y"], kernel_shape=[3, 3], pads=[1, 1, 1, 1])]
    g = helper.make_graph(nodes, "c", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, c, hw, hw])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], [numpy_helper.from_array(w, "w")])
    return onnx.shape_inference.infer_shapes(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]))


def _build_and_check(m: onnx.ModelProto) -> list[tuple[int, int]]:
    """Build, compare with ORT; (extent, kind) of the loops around every ``pad_temp`` block."""
    mod = build_and_compare(m)
    from tvm import s_tir

    loops = []
    for f in mod.functions.values():
        if isinstance(f, tvm.tirx.PrimFunc) and 'sblock("pad_temp")' in f.script():
            sch = s_tir.Schedule(f)
            loops += [(int(sch.get(lp).extent), int(sch.get(lp).kind))
                      for lp in sch.get_loops(sch.get_sblock("pad_temp"))]
    return loops


@pytest.mark.parametrize("c,hw,batch", [(24, 10, 2), (40, 7, 1), (12, 9, 1)], ids=["24ch-b2", "40ch", "12ch"])
def test_narrow_channel_convs_match_ort(c: int, hw: int, batch: int) -> None:
    _build_and_check(_model(c, hw, batch))


def test_pad_of_24_channels_is_vectorised(monkeypatch: pytest.MonkeyPatch) -> None:
    lanes = vector_lanes(tvm.target.Target(detect_host_target()))
    if 24 % lanes == 0:
        pytest.skip(f"{lanes}-lane vectors divide 24: nothing narrower to choose")
    narrow = I._narrow_vector(24, lanes)
    assert narrow and 24 % narrow == 0 and narrow < lanes
    vectorized = int(tvm.tirx.ForKind.VECTORIZED)
    loops = _build_and_check(_model(24, 10, 2))
    assert loops and loops[-1] == (narrow, vectorized)
    monkeypatch.setattr(I, "NARROW_VECTORS", False)
    loops = _build_and_check(_model(24, 10, 2))
    assert loops and all(kind != vectorized for _, kind in loops)
