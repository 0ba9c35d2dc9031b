"""A concatenation along the innermost (NHWC channel) axis runs one vectorised loop per input
(backends/tvm/schedules/injective.py, ``SPLIT_CONCAT``): Inception-style branches of 24 and 40
channels, and a skip concat of 16 + 16; each build matches ONNX Runtime (rtol 1e-4, atol 1e-5,
seeded random weights and inputs)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import tvm
from onnx import TensorProto, helper, numpy_helper

from backends.tvm.schedules import injective as I
from tvm_build_check import build_and_compare


def _model(widths: tuple[int, ...], c: int = 8, hw: int = 6, batch: int = 2) -> onnx.ModelProto:
    """1x1 conv + ReLU branches of ``widths`` channels on one input, concatenated on channels,
    and a 1x1 conv on the concat."""
    rng = np.random.default_rng(sum(widths))
    nodes, inits, outs = [], [], []
    for i, w in enumerate(widths):
        wt = (rng.standard_normal((w, c, 1, 1)) * np.sqrt(2.0 / c)).astype(np.float32)
        inits.append(numpy_helper.from_array(wt, f"w{i}"))
        nodes += [helper.make_node("Conv", ["x", f"w{i}"], [f"c{i}"], kernel_shape=[1, 1]),
                  helper.make_node("Relu", [f"c{i}"], [f"r{i}"])]
        outs.append(f"r{i}")
    wt = (rng.standard_normal((4, sum(widths), 1, 1)) * np.sqrt(2.0 / sum(widths))).astype(np.float32)
    inits.append(numpy_helper.from_array(wt, "wy"))
    # a conv after the concat: the concat stays NHWC
    nodes += [helper.make_node("Concat", outs, ["cat"], axis=1),
              helper.make_node("Conv", ["cat", "wy"], ["y"], kernel_shape=[1, 1])]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, c, hw, hw])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    g = helper.make_graph(nodes, "cat", [x], [y], inits)
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    return onnx.shape_inference.infer_shapes(model)


def _concat_vector_loops(mod: tvm.IRModule) -> list[int]:
    """Per concatenate PrimFunc of ``mod``, how many vectorised loops it holds."""
    return [f.script().count("T.vectorized(") for gv, f in mod.functions.items()
            if isinstance(f, tvm.tirx.PrimFunc) and "concatenate" in gv.name_hint]


@pytest.mark.parametrize("widths", [(24, 24, 24, 24), (40, 24), (16, 16), (3, 5)],
                         ids=["4x24", "40+24", "16+16", "3+5"])
def test_channel_concats_match_ort(widths: tuple[int, ...]) -> None:
    build_and_compare(_model(widths))


def test_concat_runs_one_vector_loop_per_input(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _concat_vector_loops(build_and_compare(_model((24, 24, 24, 24)))) == [4]
    monkeypatch.setattr(I, "SPLIT_CONCAT", False)
    assert _concat_vector_loops(build_and_compare(_model((24, 24, 24, 24)))) in ([1], [0])
