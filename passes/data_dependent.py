"""Find the nodes whose output shapes depend on input *values*, to refuse them by name.

The project compiles static shapes only (every backend program has fixed tensor sizes). A node
whose tensor inputs all have static shapes but one of whose tensor outputs does not, after ONNX
shape inference with data propagation, makes a shape that depends on run-time values: ``Unique``,
``NonZero``, ``Compress`` with a run-time condition, ``Range`` with run-time bounds, an ``If`` whose
branches return different shapes, ... When the graph fails to verify for lack of static shapes,
the pass manager asks :func:`data_dependent_refusal` for a clean refusal that lists these nodes
(:class:`partitioner.core.errors.DataDependentShapeError`, an ``UnsupportedOpError`` that is also a
``PassError``) instead of a bare pass failure: nothing failed,
the model asks for something the project does not do.
"""

from __future__ import annotations

import onnx_ir as ir

from partitioner.core.errors import DataDependentShapeError


def _shape(value: ir.Value) -> ir.Shape | None:
    if value.type is not None and not isinstance(value.type, ir.TensorType):
        return None  # sequences and optionals are judged by the backends, not here
    if value.shape is not None:
        return value.shape
    return value.const_value.shape if value.const_value is not None else None


def data_dependent_nodes(model: ir.Model) -> list[ir.Node]:
    """Main-graph nodes whose tensor inputs all have known static shapes and one of whose tensor
    outputs has a non-static dimension, or a known tensor type but no shape (an output with no
    type at all is a missing inference, not a data-dependent shape)."""
    found = []
    for node in model.graph:
        ins = [_shape(v) for v in node.inputs if v is not None]
        outs = [_shape(v) for v in node.outputs]
        if any(v is not None and _shape(v) is None and (v.type is None or isinstance(v.type, ir.TensorType))
               for v in node.inputs):
            continue
        typed_unshaped = any(v.shape is None and isinstance(v.type, ir.TensorType) and v.const_value is None
                             for v in node.outputs)
        if all(s is None or s.is_static() for s in ins) and (
                typed_unshaped or any(s is not None and not s.is_static() for s in outs)):
            found.append(node)
    return found


def data_dependent_refusal(model: ir.Model, message: str) -> DataDependentShapeError | None:
    """A :class:`DataDependentShapeError` with ``message`` (the failure as the pass manager would
    report it) and the data-dependent nodes, or None when there are none."""
    nodes = data_dependent_nodes(model)
    if not nodes:
        return None
    ops = [(n.name or "<unnamed>", n.op_type) for n in nodes]
    listing = ", ".join(f"{name} ({op})" for name, op in ops[:8]) + (f" and {len(ops) - 8} more" if len(ops) > 8 else "")
    return DataDependentShapeError(
        f"{message}; refused: {len(ops)} node(s) make a shape that depends on input values: {listing} (the project "
        "compiles static shapes only: bind the values that decide the shape, or run the model with ONNX Runtime)", ops)
