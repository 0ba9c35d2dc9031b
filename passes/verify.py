"""The graph invariants every pass keeps, written as one checkable spec.

Rules, checked in one walk over the nodes in their stored order:

1. Every node's domain is imported by the model (``opset_imports``); a node in the
   ``partitioner.comm`` domain is one of the known communication operators (they are legal and
   side-effecting; ``Send`` has no outputs, the others have at least one).
2. SSA: every value is defined once (graph input, initializer, or one output of one node), and
   every named value has a name no other value in the graph has. An output's ``producer()`` is
   the node that lists it.
3. Topological order and no dangling inputs: every input of a node is a graph input, an
   initializer, an outer-scope value (in subgraphs), or an output of an *earlier* node.
4. Use-def consistency: a node reading value ``v`` at input ``i`` appears as ``(node, i)`` in
   ``v.uses()``, and every entry of ``v.uses()`` is a node of this graph that really reads ``v``
   there.
5. Every graph output is defined.
6. With ``require_shapes``: every value of the main graph (inputs, initializers, node outputs)
   has a known dtype and a fully static shape. Node outputs that nothing reads (a ``Dropout``
   mask) and subgraph values are not held to this.

Each failure raises :class:`partitioner.core.errors.VerifyError` with one line naming the node or
value and what is wrong.
"""

from __future__ import annotations

from collections.abc import Iterable

import onnx_ir as ir

from partitioner.core.errors import VerifyError
from passes.side_effects import COMM_DOMAIN, COMM_OP_TYPES

_ONNX_DOMAINS = ("", "ai.onnx")


def describe_node(node: ir.Node) -> str:
    """A short, readable name for a node in messages: ``'name' (OpType)``."""
    op = f"{node.domain}::{node.op_type}" if node.domain not in _ONNX_DOMAINS else node.op_type
    return f"node '{node.name or '<unnamed>'}' ({op})"


def _describe_value(value: ir.Value) -> str:
    return f"value '{value.name}'"


def verify(model: ir.Model, *, require_shapes: bool = True) -> None:
    """Check the invariants listed in the module docstring; raise VerifyError on the first break."""
    opsets = dict(model.opset_imports)
    _verify_graph(model.graph, outer=frozenset(), opsets=opsets, require_shapes=require_shapes)


def _check_domain(node: ir.Node, opsets: dict[str, int]) -> None:
    domain = node.domain
    if domain in _ONNX_DOMAINS:
        if not any(d in opsets for d in _ONNX_DOMAINS):
            raise VerifyError(f"{describe_node(node)}: the model imports no default ONNX opset")
    elif domain not in opsets:
        raise VerifyError(
            f"{describe_node(node)}: domain '{domain}' is not in the model's opset_imports; add it"
        )
    if domain == COMM_DOMAIN:
        if node.op_type not in COMM_OP_TYPES:
            raise VerifyError(
                f"{describe_node(node)}: unknown communication op; "
                f"known: {', '.join(sorted(COMM_OP_TYPES))}"
            )
        if node.op_type == "Send" and len(node.outputs) != 0:
            raise VerifyError(f"{describe_node(node)}: Send must have no outputs")
        if node.op_type != "Send" and len(node.outputs) == 0:
            raise VerifyError(f"{describe_node(node)}: {node.op_type} must have an output")


def _check_shape(value: ir.Value, where: str) -> None:
    dtype = value.dtype
    shape = value.shape
    if value.const_value is not None:
        # An initializer's tensor is the ground truth when the Value carries no annotation.
        dtype = dtype if dtype is not None else value.const_value.dtype
        shape = shape if shape is not None else value.const_value.shape
    if value.type is not None and not isinstance(value.type, ir.TensorType):
        return  # sequence / optional / sparse values carry no single static shape
    if dtype is None:
        raise VerifyError(f"{_describe_value(value)} ({where}) has no known dtype; run shape_inference")
    if shape is None:
        raise VerifyError(f"{_describe_value(value)} ({where}) has no known shape; run shape_inference")
    if not shape.is_static():
        raise VerifyError(
            f"{_describe_value(value)} ({where}) has a non-static shape {shape}; "
            "bind the input shapes (e.g. --batch) so every dimension is a number"
        )


def _verify_graph(
    graph: ir.Graph,
    *,
    outer: frozenset[ir.Value],
    opsets: dict[str, int],
    require_shapes: bool,
) -> None:
    nodes = list(graph)
    node_set = set(nodes)
    defined: set[ir.Value] = set()
    names: dict[str, ir.Value] = {}

    def define(value: ir.Value, where: str) -> None:
        if value in defined:
            raise VerifyError(f"{_describe_value(value)} is defined twice (again as {where}); SSA broken")
        defined.add(value)
        if value.name:
            other = names.get(value.name)
            if other is not None and other is not value:
                raise VerifyError(
                    f"two values are named '{value.name}' (second one: {where}); names must be unique"
                )
            names[value.name] = value

    for value in graph.inputs:
        define(value, "graph input")
    for name, value in graph.initializers.items():
        if value.name != name:
            raise VerifyError(f"initializer registered as '{name}' is named '{value.name}'")
        if value.producer() is not None:
            raise VerifyError(f"initializer '{name}' is also produced by {describe_node(value.producer())}")
        if value in defined:
            # IR < 4 lists initializers among the graph inputs: one value, two roles, legal.
            continue
        define(value, "initializer")

    # Values produced anywhere in this graph, to tell "later" (rule 3, order) from "nowhere".
    producer_of: dict[ir.Value, int] = {}
    for index, node in enumerate(nodes):
        for out in node.outputs:
            producer_of.setdefault(out, index)

    for index, node in enumerate(nodes):
        _check_domain(node, opsets)
        _check_inputs(node, nodes, defined, outer, producer_of)
        for attr in node.attributes.values():
            if isinstance(attr, ir.Attr) and attr.type == ir.AttributeType.GRAPH:
                _verify_subgraphs([attr.as_graph()], outer | defined, opsets)
            elif isinstance(attr, ir.Attr) and attr.type == ir.AttributeType.GRAPHS:
                _verify_subgraphs(attr.as_graphs(), outer | defined, opsets)
        for j, out in enumerate(node.outputs):
            if out.producer() is not node or out.index() != j:
                raise VerifyError(
                    f"{describe_node(node)} output {j} {_describe_value(out)} names another producer"
                )
            if not out.name:
                if out.uses() or out.is_graph_output():
                    raise VerifyError(f"{describe_node(node)} output {j} is used but has no name")
                continue  # an omitted optional output
            define(out, f"output {j} of {describe_node(node)}")

    _check_uses(graph, node_set, defined)

    for k, out in enumerate(graph.outputs):
        if out not in defined and out not in outer:
            raise VerifyError(
                f"graph output {k} {_describe_value(out)} is not produced by any node, input or initializer"
            )

    if require_shapes:
        _check_shapes(graph, nodes)


def _check_inputs(node: ir.Node, nodes: list[ir.Node], defined: set[ir.Value], outer: frozenset[ir.Value],
                  producer_of: dict[ir.Value, int]) -> None:
    """Rules 3 and 4 for one node's inputs: defined earlier (or outside), and listed as uses."""
    for i, inp in enumerate(node.inputs):
        if inp is None:
            continue
        if inp not in defined and inp not in outer:
            if inp in producer_of:
                later = nodes[producer_of[inp]]
                raise VerifyError(
                    f"{describe_node(node)} reads {_describe_value(inp)} before "
                    f"{describe_node(later)} produces it; graph is not topologically sorted"
                )
            raise VerifyError(
                f"{describe_node(node)} input {i} {_describe_value(inp)} is dangling: not produced by "
                "any node, graph input or initializer"
            )
        if (node, i) not in inp.uses():
            raise VerifyError(
                f"{describe_node(node)} reads {_describe_value(inp)} at input {i} but the value's "
                "uses do not list it; use-def links are broken"
            )


def _check_uses(graph: ir.Graph, node_set: set[ir.Node], defined: set[ir.Value]) -> None:
    """Every use a value lists is a node of the graph that reads that value there (rule 4)."""
    for value in defined:
        for use in value.uses():
            if use.node.graph is None or (use.node.graph is graph and use.node not in node_set):
                raise VerifyError(f"{_describe_value(value)} lists a use by a node that is not in the graph")
            if use.idx >= len(use.node.inputs) or use.node.inputs[use.idx] is not value:
                raise VerifyError(
                    f"{_describe_value(value)} lists a use by {describe_node(use.node)} at input "
                    f"{use.idx}, which reads something else; use-def links are broken"
                )


def _check_shapes(graph: ir.Graph, nodes: list[ir.Node]) -> None:
    """Rule 6: inputs, initializers and every output somebody reads have static shapes."""
    for value in graph.inputs:
        _check_shape(value, "graph input")
    for value in graph.initializers.values():
        _check_shape(value, "initializer")
    for node in nodes:
        for out in node.outputs:
            # An output nobody reads (a Dropout mask) may stay unshaped: nothing depends on it.
            if out.name and (out.uses() or out.is_graph_output()):
                _check_shape(out, f"output of {describe_node(node)}")


def _verify_subgraphs(graphs: Iterable[ir.Graph], outer: set[ir.Value], opsets: dict[str, int]) -> None:
    for sub in graphs:
        sub_opsets = {**opsets, **dict(sub.opset_imports)}
        _verify_graph(sub, outer=frozenset(outer), opsets=sub_opsets, require_shapes=False)
