"""Recognise the decomposed exact GELU, ``x * 0.5 * (1 + erf(x / sqrt(2)))``, as one ``Gelu``.

Rules:

1. The anchor is an ``Erf`` node of the main graph. Its input is ``Div(x, c)`` with ``c`` a
   constant equal to sqrt(2), or ``Mul(x, c)`` / ``Mul(c, x)`` with ``c`` equal to 1/sqrt(2)
   (relative tolerance 1e-4, so 1.4142 and 0.7071 match). Its output goes to exactly one
   ``Add(erf, 1)`` (either operand order).
2. The rest is one of three shapes, with ``a = 1 + erf(...)`` and operands in either order::

       (A) Mul(Mul(x, a), 0.5)      (B) Mul(x, Mul(a, 0.5))      (C) Mul(Mul(x, 0.5), a)

   Constants are scalars (or tensors of one element). Every value between the first and the
   last matched node is read by matched nodes only and is not a graph output; ``x`` itself may
   have other readers.
3. When the model imports the default ONNX opset >= 20 (``Gelu`` exists there), the matched
   nodes are replaced by ``Gelu(x)`` (``approximate="none"``), whose output takes the last
   node's output (and its name when it is a graph output). Below opset 20 the nodes are left
   as they are and annotated as one fused group (:mod:`passes.fusion_groups`, prefix
   ``gelu``), so a backend and the partitioner still treat them as one unit.

Invariant: the values the graph computes are unchanged up to float rounding; graph inputs and
outputs keep their names. Constants left unused are for dead-code elimination.
"""

from __future__ import annotations

import math

import onnx_ir as ir

from passes.fusion_groups import assign_group, group_of, is_closed
from passes.registry import register
from passes.values import scalar_const

GELU_MIN_OPSET = 20
_RTOL = 1e-4


def _close(value: float | None, target: float) -> bool:
    return value is not None and math.isclose(value, target, rel_tol=_RTOL)


def _other(node: ir.Node, value: ir.Value) -> ir.Value | None:
    """The other input of a two-input node that reads ``value`` once."""
    a, b = node.inputs[0], node.inputs[1]
    if a is value and b is not value:
        return b
    if b is value and a is not value:
        return a
    return None


def _only_reader(value: ir.Value, op_type: str) -> ir.Node | None:
    if value.is_graph_output() or len(value.uses()) != 1:
        return None
    node = next(iter(value.uses())).node
    return node if node.op_type == op_type and node.domain == "" and len(node.inputs) == 2 else None


def match_gelu(erf: ir.Node) -> tuple[ir.Value, list[ir.Node]] | None:
    """``(x, matched nodes in graph order)`` for a GELU anchored at ``erf`` (rules 1, 2), or None."""
    if erf.op_type != "Erf" or erf.domain != "" or erf.inputs[0] is None:
        return None
    scaled = erf.inputs[0]
    scale = scaled.producer()
    if scale is None or scale.domain != "" or len(scale.inputs) != 2 or len(scaled.uses()) != 1:
        return None
    if scaled.is_graph_output():
        return None
    if scale.op_type == "Div" and _close(scalar_const(scale.inputs[1]), math.sqrt(2.0)):
        x = scale.inputs[0]
    elif scale.op_type == "Mul" and _close(scalar_const(scale.inputs[1]), 1 / math.sqrt(2.0)):
        x = scale.inputs[0]
    elif scale.op_type == "Mul" and _close(scalar_const(scale.inputs[0]), 1 / math.sqrt(2.0)):
        x = scale.inputs[1]
    else:
        return None
    if x is None:
        return None
    add = _only_reader(erf.outputs[0], "Add")
    if add is None or not _close(scalar_const(_other(add, erf.outputs[0])), 1.0):
        return None
    a = add.outputs[0]
    m1 = _only_reader(a, "Mul")
    if m1 is None:
        return None
    partner = _other(m1, a)
    if partner is None:
        return None
    nodes = [scale, erf, add, m1]
    if partner is x:  # (A)
        m2 = _only_reader(m1.outputs[0], "Mul")
        if m2 is None or not _close(scalar_const(_other(m2, m1.outputs[0])), 0.5):
            return None
        nodes.append(m2)
    elif _close(scalar_const(partner), 0.5):  # (B)
        m2 = _only_reader(m1.outputs[0], "Mul")
        if m2 is None or _other(m2, m1.outputs[0]) is not x:
            return None
        nodes.append(m2)
    else:  # (C): partner = Mul(x, 0.5), read only by m1
        half = partner.producer()
        if half is None or half.op_type != "Mul" or half.domain != "" or len(half.inputs) != 2:
            return None
        if partner.is_graph_output() or len(partner.uses()) != 1:
            return None
        if _other(half, x) is None or not _close(scalar_const(_other(half, x)), 0.5):
            return None
        nodes.insert(0, half)
    return x, nodes


def _replace_with_gelu(graph: ir.Graph, x: ir.Value, nodes: list[ir.Node]) -> None:
    last = nodes[-1]
    old = last.outputs[0]
    gelu = ir.Node("", "Gelu", [x], [ir.Attr("approximate", ir.AttributeType.STRING, "none")],
                   name=f"{last.name}.gelu" if last.name else None)
    new = gelu.outputs[0]
    new.type, new.shape = old.type, old.shape
    graph.insert_after(last, gelu)
    name, was_output = old.name, old.is_graph_output()
    new.name = f"{name}.gelu" if name else None
    ir.convenience.replace_all_uses_with(old, new, replace_graph_outputs=True)
    graph.remove(nodes, safe=True)
    if was_output:
        new.name = name


def _default_opset(model: ir.Model) -> int:
    return model.opset_imports.get("", model.opset_imports.get("ai.onnx", 1))


@register("recognize_gelu")
class RecognizeGelu(ir.passes.InPlacePass):
    """Replace decomposed exact GELU by ``Gelu`` (opset >= 20), or group it (older opsets)."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        use_op = _default_opset(model) >= GELU_MIN_OPSET
        changed = 0
        for node in list(graph):
            if node.graph is not graph:
                continue
            found = match_gelu(node)
            if found is None:
                continue
            x, nodes = found
            if use_op:
                _replace_with_gelu(graph, x, nodes)
                changed += 1
            else:
                current = {group_of(n) for n in nodes}
                if (len(current) > 1 or None in current) and is_closed(nodes):
                    assign_group(graph, nodes, "gelu")
                    changed += 1
        return ir.passes.PassResult(model, modified=bool(changed))
