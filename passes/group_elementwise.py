"""Group chains of elementwise operators into fused groups.

Rules:

1. A node is *eligible* when it is in the default domain, is not yet in a fused group, and is
   elementwise: a unary op of :data:`UNARY` (extra inputs, like Clip's bounds, constant), or a
   binary op of :data:`BINARY` whose every input is a constant or has the same static shape as
   its output (no input is broadcast up, so one loop over the output covers the node).
2. A *link* joins eligible ``u`` to eligible ``v`` when ``u``'s only output is read by ``v`` alone
   (once or twice) and is not a graph output.
3. Each connected set of links with at least two nodes becomes one fused group (prefix
   ``elementwise``). Because every link is the producer's only use, the set is an in-tree whose
   root is the only node read from outside: the group is closed.

Invariant: no node, value or edge changes; only annotations are added.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from partitioner.core.op_classes import FUSABLE_BINARY, FUSABLE_UNARY
from passes.fusion_groups import assign_group, group_of
from passes.registry import register

UNARY, BINARY = FUSABLE_UNARY, FUSABLE_BINARY


def _is_const(value: ir.Value) -> bool:
    return not value.is_graph_input() and ir.convenience.get_const_tensor(value) is not None


def _same_static_shape(a: ir.Value, b: ir.Value) -> bool:
    if a.shape is None or b.shape is None or not a.shape.is_static():
        return False
    return tuple(a.shape) == tuple(b.shape)


def is_elementwise(node: ir.Node) -> bool:
    """Rule 1 without the group condition."""
    if node.domain != "" or len(node.outputs) != 1 or not node.inputs or node.inputs[0] is None:
        return False
    out = node.outputs[0]
    if node.op_type in UNARY:
        return all(v is None or _is_const(v) for v in node.inputs[1:])
    if node.op_type in BINARY:
        for v in node.inputs:
            if v is None:
                return False
            if _is_const(v):
                tensor = ir.convenience.get_const_tensor(v)
                assert tensor is not None
                if out.shape is None or not out.shape.is_static():
                    return False
                dims = tuple(int(d) for d in out.shape)  # type: ignore[arg-type]
                try:
                    if np.broadcast_shapes(dims, tuple(tensor.shape)) != dims:
                        return False
                except ValueError:
                    return False
            elif not _same_static_shape(v, out):
                return False
        return True
    return False


@register("group_elementwise")
class GroupElementwise(ir.passes.InPlacePass):
    """Annotate single-consumer chains (in-trees) of elementwise ops as fused groups."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        eligible = {n for n in graph if group_of(n) is None and is_elementwise(n)}
        parent: dict[ir.Node, ir.Node] = {}

        def find(n: ir.Node) -> ir.Node:
            while parent.get(n, n) is not n:
                n = parent[n]
            return n

        for node in graph:
            if node not in eligible:
                continue
            out = node.outputs[0]
            readers = {u.node for u in out.uses()}
            if out.is_graph_output() or len(readers) != 1:
                continue
            (reader,) = readers
            if reader in eligible:
                parent[find(node)] = find(reader)
        components: dict[ir.Node, list[ir.Node]] = {}
        for node in graph:
            if node in eligible:
                components.setdefault(find(node), []).append(node)
        made = 0
        for members in components.values():
            if len(members) >= 2:
                assign_group(graph, members, "elementwise")
                made += 1
        return ir.passes.PassResult(model, modified=bool(made))
