from __future__ import annotations

import numpy as np
from onnx import helper
from passes_testkit import assert_same_outputs, check_model, const, make_model, op_types, tensor_info, to_ir

from passes.identity_elimination import IdentityElimination


def test_removes_inner_identities_keeps_signature():
    nodes = [
        helper.make_node("Identity", ["x"], ["x1"], name="id0"),
        helper.make_node("Relu", ["x1"], ["r"], name="relu"),
        helper.make_node("Identity", ["r"], ["r1"], name="id1"),
        helper.make_node("Add", ["r1", "b"], ["s"], name="add"),
        helper.make_node("Identity", ["s"], ["y"], name="id_out"),  # output renames s -> y
        helper.make_node("Identity", ["b"], ["b_out"], name="id_init_out"),  # must stay (init -> output)
    ]
    proto = make_model(
        nodes, [tensor_info("x", [3])], [tensor_info("y", [3]), tensor_info("b_out", [3])],
        [const("b", np.array([1.0, -2.0, 0.5], np.float32))],
    )
    model = to_ir(proto)
    assert op_types(model).count("Identity") == 4
    result = IdentityElimination()(model)
    assert result.modified
    assert op_types(model) == ["Relu", "Add", "Identity"]
    assert [o.name for o in model.graph.outputs] == ["y", "b_out"]
    assert_same_outputs(proto, model)
    check_model(model)


def test_identity_between_two_graph_outputs_stays():
    """v2 = Identity(v0) with both v0 and v2 graph outputs (found by the pipeline property test):
    onnx-ir renamed v0 to v2, leaving two outputs named v2."""
    nodes = [
        helper.make_node("Add", ["x", "x"], ["v0"], name="n0"),
        helper.make_node("Add", ["x", "x"], ["v1"], name="n1"),
        helper.make_node("Identity", ["v0"], ["v2"], name="n2"),
    ]
    proto = make_model(nodes, [tensor_info("x", [2, 3])], [tensor_info("v0", [2, 3]), tensor_info("v2", [2, 3])], [])
    model = to_ir(proto)
    IdentityElimination()(model)
    assert [o.name for o in model.graph.outputs] == ["v0", "v2"]
    assert "Identity" in op_types(model)
    assert_same_outputs(proto, model)
    check_model(model)
