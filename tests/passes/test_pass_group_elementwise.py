from __future__ import annotations

import numpy as np
from onnx import helper
from passes_testkit import assert_same_outputs, check_model, const, make_model, op_types, tensor_info, to_ir

from passes.fusion_groups import fusion_units, group_of, groups
from passes.group_elementwise import GroupElementwise
from passes.shape_inference import ShapeInference


def test_chains_and_trees_of_elementwise_ops_are_grouped():
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["m"], name="mm"),
        helper.make_node("Add", ["m", "b"], ["a"], name="add_b"),
        helper.make_node("Tanh", ["a"], ["t"], name="tanh"),
        helper.make_node("Exp", ["z"], ["e"], name="exp"),  # same shape as t
        helper.make_node("Mul", ["t", "e"], ["p"], name="mul"),
        helper.make_node("Relu", ["p"], ["y"], name="relu"),  # graph output
        helper.make_node("Neg", ["y"], ["n"], name="neg"),  # alone: Sigmoid below broadcasts up
        helper.make_node("Add", ["n", "row"], ["y2"], name="grow"),
    ]
    inits = [const("w", np.ones((4, 3), np.float32)), const("b", np.ones(3, np.float32))]
    proto = make_model(
        nodes,
        [tensor_info("x", [2, 4]), tensor_info("z", [2, 3]), tensor_info("row", [5, 2, 3])],
        [tensor_info("y", [2, 3]), tensor_info("y2", [5, 2, 3])],
        inits,
    )
    model = to_ir(proto)
    ShapeInference()(model)
    assert GroupElementwise()(model).modified
    found = groups(model.graph)
    assert [sorted(n.name for n in m) for m in found.values()] == [["add_b", "exp", "mul", "relu", "tanh"]]
    assert group_of(model.graph.node(0)) is None
    assert [len(u) for u in fusion_units(model.graph)] == [1, 5, 1, 1]
    assert op_types(model) == op_types(proto)
    assert not GroupElementwise()(model).modified
    assert_same_outputs(proto, model, rtol=1e-5, atol=1e-5)
    check_model(model)


def test_value_with_two_readers_ends_a_chain():
    nodes = [
        helper.make_node("Relu", ["x"], ["r"], name="relu"),
        helper.make_node("Exp", ["r"], ["e"], name="exp"),
        helper.make_node("Neg", ["r"], ["n"], name="neg"),
        helper.make_node("Sigmoid", ["n"], ["s"], name="sig"),
        helper.make_node("Add", ["e", "s"], ["y"], name="add"),
    ]
    proto = make_model(nodes, [tensor_info("x", [3])], [tensor_info("y", [3])])
    model = to_ir(proto)
    ShapeInference()(model)
    GroupElementwise()(model)
    found = groups(model.graph)
    assert [sorted(n.name for n in m) for m in found.values()] == [["add", "exp", "neg", "sig"]]
    assert group_of(model.graph.node(0)) is None
    assert_same_outputs(proto, model, rtol=1e-5, atol=1e-5)
