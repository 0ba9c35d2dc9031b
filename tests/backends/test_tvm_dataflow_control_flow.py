"""A segment that keeps a data-dependent ``If`` still fuses the ops around it
(``backends/tvm/lower.py``, ``_dataflow_around_control_flow``, knob ``DATAFLOW_AROUND_CONTROL_FLOW``).

The graph is openwakeword hey_jarvis's form: Gemm, a LayerNorm written as ReduceMean/Sub/Pow/Sqrt/Div,
Relu, then an ``If`` on a value computed from the data. The build matches ONNX Runtime (rtol 1e-4,
atol 1e-5, seeded random weights, inputs taking both branches) and holds fused kernels (the Gemm
with its bias, the normalisation's elementwise chain); with the knob off every op is its own kernel.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from backends.tvm import lower
from tvm_build_check import build_and_compare


def _model(shift: float) -> onnx.ModelProto:
    rng = np.random.default_rng(5)
    c = {"w": rng.standard_normal((48, 32)).astype(np.float32) / 7, "b": rng.standard_normal(32).astype(np.float32),
         "eps": np.array(1e-5, np.float32), "two": np.array(2.0, np.float32), "shift": np.array(shift, np.float32),
         "zero": np.array(0.0, np.float32)}
    nodes = [helper.make_node("Gemm", ["x", "w", "b"], ["g"]),
             helper.make_node("ReduceMean", ["g"], ["mu"], axes=[-1]),
             helper.make_node("Sub", ["g", "mu"], ["d"]),
             helper.make_node("Pow", ["d", "two"], ["d2"]),
             helper.make_node("ReduceMean", ["d2"], ["var"], axes=[-1]),
             helper.make_node("Add", ["var", "eps"], ["ve"]),
             helper.make_node("Sqrt", ["ve"], ["sd"]),
             helper.make_node("Div", ["d", "sd"], ["n"]),
             helper.make_node("Relu", ["n"], ["r"]),
             helper.make_node("Add", ["r", "shift"], ["rs"]),
             helper.make_node("ReduceSum", ["rs"], ["s"], keepdims=0),
             helper.make_node("Greater", ["s", "zero"], ["cond"])]
    then = helper.make_graph([helper.make_node("Sigmoid", ["rs"], ["t"])], "then", [],
                             [helper.make_tensor_value_info("t", TensorProto.FLOAT, [2, 32])])
    other = helper.make_graph([helper.make_node("Neg", ["rs"], ["e"])], "else", [],
                              [helper.make_tensor_value_info("e", TensorProto.FLOAT, [2, 32])])
    nodes.append(helper.make_node("If", ["cond"], ["y"], then_branch=then, else_branch=other))
    g = helper.make_graph(nodes, "ifnet", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 48])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 32])],
                          [numpy_helper.from_array(v, k) for k, v in c.items()])
    return onnx.shape_inference.infer_shapes(helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)]))


def _fused(m: onnx.ModelProto) -> list[str]:
    return [gv.name_hint for gv in build_and_compare(m).get_global_vars() if gv.name_hint.startswith("fused_")]


@pytest.mark.parametrize("shift", [0.5, -5.0], ids=["then", "else"])
def test_ops_around_an_if_fuse(shift: float, monkeypatch: pytest.MonkeyPatch) -> None:
    m = _model(shift)
    fused = _fused(m)
    assert any("matmul" in k and "add" in k for k in fused), fused
    # the normalisation's chain: one layer_norm kernel since import rule 8 (DecomposedLayerNorm),
    # its elementwise ops (divide) with that rule off; fused with the Relu/Add either way
    assert any("divide" in k or "layer_norm" in k for k in fused), fused
    monkeypatch.setattr(lower, "DATAFLOW_AROUND_CONTROL_FLOW", False)
    assert _fused(m) == []
