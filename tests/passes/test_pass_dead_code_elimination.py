from __future__ import annotations

import numpy as np
from onnx import helper
from passes_testkit import assert_same_outputs, check_model, const, make_model, op_types, tensor_info, to_ir

from passes.dead_code_elimination import DeadCodeElimination


def test_removes_dead_chain_and_unused_initializers():
    nodes = [
        helper.make_node("Relu", ["x"], ["r"], name="relu"),
        helper.make_node("Mul", ["x", "w_dead"], ["d1"], name="dead_mul"),  # dead
        helper.make_node("Exp", ["d1"], ["d2"], name="dead_exp"),  # dead, only feeds nothing
        helper.make_node("Add", ["r", "b"], ["y"], name="add"),
    ]
    inits = [
        const("b", np.array([1.0, 2.0, 3.0], np.float32)),
        const("w_dead", np.array([4.0, 5.0, 6.0], np.float32)),
        const("w_unused", np.array([7.0], np.float32)),
    ]
    proto = make_model(nodes, [tensor_info("x", [3])], [tensor_info("y", [3])], inits)
    model = to_ir(proto)
    assert op_types(model) == ["Relu", "Mul", "Exp", "Add"]
    result = DeadCodeElimination()(model)
    assert result.modified
    assert op_types(model) == ["Relu", "Add"]
    assert sorted(model.graph.initializers) == ["b"]
    assert [i.name for i in model.graph.inputs] == ["x"]
    assert not DeadCodeElimination()(model).modified
    assert_same_outputs(proto, model)
    check_model(model)


def test_keeps_send_and_unused_comm_results():
    nodes = [
        helper.make_node("Relu", ["x"], ["r"], name="relu"),
        helper.make_node("Send", ["r"], [], domain="partitioner.comm", name="send", peer=1, tag=0),
        helper.make_node("AllReduce", ["x"], ["ignored"], domain="partitioner.comm", name="ar"),
        helper.make_node("Neg", ["x"], ["dead"], name="dead_neg"),
        helper.make_node("Identity", ["x"], ["y"], name="out"),
    ]
    proto = make_model(nodes, [tensor_info("x", [3])], [tensor_info("y", [3])], comm=True)
    model = to_ir(proto)
    DeadCodeElimination()(model)
    # Send has no outputs and AllReduce's result is unused: both stay, and so does Relu (feeds Send)
    assert op_types(model) == ["Relu", "Send", "AllReduce", "Identity"]


def test_drops_unread_optional_outputs_only():
    """Dropout's mask and MaxPool's Indices are optional outputs: unread ones are dropped (rule 4),
    a read one is kept."""
    nodes = [
        helper.make_node("Dropout", ["x"], ["d", "mask"], name="drop"),
        helper.make_node("MaxPool", ["d"], ["p", "idx"], name="pool", kernel_shape=[2]),
        helper.make_node("Relu", ["p"], ["y"], name="relu"),
        helper.make_node("Dropout", ["x"], ["d2", "mask2"], name="drop_read"),
        helper.make_node("Not", ["mask2"], ["m"], name="not"),
    ]
    from onnx import TensorProto

    proto = make_model(nodes, [tensor_info("x", [1, 2, 4])],
                       [tensor_info("y", [1, 2, 3]), tensor_info("m", [1, 2, 4], TensorProto.BOOL)], [])
    model = to_ir(proto)
    assert DeadCodeElimination()(model).modified
    outs = {n.name: [v.name for v in n.outputs] for n in model.graph}
    assert outs["drop"] == ["d"] and outs["pool"] == ["p"]
    assert outs["drop_read"] == ["d2", "mask2"]
    assert op_types(model) == ["Dropout", "MaxPool", "Relu", "Dropout", "Not"]
    assert not DeadCodeElimination()(model).modified
    assert_same_outputs(proto, model)
    check_model(model)
