"""Convolutions scheduled by Contraction read their input directly when TOPI's ``pad_temp`` is an
unchanged copy (backends/tvm/schedules/contraction.py, ``INLINE_IDENTITY_COPIES``): a 1x1 conv
with 3 output channels (a segmentation head; GemmPacked's padded-N path turned off for it) and a 3x3 conv without
padding (Inception's reduction modules). Each build matches ONNX Runtime (rtol 1e-4, atol 1e-5,
seeded random weights and inputs) and its conv kernel allocates no ``pad_temp``; with the knob
off it does."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import tvm
from onnx import TensorProto, helper, numpy_helper

from backends.tvm.schedules import contraction as C
from backends.tvm.schedules import gemm_packed
from tvm_build_check import build_and_compare


def _conv(ci: int, co: int, hw: int, k: int, s: int, batch: int) -> onnx.ModelProto:
    rng = np.random.default_rng(ci + co * 3 + hw + k + s + batch)
    w = (rng.standard_normal((co, ci, k, k)) * np.sqrt(2.0 / (ci * k * k))).astype(np.float32)
    b = rng.standard_normal(co).astype(np.float32) * 0.1
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], kernel_shape=[k, k], strides=[s, s]),
             helper.make_node("Sigmoid", ["c"], ["y"])]
    g = helper.make_graph(nodes, "conv", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, ci, hw, hw])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                          [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")])
    return onnx.shape_inference.infer_shapes(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]))


def _conv_kernel(m: onnx.ModelProto) -> str:
    mod = build_and_compare(m)
    return next(f.script() for f in mod.functions.values()
                if isinstance(f, tvm.tirx.PrimFunc) and "conv2d_nhwc_update" in f.script())


@pytest.mark.parametrize("ci,co,hw,k,s,batch", [(16, 3, 12, 1, 1, 2), (16, 32, 9, 3, 2, 1)],
                         ids=["1x1-to-3-b2", "3x3s2-valid"])
def test_unpadded_conv_reads_its_input(ci: int, co: int, hw: int, k: int, s: int, batch: int,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    # GemmPacked pads a narrow 1x1 conv's N (PAD_POINTWISE_CONV) and then takes it: keep this case on
    # Contraction, whose rule this test is about
    monkeypatch.setattr(gemm_packed, "PAD_POINTWISE_CONV", False)
    m = _conv(ci, co, hw, k, s, batch)
    assert "pad_temp = T.sblock_alloc_buffer" not in _conv_kernel(m)
    monkeypatch.setattr(C, "INLINE_IDENTITY_COPIES", False)
    assert "pad_temp = T.sblock_alloc_buffer" in _conv_kernel(m)
