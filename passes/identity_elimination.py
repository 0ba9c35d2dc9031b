"""Identity elimination: onnx-ir's ``IdentityEliminationPass``, registered by name.

Rules (onnx-ir's):

1. ``y = Identity(x)`` with ``y`` not a graph output: every use of ``y`` reads ``x``; the node goes.
2. ``y`` a graph output and ``x`` an intermediate value: ``x`` takes ``y``'s name and becomes
   the graph output; the node goes.
3. ``y`` a graph output and ``x`` a graph input or initializer: the node stays (the graph's
   signature keeps both names).

Invariant: the model's inputs and outputs keep their names; the values computed are unchanged.
"""

from __future__ import annotations

from onnx_ir.passes.common import IdentityEliminationPass

from passes.registry import register


@register("identity_elimination")
class IdentityElimination(IdentityEliminationPass):
    """Remove ``Identity`` nodes that do not hold the graph's signature together."""
