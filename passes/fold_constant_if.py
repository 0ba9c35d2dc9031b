"""Fold ``If`` nodes whose condition is a constant: inline the branch that is taken.

Why: models branch on an input scalar (a sample rate, a flag) or on a shape test; once the user
binds that input (``--const sr=16000``) or the shapes are static, the condition folds to a
constant and only one branch can ever run. Inlining it leaves a flat graph that shape inference
makes static and every backend can partition; the untaken branch, often with a shape that does
not match, disappears.

Rules:

1. An ``If`` of the main graph whose ``cond`` is an initializer (not a graph input) holding one
   element is folded: ``then_branch`` when that element is true, else ``else_branch``.
2. The taken branch's nodes move, in order, into the main graph just before the ``If``; its
   initializers become main-graph initializers. Values of the branch whose names clash with a
   main-graph name get a fresh ``__if<k>`` suffix (subgraph names are usually unique model-wide,
   but ONNX does not require it of values in sibling scopes).
3. Each ``If`` output is replaced by the matching branch output in every use. When the ``If``
   output is a graph output, the graph keeps its output name: the branch value takes that name,
   or an ``Identity`` forwards it when the branch output is an outer value or is returned twice.
4. The ``If`` is removed. Nested ``If`` nodes that land in the main graph fold on the next
   application (``fold_shape_subgraphs`` repeats this pass to a fixed point).

Invariant: for the bound constant, the graph computes the same outputs under the same names.
"""

from __future__ import annotations

import onnx_ir as ir

from passes.registry import register


def _constant_condition(node: ir.Node) -> bool | None:
    cond = node.inputs[0] if node.inputs else None
    if cond is None or cond.const_value is None or cond.is_graph_input():
        return None
    array = cond.const_value.numpy()
    if array.size != 1:
        return None
    return bool(array.reshape(()))


def _all_names(model: ir.Model) -> set[str]:
    names: set[str] = set()
    for graph in model.graphs():
        names.update(v.name for v in graph.inputs if v.name)
        names.update(graph.initializers)
        for node in graph:
            names.update(o.name for o in node.outputs if o.name)
    return names


def inline_if(model: ir.Model, node: ir.Node, taken: bool, counter: int) -> None:
    """Rules 2-4 for one ``If`` of the main graph."""
    graph = model.graph
    branch = node.attributes["then_branch" if taken else "else_branch"].as_graph()
    branch_nodes = list(branch)
    moved = set(branch_nodes)
    outer_names = _all_names(model) - {o.name for n in branch_nodes for o in n.outputs if o.name} \
        - set(branch.initializers)
    for name, init in list(branch.initializers.items()):
        branch.initializers.pop(name)
        if init.name in outer_names or init.name in graph.initializers:
            init.name = f"{init.name}__if{counter}"
        graph.register_initializer(init)
    for sub_node in branch_nodes:
        for out in sub_node.outputs:
            if out.name and out.name in outer_names:
                out.name = f"{out.name}__if{counter}"
    results = list(branch.outputs)
    branch.outputs.clear()
    for sub_node in branch_nodes:
        branch.remove(sub_node)
    graph.insert_before(node, branch_nodes)
    used_as_output: set[ir.Value] = set()
    for if_out, result in zip(node.outputs, results):
        if if_out.is_graph_output():
            own = result.producer() in moved and result not in used_as_output and not result.is_graph_output()
            if not own:
                identity = ir.node("Identity", [result], num_outputs=1)
                graph.insert_before(node, identity)
                result = identity.outputs[0]
            used_as_output.add(result)
            name = if_out.name
            ir.convenience.replace_all_uses_with(if_out, result, replace_graph_outputs=True)
            if_out.name = f"{name}__if_removed"
            result.name = name
            result.shape = result.shape if result.shape is not None else if_out.shape
            result.type = result.type if result.type is not None else if_out.type
        else:
            ir.convenience.replace_all_uses_with(if_out, result)
    graph.remove(node, safe=True)


@register("fold_constant_if")
class FoldConstantIf(ir.passes.InPlacePass):
    """Inline the taken branch of every main-graph ``If`` whose condition is constant."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        folded = 0
        for node in list(model.graph):
            if node.op_type != "If" or node.domain not in ("", "ai.onnx"):
                continue
            taken = _constant_condition(node)
            if taken is None:
                continue
            inline_if(model, node, taken, folded)
            folded += 1
        return ir.passes.PassResult(model, bool(folded))
