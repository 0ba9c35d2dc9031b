"""Fused groups: sets of nodes that a backend compiles, and a partitioner places, as one unit.

A fused group is recorded on each member node as ``node.metadata_props[FUSION_GROUP_KEY] =
"<group id>"``. The nodes stay ordinary standard ONNX nodes (no invented fused operators), so a
model with groups is still valid ONNX and runs anywhere; the annotation only says "keep these
together". It survives ``ir.serde`` round trips (``NodeProto.metadata_props``).

Rules:

1. A group id is a non-empty string, unique within its graph; :func:`new_group_id` makes one.
2. :func:`assign_group` puts nodes in a group. When one of them already belongs to a group, the
   whole old group joins the new one (groups merge, they never overlap).
3. A group is *closed*: every output of a member that is read outside the group, or is a graph
   output, belongs to a member that no other member reads, except the group's *sink*. Passes
   only build groups for which :func:`is_closed` holds (chains with single-consumer links, and
   their merges), so no path leaves a group and comes back into it: contracting a group to one
   vertex keeps the graph acyclic.
4. :func:`fusion_units` is what partitioning strategies call: the graph's nodes in topological
   order, cut into units; a group is one unit (placed where its first member is in the order),
   every other node is a unit of its own. A plan must never cut inside a unit.

Invariant: annotations never change what the graph computes.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable

import onnx_ir as ir

from partitioner.core.errors import VerifyError

FUSION_GROUP_KEY = "partitioner.fusion_group"


def group_of(node: ir.Node) -> str | None:
    """The id of the fused group ``node`` belongs to, or ``None``."""
    return node.metadata_props.get(FUSION_GROUP_KEY) or None


def groups(graph: ir.Graph) -> dict[str, list[ir.Node]]:
    """Group id -> member nodes (in graph order), for every fused group of ``graph``."""
    found: dict[str, list[ir.Node]] = {}
    for node in graph:
        gid = group_of(node)
        if gid is not None:
            found.setdefault(gid, []).append(node)
    return found


def new_group_id(graph: ir.Graph, prefix: str) -> str:
    """A group id ``<prefix><n>`` not yet used in ``graph`` (rule 1)."""
    used = {group_of(n) for n in graph}
    n = 0
    while f"{prefix}{n}" in used:
        n += 1
    return f"{prefix}{n}"


def assign_group(graph: ir.Graph, nodes: Iterable[ir.Node], prefix: str) -> str:
    """Put ``nodes`` (and every group one of them is already in) into one new group; return its id."""
    members = list(nodes)
    old = {gid for gid in (group_of(n) for n in members) if gid is not None}
    if old:
        for gid, group_members in groups(graph).items():
            if gid in old:
                members.extend(group_members)
    gid = new_group_id(graph, prefix)
    for node in members:
        node.metadata_props[FUSION_GROUP_KEY] = gid
    return gid


def is_closed(nodes: Iterable[ir.Node]) -> bool:
    """Rule 3: at most one member (the sink) has outputs read outside the set or by the graph."""
    members = set(nodes)
    exits = 0
    for node in members:
        leaves = False
        for out in node.outputs:
            if out.is_graph_output() or any(use.node not in members for use in out.uses()):
                leaves = True
        if leaves:
            exits += 1
            if any(use.node in members for out in node.outputs for use in out.uses()):
                return False  # a member both feeds the group and leaves it: not a sink
    return exits <= 1


def fusion_units(graph: ir.Graph) -> list[list[ir.Node]]:
    """Rule 4: the nodes of ``graph`` as units in a topological order; a fused group is one unit.

    Each unit lists its nodes in graph order. Units are ordered topologically on the graph where
    every group is contracted to one vertex, ties broken by the position of the unit's first
    node (so with no groups this is the graph's own order).
    """
    nodes = list(graph)
    position = {node: i for i, node in enumerate(nodes)}
    units: list[list[ir.Node]] = []
    unit_of: dict[ir.Node, int] = {}
    by_group: dict[str, int] = {}
    for node in nodes:
        gid = group_of(node)
        if gid is not None and gid in by_group:
            units[by_group[gid]].append(node)
        else:
            units.append([node])
            if gid is not None:
                by_group[gid] = len(units) - 1
        unit_of[node] = by_group[gid] if gid is not None else len(units) - 1
    preds: list[set[int]] = [set() for _ in units]
    for node in nodes:
        for value in node.inputs:
            producer = value.producer() if value is not None else None
            if producer is not None and producer in unit_of and unit_of[producer] != unit_of[node]:
                preds[unit_of[node]].add(unit_of[producer])
    succs: list[list[int]] = [[] for _ in units]
    for u, ps in enumerate(preds):
        for p in ps:
            succs[p].append(u)
    waiting = [len(ps) for ps in preds]
    ready = [(position[units[u][0]], u) for u in range(len(units)) if waiting[u] == 0]
    heapq.heapify(ready)
    order: list[list[ir.Node]] = []
    while ready:
        _, u = heapq.heappop(ready)
        order.append(units[u])
        for s in succs[u]:
            waiting[s] -= 1
            if waiting[s] == 0:
                heapq.heappush(ready, (position[units[s][0]], s))
    if len(order) != len(units):
        stuck = next(units[u][0] for u in range(len(units)) if waiting[u] > 0)
        raise VerifyError(
            f"fused group '{group_of(stuck)}' is not closed: contracting it makes a cycle; "
            "rerun the fusion passes or clear the group annotations"
        )
    return order
