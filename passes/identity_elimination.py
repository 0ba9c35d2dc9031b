"""Identity elimination: onnx-ir's ``IdentityEliminationPass``, registered by name.

Rules (onnx-ir's):

1. ``y = Identity(x)`` with ``y`` not a graph output: every use of ``y`` reads ``x``; the node goes.
2. ``y`` a graph output and ``x`` an intermediate value: ``x`` takes ``y``'s name and becomes
   the graph output; the node goes.
3. ``y`` a graph output and ``x`` a graph input or initializer: the node stays (the graph's
   signature keeps both names).
4. ``y`` a graph output and ``x`` a graph output too: the node stays. onnx-ir renames ``x`` to
   ``y``, which leaves the graph with two outputs named ``y`` and loses ``x`` (found by the
   pipeline property test: ``v2 = Identity(v0)`` with outputs ``(v0, v2)``).
5. ``y`` an output of a subgraph and ``x`` not produced inside that subgraph (an outer value):
   the node stays. ONNX Runtime refuses a subgraph output that is an outer-scope value returned
   directly (openwakeword's verifier ``If`` has ``else: p1 = Identity(p1.1)``).

Invariant: the model's inputs and outputs keep their names; the values computed are unchanged.
"""

from __future__ import annotations

import onnx_ir as ir
from onnx_ir.passes.common import IdentityEliminationPass

from passes.registry import register


def _outer_value(value: ir.Value, graph: ir.Graph) -> bool:
    """``value`` belongs to an enclosing scope of ``graph`` (only a subgraph has one)."""
    producer = value.producer()
    if producer is not None:
        return producer.graph is not graph
    return value not in list(graph.inputs) and graph.initializers.get(value.name or "") is not value


@register("identity_elimination")
class IdentityElimination(IdentityEliminationPass):
    """Remove ``Identity`` nodes that do not hold the graph's signature together."""

    def _try_eliminate_identity_node(self, node: ir.Node) -> bool:
        if (node.op_type == "Identity" and node.domain == "" and len(node.inputs) == 1 and len(node.outputs) == 1
                and node.inputs[0] is not None and node.outputs[0].is_graph_output()
                and node.inputs[0].is_graph_output()):
            return False  # rule 4
        if (node.op_type == "Identity" and node.domain == "" and len(node.inputs) == 1 and node.inputs[0] is not None
                and node.outputs[0].is_graph_output() and node.graph is not None
                and _outer_value(node.inputs[0], node.graph)):
            return False  # rule 5
        return super()._try_eliminate_identity_node(node)
