"""``ShapeInference(strict=False)``, the form the TVM backend runs before its import
(passes/shape_inference.py rule 5): it infers what strict inference infers, and a model ONNX's
inference refuses is left as it was instead of raising."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
from onnx import TensorProto, helper
from passes_testkit import const, make_model, tensor_info, to_ir

from passes.shape_inference import ShapeInference


def test_lenient_infers_what_strict_infers():
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"], name="mm"),
             helper.make_node("Reshape", ["h", "shape"], ["y"], name="reshape")]
    proto = make_model(nodes, [tensor_info("x", [2, 3])], [tensor_info("y", None)],
                       [const("w", np.ones((3, 4), np.float32)), const("shape", np.array([-1], np.int64))])
    strict, lenient = to_ir(proto), to_ir(proto)
    assert ShapeInference()(strict).modified and ShapeInference(strict=False)(lenient).modified
    shapes = [{v.name: (v.dtype, v.shape) for n in m.graph for v in n.outputs} for m in (strict, lenient)]
    assert shapes[0] == shapes[1]
    assert shapes[1]["h"] == (ir.DataType.FLOAT, ir.Shape([2, 4])) and shapes[1]["y"][1] == ir.Shape([8])


def test_lenient_does_not_raise_where_strict_does_and_agrees_with_onnx_non_strict():
    """Where strict inference refuses the model (a type error), the lenient form keeps what ONNX's
    non-strict inference (what the backend ran before it had this pass) finds, without raising."""
    nodes = [helper.make_node("Add", ["x", "i"], ["y"], name="bad_add")]
    proto = make_model(nodes, [tensor_info("x", [2]), tensor_info("i", [2], TensorProto.INT64)],
                       [tensor_info("y", None)])
    model = to_ir(proto)
    ShapeInference(strict=False)(model)
    want = {v.name: v for v in onnx.shape_inference.infer_shapes(proto).graph.output}["y"].type.tensor_type
    got = model.graph.node(0).outputs[0]
    assert got.dtype == ir.DataType(want.elem_type)
    assert list(got.shape) == [d.dim_value for d in want.shape.dim]
