"""Fuse a Conv/MatMul/Gemm with its bias Add and its activation into one fused group.

No new operator is invented: the nodes stay standard ONNX and are annotated as one fused group
(:mod:`passes.fusion_groups`, prefix ``bias_act``), which a backend compiles as one kernel and
the partitioner places as one unit.

Rules:

1. Anchor: a ``Conv``, ``MatMul`` or ``Gemm`` node of the main graph.
2. Bias: when the anchor's output is read only by an ``Add`` (and is not a graph output) whose
   other operand is a constant that does not grow the output by broadcasting, that ``Add``
   joins. ``MatMul(A, B) + c`` with ``A`` and ``B`` of rank 2, ``B`` constant and ``c`` a
   constant of shape ``(N,)`` or ``(1, N)`` becomes ``Gemm(A, B, c)`` first (one standard op;
   its output takes the ``Add``'s output and name).
3. Activation: when the current tail's output is read only by one activation (``Relu``,
   ``Clip``, ``Sigmoid``, ``Tanh``, ``Gelu``, ``LeakyRelu``, ``HardSigmoid``, ``Elu``,
   ``Softplus``) whose other inputs (Clip's bounds) are constants, it joins. When instead every
   reader of the tail's output belongs to one fused group made by ``recognize_gelu`` (a
   decomposed GELU below opset 20), that whole group joins.
4. A group is made only when it has at least two nodes and the merged set is closed
   (:func:`passes.fusion_groups.is_closed`); a lone MatMul+Add rewritten to Gemm is simply one node.

Before/After (2-D MatMul with constant bias, then Relu)::

    a -> MatMul(B) -> Add(c) -> Relu -> y
    a -> Gemm(B, c) -> Relu -> y          (Gemm, Relu annotated fusion_group = "bias_act<k>")

Invariant: the values the graph computes are unchanged up to float rounding; graph inputs and
outputs keep their names.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from partitioner.core.op_classes import CONTRACTIONS, FUSABLE_ACTIVATIONS
from passes.fusion_groups import assign_group, group_of, groups, is_closed
from passes.registry import register
from passes.values import const_array

ANCHORS, ACTIVATIONS = CONTRACTIONS, FUSABLE_ACTIVATIONS


def _static_dims(value: ir.Value) -> tuple[int, ...] | None:
    if value.shape is None or not value.shape.is_static():
        return None
    return tuple(int(d) for d in value.shape)  # type: ignore[arg-type]


def _sole_reader(value: ir.Value) -> ir.Node | None:
    if value.is_graph_output() or len(value.uses()) != 1:
        return None
    return next(iter(value.uses())).node


def _bias_add(out: ir.Value) -> tuple[ir.Node, np.ndarray] | None:
    add = _sole_reader(out)
    if add is None or add.op_type != "Add" or add.domain != "" or len(add.inputs) != 2:
        return None
    other = add.inputs[1] if add.inputs[0] is out else add.inputs[0]
    if other is out:
        return None
    bias = const_array(other)
    dims = _static_dims(out)
    if bias is None or dims is None:
        return None
    try:
        if np.broadcast_shapes(dims, bias.shape) != dims:
            return None
    except ValueError:
        return None
    return add, bias


def _to_gemm(graph: ir.Graph, matmul: ir.Node, add: ir.Node, bias: np.ndarray) -> ir.Node | None:
    """Rule 2's MatMul + Add -> Gemm, or None when it does not apply."""
    a, b = matmul.inputs
    if a is None or b is None or a.shape is None or len(a.shape) != 2 or const_array(b) is None:
        return None
    wb = const_array(b)
    assert wb is not None
    if wb.ndim != 2 or bias.shape not in ((wb.shape[1],), (1, wb.shape[1])):
        return None
    c = add.inputs[1] if add.inputs[0] is matmul.outputs[0] else add.inputs[0]
    gemm = ir.Node("", "Gemm", [a, b, c], name=f"{matmul.name or 'matmul'}.gemm")
    old = add.outputs[0]
    new = gemm.outputs[0]
    new.type, new.shape = old.type, old.shape
    name = old.name
    new.name = f"{name}.gemm"
    graph.insert_after(add, gemm)
    ir.convenience.replace_all_uses_with(old, new, replace_graph_outputs=True)
    graph.remove([matmul, add], safe=True)
    new.name = name  # the Add's output name is free now: keep the graph's value names stable
    return gemm


def _activation(out: ir.Value) -> ir.Node | None:
    node = _sole_reader(out)
    if node is None or node.op_type not in ACTIVATIONS or node.domain != "" or node.inputs[0] is not out:
        return None
    if any(const_array(v) is None for v in node.inputs[1:] if v is not None):
        return None
    return node


def _gelu_group(graph: ir.Graph, out: ir.Value) -> list[ir.Node] | None:
    if out.is_graph_output() or not out.uses():
        return None
    gids = {group_of(u.node) for u in out.uses()}
    if len(gids) != 1:
        return None
    (gid,) = gids
    if gid is None or not gid.startswith("gelu"):
        return None
    return groups(graph)[gid]


def _fuse_from(graph: ir.Graph, anchor: ir.Node) -> bool:
    changed = False
    members = [anchor]
    tail = anchor.outputs[0]
    found = _bias_add(tail)
    if found is not None:
        add, bias = found
        if anchor.op_type == "MatMul":
            gemm = _to_gemm(graph, anchor, add, bias)
            if gemm is not None:
                members, changed = [gemm], True
            else:
                members.append(add)
        else:
            members.append(add)
        tail = members[-1].outputs[0]
    act = _activation(tail)
    if act is not None:
        members.append(act)
    else:
        gelu = _gelu_group(graph, tail)
        if gelu is not None:
            members.extend(gelu)
    if len(members) < 2:
        return changed
    current = {group_of(n) for n in members}
    if len(current) == 1 and None not in current:
        return changed  # already one group
    closed = set(members)
    for gid in current - {None}:
        closed.update(groups(graph)[gid])
    if not is_closed(closed):
        return changed
    assign_group(graph, members, "bias_act")
    return True


@register("fuse_bias_activation")
class FuseBiasActivation(ir.passes.InPlacePass):
    """Group Conv/MatMul/Gemm + constant bias Add + activation; 2-D MatMul + Add becomes Gemm."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        changed = 0
        for node in list(graph):
            if node.graph is graph and node.op_type in ANCHORS and node.domain == "" and node.outputs:
                changed += _fuse_from(graph, node)
        return ir.passes.PassResult(model, modified=bool(changed))
