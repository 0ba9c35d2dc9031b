"""Small builders for cost-model tests: onnx.helper graphs -> shape-inferred ir.Model."""

from __future__ import annotations

from pathlib import Path

import onnx
import onnx_ir as ir
from onnx import TensorProto, helper

LIGHT_DIR = Path(onnx.__file__).parent / "backend" / "test" / "data" / "light"
F = TensorProto.FLOAT


def vi(name: str, shape: list[int] | None, dtype: int = F) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, dtype, shape)


def model_of(nodes: list[onnx.NodeProto], inputs: list[onnx.ValueInfoProto],
             outputs: list[onnx.ValueInfoProto], initializers: list[onnx.TensorProto] | None = None,
             opset: int = 17, extra_opsets: dict[str, int] | None = None) -> ir.Model:
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializer=initializers or [])
    imports = [helper.make_opsetid("", opset)]
    for dom, ver in (extra_opsets or {}).items():
        imports.append(helper.make_opsetid(dom, ver))
    proto = helper.make_model(graph, opset_imports=imports)
    proto = onnx.shape_inference.infer_shapes(proto, data_prop=True)
    return ir.serde.deserialize_model(proto)


def light_model(name: str) -> ir.Model:
    proto = onnx.load(str(LIGHT_DIR / f"{name}.onnx"))
    proto = onnx.shape_inference.infer_shapes(proto, data_prop=True)
    return ir.serde.deserialize_model(proto)


def single_node(op: str, inputs: list[tuple[str, list[int]]], output: str = "y", **attrs) -> ir.Node:
    """A one-node model with shapes inferred; returns the node."""
    node = helper.make_node(op, [n for n, _ in inputs], [output], **attrs)
    model = model_of([node], [vi(n, s) for n, s in inputs], [vi(output, None)])
    return next(iter(model.graph))
