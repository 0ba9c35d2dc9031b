"""Non-overlapping ConvTranspose as GEMM + pixel shuffle (backends/tvm/conv_algorithms.py,
``conv_transpose_as_matmul``, run by the pipeline's batch-norm folding pass).

Every build matches ONNX Runtime (rtol 1e-4, atol 1e-5, seeded random weights and inputs), for
the shapes the rule rewrites (kernel == stride: U-Net's 2x2/2, a 3x3/3, with and without bias,
channel counts the vector width does not divide, batch > 1) and for ones it must leave alone
(overlapping 3x3/2 with padding and output padding; grouped). The rewritten build holds no
``conv2d_transpose`` kernel; with the knob off it does.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import tvm
from onnx import TensorProto, helper, numpy_helper

from backends.tvm import conv_algorithms as CA
from tvm_build_check import build_and_compare


def _model(ci: int, co: int, hw: int, k: int, s: int, batch: int, bias: bool = True, pad: int = 0,
           out_pad: int = 0, group: int = 1) -> onnx.ModelProto:
    rng = np.random.default_rng(ci * 11 + co * 5 + hw + k + s + batch)
    w = (rng.standard_normal((ci, co // group, k, k)) * np.sqrt(1.0 / ci)).astype(np.float32)
    inits = [numpy_helper.from_array(w, "w")]
    inputs = ["x", "w"]
    if bias:
        inits.append(numpy_helper.from_array(rng.standard_normal(co).astype(np.float32), "b"))
        inputs.append("b")
    node = helper.make_node("ConvTranspose", inputs, ["y"], kernel_shape=[k, k], strides=[s, s], pads=[pad] * 4,
                            output_padding=[out_pad] * 2, group=group)
    g = helper.make_graph([node], "ct", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, ci, hw, hw])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    return onnx.shape_inference.infer_shapes(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]))


def _check(m: onnx.ModelProto) -> bool:
    """Build and compare with ORT; True when the build still has a conv2d_transpose kernel."""
    mod = build_and_compare(m)
    return any("conv2d_transpose" in gv.name_hint for gv in mod.get_global_vars())


@pytest.mark.parametrize("ci,co,hw,k,s,batch,bias", [
    (64, 32, 8, 2, 2, 2, True),    # U-Net's upsampling, batch 2
    (24, 12, 5, 2, 2, 1, False),   # channels the vector width does not divide, no bias
    (16, 8, 4, 3, 3, 1, True),     # 3x3 stride 3
], ids=["2x2s2-b2", "24to12-nobias", "3x3s3"])
def test_non_overlapping_conv_transpose_is_a_gemm(ci: int, co: int, hw: int, k: int, s: int, batch: int,
                                                  bias: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    m = _model(ci, co, hw, k, s, batch, bias)
    assert not _check(m)
    monkeypatch.setattr(CA, "CONV_TRANSPOSE_AS_MATMUL", False)
    assert _check(m)


@pytest.mark.parametrize("kwargs", [dict(k=3, s=2, pad=1, out_pad=1), dict(k=2, s=2, group=2)],
                         ids=["overlapping", "grouped"])
def test_other_conv_transposes_are_left_alone(kwargs: dict) -> None:
    assert _check(_model(16, 8, 6, batch=1, **kwargs))
