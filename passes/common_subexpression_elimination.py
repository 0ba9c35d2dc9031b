"""Common subexpression elimination: onnx-ir's pass, guarded for side-effecting nodes.

Rules:

1. (onnx-ir) Two nodes with the same op, the same input values (by identity), the same
   attributes and the same number of outputs compute the same thing: the later one is removed
   and its uses read the earlier one's outputs. Graph outputs keep their names (an ``Identity``
   is inserted where needed). Nodes with subgraphs, random ops and Constant nodes with more than
   ``size_limit`` elements are not merged.
2. (guard) Side-effecting nodes (domain ``partitioner.comm``, or no outputs) are never merged:
   two identical ``AllReduce(x)`` are two collectives every other rank also takes part in;
   merging them on one rank would deadlock the others. onnx-ir's pass does not know this, so
   while it runs each such node carries a temporary attribute with a unique value, which makes
   it unequal to every other node; the attribute is removed afterwards.

Invariant: values computed are unchanged; every side-effecting node is still there.
"""

from __future__ import annotations

import onnx_ir as ir
from onnx_ir.passes.common import CommonSubexpressionEliminationPass

from passes.registry import register
from passes.side_effects import is_side_effecting

_GUARD_ATTRIBUTE = "__partitioner_cse_guard"


@register("common_subexpression_elimination")
class CommonSubexpressionElimination(CommonSubexpressionEliminationPass):
    """onnx-ir's CSE that leaves side-effecting nodes (comm ops, zero-output nodes) alone."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        guarded = [node for node in model.graph if is_side_effecting(node)]
        for k, node in enumerate(guarded):
            node.attributes[_GUARD_ATTRIBUTE] = ir.AttrInt64(_GUARD_ATTRIBUTE, k)
        try:
            return super().call(model)
        finally:
            for node in guarded:
                node.attributes.pop(_GUARD_ATTRIBUTE, None)
