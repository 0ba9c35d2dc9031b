from __future__ import annotations

from onnx import helper
from passes_testkit import assert_same_outputs, check_model, make_model, op_types, tensor_info, to_ir

from passes.common_subexpression_elimination import CommonSubexpressionElimination


def test_merges_identical_nodes():
    nodes = [
        helper.make_node("Relu", ["x"], ["a"], name="relu_a"),
        helper.make_node("Relu", ["x"], ["b"], name="relu_b"),
        helper.make_node("Transpose", ["a"], ["ta"], name="t_a", perm=[1, 0]),
        helper.make_node("Transpose", ["b"], ["tb"], name="t_b", perm=[1, 0]),
        helper.make_node("Transpose", ["b"], ["tc"], name="t_c", perm=[0, 1]),  # other attrs: kept
        helper.make_node("Add", ["ta", "tb"], ["s"], name="add"),
        helper.make_node("Mul", ["s", "tc"], ["y"], name="mul"),
    ]
    proto = make_model(nodes, [tensor_info("x", [3, 3])], [tensor_info("y", [3, 3])])
    model = to_ir(proto)
    result = CommonSubexpressionElimination()(model)
    assert result.modified
    assert op_types(model) == ["Relu", "Transpose", "Transpose", "Add", "Mul"]
    assert_same_outputs(proto, model)
    check_model(model)


def test_does_not_merge_identical_comm_ops():
    nodes = [
        helper.make_node("AllReduce", ["x"], ["a"], domain="partitioner.comm", name="ar0", reduction="sum"),
        helper.make_node("AllReduce", ["x"], ["b"], domain="partitioner.comm", name="ar1", reduction="sum"),
        helper.make_node("Send", ["x"], [], domain="partitioner.comm", name="s0", peer=1),
        helper.make_node("Send", ["x"], [], domain="partitioner.comm", name="s1", peer=1),
        helper.make_node("Add", ["a", "b"], ["y"], name="add"),
    ]
    proto = make_model(nodes, [tensor_info("x", [3])], [tensor_info("y", [3])], comm=True)
    model = to_ir(proto)
    result = CommonSubexpressionElimination()(model)
    assert not result.modified
    assert op_types(model) == ["AllReduce", "AllReduce", "Send", "Send", "Add"]
    # the temporary guard attribute is gone
    for node in model.graph:
        assert not any(k.startswith("__") for k in node.attributes)
