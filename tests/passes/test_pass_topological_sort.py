from __future__ import annotations

import pytest
from onnx import helper
from passes_testkit import assert_same_outputs, check_model, make_model, op_types, tensor_info, to_ir

from partitioner.core.errors import VerifyError
from passes import verify
from passes.topological_sort import TopologicalSort


def test_sorts_out_of_order_graph():
    nodes = [
        helper.make_node("Add", ["r", "n"], ["y"], name="add"),
        helper.make_node("Relu", ["n"], ["r"], name="relu"),
        helper.make_node("Neg", ["x"], ["n"], name="neg"),
    ]
    proto = make_model(nodes, [tensor_info("x", [4])], [tensor_info("y", [4])])
    model = to_ir(proto)
    with pytest.raises(VerifyError, match="not topologically sorted"):
        verify(model, require_shapes=False)
    result = TopologicalSort()(model)
    assert result.modified
    assert op_types(model) == ["Neg", "Relu", "Add"]
    verify(model, require_shapes=False)
    sorted_proto = helper.make_model(
        helper.make_graph(
            [nodes[2], nodes[1], nodes[0]], "test", list(proto.graph.input), list(proto.graph.output)
        ),
        opset_imports=list(proto.opset_import), ir_version=proto.ir_version,
    )
    assert_same_outputs(sorted_proto, model)  # ORT refuses the unsorted original
    check_model(model)
