"""A batched direct convolution copies one image's padded input at a time, just before that
image's output tiles, with the images as the parallel loop (backends/tvm/schedules/contraction.py,
``_image_pad``, knob ``PAD_PER_IMAGE``). Every build matches ONNX Runtime (rtol 1e-4, atol 1e-5,
seeded random weights and input); with the knob off the whole batch is padded in a pass of its own
before the convolution (so the structural check fails)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import tvm
from onnx import TensorProto, helper, numpy_helper
from tvm import s_tir

from backends.tvm.schedules import contraction as C
from tvm_build_check import build_and_compare


def conv3x3_relu(batch: int, ci: int, co: int, hw: int, stride: int = 1) -> onnx.ModelProto:
    """Conv 3x3 (padded 1) + bias + ReLU on ``[batch, ci, hw, hw]``, seeded random weights (also
    used by test_tvm_conv_pad_border)."""
    rng = np.random.default_rng(batch * 100 + ci + co)
    w = (rng.standard_normal((co, ci, 3, 3)) * np.sqrt(2.0 / (ci * 9))).astype(np.float32)
    b = (rng.standard_normal(co) * 0.1).astype(np.float32)
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], kernel_shape=[3, 3], pads=[1] * 4,
                              strides=[stride, stride]),
             helper.make_node("Relu", ["c"], ["y"])]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, ci, hw, hw])
    g = helper.make_graph(nodes, "conv", [x], [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                          [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")])
    return onnx.shape_inference.infer_shapes(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]))


def _pad_inside_image_loop(mod: tvm.IRModule) -> bool:
    """Whether the conv's ``pad_temp`` copy sits in the same outermost loop as the conv's update
    (the image loop), rather than in a loop nest of its own before it."""
    for f in mod.functions.values():
        if not isinstance(f, tvm.tirx.PrimFunc) or 'sblock("pad_temp")' not in f.script():
            continue
        if "conv2d_nhwc_update" not in f.script():
            continue
        sch = s_tir.Schedule(f)
        pad = sch.get_loops(sch.get_sblock("pad_temp"))
        conv = sch.get_loops(sch.get_sblock("conv2d_nhwc_update"))
        return sch.get(pad[0]).same_as(sch.get(conv[0]))
    raise AssertionError("no padded conv found")


@pytest.mark.parametrize("batch,ci,co,hw,stride", [(8, 16, 16, 12, 1), (4, 32, 64, 10, 1), (6, 16, 32, 9, 2)],
                         ids=["unet-like-b8", "b4-64ch", "stride2-odd"])
def test_pad_is_copied_per_image(batch: int, ci: int, co: int, hw: int, stride: int) -> None:
    assert _pad_inside_image_loop(build_and_compare(conv3x3_relu(batch, ci, co, hw, stride)))


def test_knob_off_pads_the_whole_batch_first(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(C, "PAD_PER_IMAGE", False)
    assert not _pad_inside_image_loop(build_and_compare(conv3x3_relu(8, 16, 16, 12)))


def test_small_batches_and_large_weights_keep_one_pass() -> None:
    """Below PAD_PER_IMAGE_MIN_BATCH the images are too few to be the parallel loop; weights over
    PAD_PER_IMAGE_MAX_WEIGHT_BYTES (3x3 256 -> 256: 2.25 MiB) would be read again per image."""
    assert not _pad_inside_image_loop(build_and_compare(conv3x3_relu(2, 16, 16, 12)))
    assert not _pad_inside_image_loop(build_and_compare(conv3x3_relu(4, 256, 256, 4)))
