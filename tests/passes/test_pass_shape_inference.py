from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper
from passes_testkit import assert_same_outputs, check_model, const, make_model, op_types, tensor_info, to_ir

from partitioner.core.errors import PassError
from passes.shape_inference import ShapeInference


def _model():
    # x[2,3] -> MatMul(w[3,4]) -> Relu -> Reshape(shape=[-1]) ; no value_info for intermediates
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["h"], name="mm"),
        helper.make_node("Relu", ["h"], ["r"], name="relu"),
        helper.make_node("Reshape", ["r", "shape"], ["y"], name="reshape"),
    ]
    w = np.arange(12, dtype=np.float32).reshape(3, 4) / 10
    return make_model(
        nodes,
        [tensor_info("x", [2, 3])],
        [tensor_info("y", None)],
        [const("w", w), const("shape", np.array([-1], dtype=np.int64))],
    )


def test_infers_static_shapes_and_keeps_graph():
    proto = _model()
    model = to_ir(proto)
    before = op_types(model)
    result = ShapeInference()(model)
    assert result.modified
    values = {v.name: v for n in model.graph for v in n.outputs}
    assert values["h"].shape == ir.Shape([2, 4])
    assert values["h"].dtype == ir.DataType.FLOAT
    # data propagation through the constant shape input gives Reshape a static output
    assert model.graph.outputs[0].shape == ir.Shape([8])
    assert op_types(model) == before == ["MatMul", "Relu", "Reshape"]
    assert_same_outputs(proto, model)
    check_model(model)


def test_keeps_shapes_of_comm_outputs():
    nodes = [
        helper.make_node("AllReduce", ["x"], ["y"], domain="partitioner.comm", name="ar"),
        helper.make_node("Relu", ["y"], ["z"], name="relu"),
    ]
    proto = make_model(
        nodes, [tensor_info("x", [2, 3])], [tensor_info("z", None)], comm=True,
        value_info=[tensor_info("y", [2, 3])],
    )
    model = to_ir(proto)
    ShapeInference()(model)
    assert model.graph.outputs[0].shape == ir.Shape([2, 3])
    assert model.graph.node(0).outputs[0].shape == ir.Shape([2, 3])


def test_type_error_raises_pass_error():
    nodes = [helper.make_node("Add", ["x", "i"], ["y"], name="bad_add")]
    proto = make_model(
        nodes, [tensor_info("x", [2]), tensor_info("i", [2], TensorProto.INT64)], [tensor_info("y", None)]
    )
    with pytest.raises(PassError, match="shape inference failed"):
        ShapeInference()(to_ir(proto))
