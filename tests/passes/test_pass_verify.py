from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest
from onnx import helper
from passes_testkit import const, make_model, tensor_info, to_ir

from partitioner.core.errors import VerifyError
from passes import verify
from passes.shape_inference import ShapeInference


def _chain():
    nodes = [
        helper.make_node("Relu", ["x"], ["r"], name="relu"),
        helper.make_node("Add", ["r", "b"], ["y"], name="add"),
    ]
    return make_model(
        nodes, [tensor_info("x", [2, 3])], [tensor_info("y", None)], [const("b", np.ones(3, np.float32))]
    )


def test_accepts_valid_model_with_inferred_shapes():
    model = to_ir(_chain())
    verify(model, require_shapes=False)
    ShapeInference()(model)
    verify(model)


def test_catches_non_topological_order():
    nodes = [
        helper.make_node("Add", ["r", "x"], ["y"], name="add"),
        helper.make_node("Relu", ["x"], ["r"], name="relu"),
    ]
    model = to_ir(make_model(nodes, [tensor_info("x", [2])], [tensor_info("y", [2])]))
    with pytest.raises(VerifyError, match=r"node 'add' \(Add\) reads value 'r' before node 'relu'"):
        verify(model, require_shapes=False)


def test_catches_dangling_input():
    nodes = [helper.make_node("Add", ["x", "ghost"], ["y"], name="add")]
    model = to_ir(make_model(nodes, [tensor_info("x", [2])], [tensor_info("y", [2])]))
    with pytest.raises(VerifyError, match=r"node 'add' \(Add\) input 1 value 'ghost' is dangling"):
        verify(model, require_shapes=False)


def test_catches_missing_shape():
    model = to_ir(_chain())  # 'r' has no shape before inference
    with pytest.raises(VerifyError, match=r"value 'r' .*has no known (shape|dtype)"):
        verify(model)


def test_catches_symbolic_shape():
    nodes = [helper.make_node("Relu", ["x"], ["y"], name="relu")]
    model = to_ir(make_model(nodes, [tensor_info("x", ["N", 3])], [tensor_info("y", ["N", 3])]))
    verify(model, require_shapes=False)
    with pytest.raises(VerifyError, match=r"value 'x' \(graph input\) has a non-static shape"):
        verify(model)


def test_catches_duplicate_value_names():
    x = ir.Value(name="x", shape=ir.Shape([2]), type=ir.TensorType(ir.DataType.FLOAT))
    a = ir.node("Relu", [x], name="a")
    b = ir.node("Neg", [x], name="b")
    a.outputs[0].name = "same"
    graph = ir.Graph([x], [a.outputs[0]], nodes=[a, b], opset_imports={"": 17})
    b.outputs[0].name = "same"  # renamed after the graph was built, bypassing the name authority
    with pytest.raises(VerifyError, match="two values are named 'same'"):
        verify(ir.Model(graph, ir_version=8), require_shapes=False)


def test_catches_broken_use_def_links():
    model = to_ir(_chain())
    relu = model.graph.node("relu")
    relu.outputs[0]._uses.clear()  # simulate an edit that bypassed the IR's bookkeeping
    expected = r"node 'add' \(Add\) reads value 'r' at input 0 but the value's uses"
    with pytest.raises(VerifyError, match=expected):
        verify(model, require_shapes=False)


def test_catches_unproduced_graph_output():
    x = ir.Value(name="x", shape=ir.Shape([2]), type=ir.TensorType(ir.DataType.FLOAT))
    orphan = ir.Value(name="orphan", shape=ir.Shape([2]), type=ir.TensorType(ir.DataType.FLOAT))
    relu = ir.node("Relu", [x], name="relu")
    graph = ir.Graph([x], [relu.outputs[0], orphan], nodes=[relu], opset_imports={"": 17})
    with pytest.raises(VerifyError, match="graph output 1 value 'orphan' is not produced"):
        verify(ir.Model(graph, ir_version=8), require_shapes=False)


def test_comm_ops_are_legal_and_checked():
    nodes = [
        helper.make_node("Recv", [], ["r"], domain="partitioner.comm", name="recv", peer=0),
        helper.make_node("AllReduce", ["r"], ["s"], domain="partitioner.comm", name="ar"),
        helper.make_node("Send", ["s"], [], domain="partitioner.comm", name="send", peer=0),
        helper.make_node("Relu", ["s"], ["y"], name="relu"),
    ]
    shapes = [tensor_info("r", [4]), tensor_info("s", [4])]
    model = to_ir(make_model(nodes, [], [tensor_info("y", [4])], comm=True, value_info=shapes))
    verify(model)

    bad = [helper.make_node("AllScatterGather", ["x"], ["y"], domain="partitioner.comm", name="bogus")]
    model = to_ir(make_model(bad, [tensor_info("x", [4])], [tensor_info("y", [4])], comm=True))
    with pytest.raises(VerifyError, match="node 'bogus' .*unknown communication op"):
        verify(model, require_shapes=False)

    not_imported = to_ir(make_model(nodes, [], [tensor_info("y", [4])], comm=False, value_info=shapes))
    with pytest.raises(VerifyError, match="domain 'partitioner.comm' is not in the model's opset_imports"):
        verify(not_imported, require_shapes=False)
