"""The zero-padded RGB input of a stem convolution is copied one row at a time: the row's zeros,
then its interior as one vectorised contiguous run, with no bounds check per element
(backends/tvm/schedules/injective.py, ``schedule_padded_copy``, knob ``SPLIT_PAD_COPY``). Every
build matches ONNX Runtime (rtol 1e-4, atol 1e-5, seeded random weights and input); with the knob
off the copy is the old single bounds-checked loop (so the structural check fails)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import tvm
from onnx import TensorProto, helper, numpy_helper

from backends.tvm.schedules import injective as I
from tvm_build_check import build_and_compare


def _stem(hw: int, batch: int, k: int = 7, stride: int = 2, pad: int = 3) -> onnx.ModelProto:
    """Conv kxk stride s (3 -> 16 channels, padded) + bias + ReLU, as a ResNet stem."""
    rng = np.random.default_rng(hw * 10 + batch)
    w = (rng.standard_normal((16, 3, k, k)) * np.sqrt(2.0 / (3 * k * k))).astype(np.float32)
    b = (rng.standard_normal(16) * 0.1).astype(np.float32)
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], kernel_shape=[k, k], pads=[pad] * 4,
                              strides=[stride, stride]),
             helper.make_node("Relu", ["c"], ["y"])]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, 3, hw, hw])
    g = helper.make_graph(nodes, "stem", [x], [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                          [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")])
    return onnx.shape_inference.infer_shapes(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]))


def _pad_blocks(mod: tvm.IRModule) -> list[str]:
    """The scripts of the scheduled functions that copy a padded input."""
    return [f.script() for f in mod.functions.values()
            if isinstance(f, tvm.tirx.PrimFunc) and 'sblock("pad_temp' in f.script()]


@pytest.mark.parametrize("hw,batch,k,stride,pad", [(32, 2, 7, 2, 3), (20, 1, 3, 1, 1), (17, 3, 7, 2, 3)],
                         ids=["7x7s2-b2", "3x3s1", "7x7s2-odd"])
def test_rgb_pad_is_split_into_zeros_and_a_vector_copy(hw: int, batch: int, k: int, stride: int, pad: int) -> None:
    scripts = _pad_blocks(build_and_compare(_stem(hw, batch, k, stride, pad)))
    assert scripts
    for s in scripts:
        copy = s[s.index('sblock("pad_temp")'):]
        assert 'sblock("pad_temp_pad_const")' in s  # the row's zeros, a block of their own
        assert "if_then_else" not in copy  # the interior: no bounds check per element
        if hw * 3 % 8 == 0:  # a row's interior a whole number of (narrow) vectors: copied by vectors
            assert "T.vectorized" in s[:s.index('sblock("pad_temp")')]


def test_knob_off_keeps_the_bounds_checked_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(I, "SPLIT_PAD_COPY", False)
    scripts = _pad_blocks(build_and_compare(_stem(32, 2)))
    assert scripts and all("pad_const" not in s and "if_then_else" in s for s in scripts)


def test_wide_channel_pads_are_left_alone() -> None:
    """64 channels innermost: the copy was vectorised already (see the rule's docstring)."""
    rng = np.random.default_rng(5)
    w = (rng.standard_normal((64, 64, 3, 3)) * 0.05).astype(np.float32)
    node = helper.make_node("Conv", ["x", "w"], ["y"], kernel_shape=[3, 3], pads=[1, 1, 1, 1])
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64, 12, 12])
    g = helper.make_graph([node], "c", [x], [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                          [numpy_helper.from_array(w, "w")])
    m = onnx.shape_inference.infer_shapes(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]))
    scripts = _pad_blocks(build_and_compare(m))
    assert scripts and all("pad_const" not in s for s in scripts)
