"""Topological sort: onnx-ir's ``TopologicalSortPass``, registered by name.

Rules:

1. Nodes of the main graph, of every subgraph and of every function are reordered so that every
   producer comes before its consumers.
2. The sort is stable: nodes with no dependency between them keep their relative order (so
   the order of communication operators, which carries meaning across ranks, is kept where
   the data flow allows it).

Invariant: the set of nodes and edges is unchanged; only their order changes.
"""

from __future__ import annotations

from onnx_ir.passes.common import TopologicalSortPass

from passes.registry import register


@register("topological_sort")
class TopologicalSort(TopologicalSortPass):
    """Stable topological sort of every graph and function in the model."""
