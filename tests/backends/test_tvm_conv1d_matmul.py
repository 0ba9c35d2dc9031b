"""1-D convolutions as im2col + MatMul (``backends/tvm/import_fixes.py`` rule 6, ``Conv1dAsMatMul``).

Every build matches ONNX Runtime (rtol 1e-4, atol 1e-5, seeded random weights and inputs) for the
forms the rule rewrites: an STFT written as a strided Conv1d with a long kernel and one input
channel (openwakeword's melspectrogram, silero-vad), a padded ``k = 3`` encoder layer with bias and
stride 2, dilation, batch > 1, ``auto_pad = VALID``; and for a form it must leave alone (grouped).
The rewritten build holds no ``conv1d`` kernel; with the knob off it does.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from backends.tvm import import_fixes
from tvm_build_check import build_and_compare


def _model(ci: int, co: int, length: int, k: int, *, stride: int = 1, pad: int = 0, dilation: int = 1,
           batch: int = 1, bias: bool = False, group: int = 1, auto_pad: str | None = None) -> onnx.ModelProto:
    rng = np.random.default_rng(ci * 7 + co * 3 + length + k + stride)
    w = (rng.standard_normal((co, ci // group, k)) / np.sqrt(ci * k / group)).astype(np.float32)
    inits, inputs = [numpy_helper.from_array(w, "w")], ["x", "w"]
    if bias:
        inits.append(numpy_helper.from_array(rng.standard_normal(co).astype(np.float32), "b"))
        inputs.append("b")
    attrs = dict(kernel_shape=[k], strides=[stride], dilations=[dilation], group=group)
    attrs.update(auto_pad=auto_pad) if auto_pad else attrs.update(pads=[pad, pad])
    node = helper.make_node("Conv", inputs, ["c"], **attrs)
    relu = helper.make_node("Relu", ["c"], ["y"])  # an epilogue the GEMM takes
    g = helper.make_graph([node, relu], "c1d", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, ci, length])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    return onnx.shape_inference.infer_shapes(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]))


def _has_conv1d(m: onnx.ModelProto) -> bool:
    """Build and compare with ORT; True when the build still has a conv1d kernel."""
    mod = build_and_compare(m)
    return any("conv1d" in gv.name_hint for gv in mod.get_global_vars())


@pytest.mark.parametrize("ci,co,length,k,kwargs", [
    (1, 33, 320, 64, dict(stride=16)),                            # an STFT as Conv1d (melspectrogram's form)
    (5, 7, 9, 3, dict(stride=2, pad=1, bias=True, batch=2)),       # a padded k=3 encoder layer, batch 2
    (4, 16, 20, 3, dict(dilation=2, pad=2, bias=True)),            # dilated
    (3, 8, 12, 4, dict(auto_pad="VALID")),                         # auto_pad VALID
], ids=["stft", "k3-s2-pad-b2", "dilated", "valid"])
def test_conv1d_is_a_gemm(ci: int, co: int, length: int, k: int, kwargs: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    m = _model(ci, co, length, k, **kwargs)
    assert not _has_conv1d(m)
    monkeypatch.setattr(import_fixes, "CONV1D_AS_MATMUL", False)
    assert _has_conv1d(m)


def test_grouped_conv1d_is_left_alone() -> None:
    assert _has_conv1d(_model(4, 8, 16, 3, pad=1, group=2))


def test_conv1d_with_a_frame_matrix_over_the_limit_is_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    m = _model(1, 33, 320, 64, stride=16)  # frames: 1 x 17 x 64 = 1088 elements
    monkeypatch.setattr(import_fixes, "CONV1D_MAX_COLUMNS", 1000)
    assert _has_conv1d(m)
    monkeypatch.setattr(import_fixes, "CONV1D_MAX_COLUMNS", 1088)
    assert not _has_conv1d(m)
