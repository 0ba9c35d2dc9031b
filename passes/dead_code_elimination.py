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
4. Trailing outputs that the op's schema marks optional (Dropout's mask, MaxPool's Indices,
   LayerNormalization's Mean/InvStdDev, ...) are dropped when nothing reads them: shape
   inference never types them, and every later stage needs a type and shape for each value.
   The node is rebuilt with fewer outputs; the kept outputs keep their names, types and uses.

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


def _optional_tail(node: ir.Node, opset: int) -> int:
    """How many trailing outputs of ``node`` are optional per its schema (0 when unknown)."""
    import onnx

    if node.domain not in ("", "ai.onnx") or not node.outputs:
        return 0
    try:
        schema = onnx.defs.get_schema(node.op_type, opset, "")
    except Exception:  # unknown op or version: leave the node alone
        return 0
    optional = onnx.defs.OpSchema.FormalParameterOption.Optional
    tail = 0
    for formal in reversed(schema.outputs[: len(node.outputs)]):
        if formal.option != optional:
            break
        tail += 1
    return tail


def _trim_unused_optional_outputs(graph: ir.Graph, opset: int) -> int:
    graph_outputs = frozenset(graph.outputs)
    trimmed = 0
    for node in list(graph):
        if is_side_effecting(node):
            continue
        tail = _optional_tail(node, node.version or opset)
        keep = len(node.outputs)
        while tail and keep > 1:
            out = node.outputs[keep - 1]
            if out.uses() or out in graph_outputs:
                break
            keep, tail = keep - 1, tail - 1
        if keep == len(node.outputs):
            continue
        new = ir.Node(node.domain, node.op_type, list(node.inputs), attributes=list(node.attributes.values()),
                      num_outputs=keep, name=node.name, version=node.version)
        graph.insert_before(node, new)
        for old_v, new_v in zip(node.outputs[:keep], new.outputs):
            name, shape, type_ = old_v.name, old_v.shape, old_v.type
            ir.convenience.replace_all_uses_with(old_v, new_v)
            old_v.name = f"{name}__trimmed"
            new_v.name, new_v.shape, new_v.type = name, shape, type_
        graph.remove(node, safe=True)
        trimmed += 1
    return trimmed


@register("dead_code_elimination")
class DeadCodeElimination(ir.passes.InPlacePass):
    """Remove unused nodes and initializers; keep comm ops and zero-output nodes."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        removed = _sweep(model.graph)
        removed += _trim_unused_optional_outputs(model.graph, model.opset_imports.get("", 1))
        graph_inputs = frozenset(model.graph.inputs)
        graph_outputs = frozenset(model.graph.outputs)
        for name, init in list(model.graph.initializers.items()):
            if not init.uses() and init not in graph_inputs and init not in graph_outputs:
                del model.graph.initializers[name]
                removed += 1
        for function in model.functions.values():
            removed += _sweep(function)
        return ir.passes.PassResult(model, modified=bool(removed))
