"""Dead-code elimination that keeps side-effecting nodes.

onnx-ir's ``RemoveUnusedNodesPass`` removes every node none of whose outputs is used, which
would delete a ``Send`` (it has no outputs) and an ``AllReduce`` whose result this rank does not
read, and so deadlock the other ranks. This pass applies the same sweep with that exception.

Rules:

1. Walk each graph (and each subgraph) from the last node to the first. A node is live when
   it is side-effecting (domain ``partitioner.comm``, or no outputs), when one of its outputs
   is a graph output, or when one of its outputs still has a use. Other nodes are removed;
   removing one may make its producers dead, which the backward walk sees.
2. Initializers with no use that are neither graph inputs nor graph outputs are removed.
3. Nodes of model-local functions are swept the same way.

Invariant: the model's inputs and outputs are unchanged; every side-effecting node stays.
"""

from __future__ import annotations

import onnx_ir as ir

from passes.registry import register
from passes.side_effects import is_side_effecting


def _is_live(node: ir.Node, graph_outputs: frozenset[ir.Value]) -> bool:
    if is_side_effecting(node):
        return True
    return any(out in graph_outputs or out.uses() for out in node.outputs)


def _sweep(graph: ir.Graph | ir.Function) -> int:
    graph_outputs = frozenset(graph.outputs)
    removed = 0
    for node in reversed(list(graph)):
        if not _is_live(node, graph_outputs):
            graph.remove(node, safe=True)
            removed += 1
            continue
        for attr in node.attributes.values():
            if not isinstance(attr, ir.Attr):
                continue
            if attr.type == ir.AttributeType.GRAPH:
                removed += _sweep(attr.as_graph())
            elif attr.type == ir.AttributeType.GRAPHS:
                for sub in attr.as_graphs():
                    removed += _sweep(sub)
    return removed


@register("dead_code_elimination")
class DeadCodeElimination(ir.passes.InPlacePass):
    """Remove unused nodes and initializers; keep comm ops and zero-output nodes."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        removed = _sweep(model.graph)
        graph_inputs = frozenset(model.graph.inputs)
        graph_outputs = frozenset(model.graph.outputs)
        for name, init in list(model.graph.initializers.items()):
            if not init.uses() and init not in graph_inputs and init not in graph_outputs:
                del model.graph.initializers[name]
                removed += 1
        for function in model.functions.values():
            removed += _sweep(function)
        return ir.passes.PassResult(model, modified=bool(removed))
