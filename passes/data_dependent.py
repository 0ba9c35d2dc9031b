"""Find the nodes whose output shapes depend on input *values*, to refuse them by name.

The project compiles static shapes only (every backend program has fixed tensor sizes). A node
whose tensor inputs all have static shapes but one of whose tensor outputs does not, after ONNX
shape inference with data propagation, makes a shape that depends on run-time values: ``Unique``,
``NonZero``, ``Compress`` with a run-time condition, ``Range`` with run-time bounds, an ``If`` whose
branches return different shapes, ... When the graph fails to verify for lack of static shapes,
the pass manager asks :func:`data_dependent_refusal` for a clean refusal that lists these nodes
(:class:`partitioner.core.errors.UnsupportedOpError`) instead of a pass failure: nothing failed,
the model asks for something the project does not do.
"""

from __future__ import annotations

import onnx_ir as ir

from partitioner.core.errors import UnsupportedOpError


def _static(value: ir.Value | None) -> bool:
    if value is None:
        return True
    if value.type is not None and not isinstance(value.type, ir.TensorType):
        return True  # sequences and optionals are judged by the backends, not here
    shape = value.shape if value.shape is not None else (
        value.const_value.shape if value.const_value is not None else None)
    return shape is not None and shape.is_static()


def data_dependent_nodes(model: ir.Model) -> list[ir.Node]:
    """Main-graph nodes with static tensor inputs and a non-static tensor output."""
    found = []
    for node in model.graph:
        if all(_static(v) for v in node.inputs) and not all(_static(v) for v in node.outputs):
            found.append(node)
    return found


def data_dependent_refusal(model: ir.Model) -> UnsupportedOpError | None:
    """An :class:`UnsupportedOpError` naming the data-dependent nodes, or None when there are none."""
    nodes = data_dependent_nodes(model)
    if not nodes:
        return None
    ops = [(n.name or "<unnamed>", n.op_type) for n in nodes]
    listing = ", ".join(f"{name} ({op})" for name, op in ops[:8]) + (f" and {len(ops) - 8} more" if len(ops) > 8 else "")
    return UnsupportedOpError(
        f"graph {model.graph.name!r}: {len(ops)} node(s) make a shape that depends on input values: {listing}; "
        "the project compiles static shapes only (bind the values that decide the shape, e.g. with --const, "
        "or run the model with ONNX Runtime)", ops)
