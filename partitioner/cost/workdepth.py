"""Whole-graph statistics: work W, depth D, parameters and peak activation memory.

Rules:

1. W = Σ OpCost.work over the nodes (FLOPs for computing ops, elements touched for copies);
   D = the longest path through the node DAG where each node weighs its OpCost.depth
   (``networkx.dag_longest_path_length``); average parallelism = W/D (survey §2.5).
2. *Constant* values are initializers, outputs of ``Constant`` nodes, and outputs of nodes all of
   whose inputs are constant (for example the ``ConstantOfShape`` weights of onnx's light_* zoo
   models, before or after constant folding). Nodes that compute only constants cost nothing:
   a runtime folds them once at load time.
3. Parameters are the constant values that feed a non-constant node, excluding integer tensors of
   rank ≤ 1 (shapes, axes, indices). ``param_count`` is their element count and ``param_bytes``
   their size. So ConstantOfShape-made weights count as parameters; their int64 shape inputs do
   not.
4. Peak activation memory: walk the nodes in graph (topological) order; a non-constant value is
   live from its producer (graph inputs: from the start) until its last consumer (graph outputs:
   until the end). Views (Reshape/Flatten/Squeeze/Unsqueeze/Identity/Dropout) alias their input
   and extend its life instead of allocating. The peak of the live bytes is reported.
5. Only the top-level graph is analysed; subgraphs of If/Loop/Scan count via the fallback rule.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Any

import networkx as nx
import onnx_ir as ir

from partitioner.core.op_classes import COST_VIEWS
from partitioner.cost.ops import COMM_DOMAIN, ZERO, OpCost, itemsize, nbytes, numel, op_cost

_VIEW_OPS = COST_VIEWS


@dataclass(frozen=True)
class OpRecord:
    name: str
    op_type: str
    flops: float
    bytes: float
    depth: float

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "op_type": self.op_type, "flops": self.flops,
                "bytes": self.bytes, "depth": self.depth}


@dataclass(frozen=True)
class GraphStats:
    """Static statistics of one graph (rules in the module docstring)."""

    num_nodes: int
    op_histogram: dict[str, int]
    param_count: int
    param_bytes: float
    ops: tuple[OpRecord, ...]
    total_flops: float
    total_bytes: float
    work: float
    depth: float
    parallelism: float
    peak_activation_bytes: float

    def to_json(self, with_ops: bool = True) -> dict[str, Any]:
        out: dict[str, Any] = {
            "num_nodes": self.num_nodes,
            "op_histogram": dict(self.op_histogram),
            "param_count": self.param_count,
            "param_bytes": self.param_bytes,
            "total_flops": self.total_flops,
            "total_bytes": self.total_bytes,
            "work": self.work,
            "depth": self.depth,
            "parallelism": self.parallelism,
            "peak_activation_bytes": self.peak_activation_bytes,
        }
        if with_ops:
            out["ops"] = [o.to_json() for o in self.ops]
        return out


def constant_values(graph: ir.Graph) -> set[ir.Value]:
    """Values known before any input arrives (rule 2)."""
    const: set[ir.Value] = set(graph.initializers.values())
    for node in graph:
        if node.domain == COMM_DOMAIN:
            continue
        ins = [v for v in node.inputs if v is not None]
        if node.op_type == "Constant" or (ins and all(v in const for v in ins)):
            if node.op_type in ("RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike"):
                continue
            const.update(node.outputs)
    # A graph input with an initializer can be overridden by the caller but is still a weight.
    return const


def node_costs(graph: ir.Graph, const: set[ir.Value] | None = None) -> list[OpCost]:
    """op_cost of every node in order, with constant-only nodes costing nothing (rule 2)."""
    if const is None:
        const = constant_values(graph)
    costs = []
    for node in graph:
        outs = node.outputs
        if outs and all(v in const for v in outs):
            costs.append(ZERO)
        else:
            costs.append(op_cost(node))
    return costs


def parameter_values(graph: ir.Graph, const: set[ir.Value]) -> list[ir.Value]:
    """Constant values that feed non-constant nodes, minus small integer vectors (rule 3)."""
    params: dict[ir.Value, None] = {}
    for node in graph:
        if node.outputs and all(v in const for v in node.outputs):
            continue
        for v in node.inputs:
            if v is None or v not in const or v in params:
                continue
            shape = v.shape
            rank = len(shape) if shape is not None else 0
            if v.dtype is not None and v.dtype.is_integer() and rank <= 1:
                continue
            params[v] = None
    return list(params)


def peak_activation_bytes(graph: ir.Graph, const: set[ir.Value] | None = None, skip: Any = None) -> float:
    """Max live activation bytes over the topological order (rule 4). ``skip(node)`` true: the
    node is left out (its outputs are not counted, its reads end no lifetime)."""
    if const is None:
        const = constant_values(graph)
    nodes = [n for n in graph if skip is None or not skip(n)]
    end = len(nodes) + 1
    root: dict[ir.Value, ir.Value] = {}
    start: dict[ir.Value, int] = {}
    last: dict[ir.Value, int] = {}
    size: dict[ir.Value, float] = {}

    def owner(v: ir.Value) -> ir.Value:
        return root.get(v, v)

    for v in graph.inputs:
        if v not in const:
            start[v], last[v], size[v] = 0, 0, nbytes(v)
    for i, node in enumerate(nodes, start=1):
        for v in node.inputs:
            if v is not None and v not in const:
                r = owner(v)
                if r in last:
                    last[r] = max(last[r], i)
        if node.op_type in _VIEW_OPS and node.domain == "" and node.inputs and \
                node.inputs[0] is not None and node.inputs[0] not in const:
            root[node.outputs[0]] = owner(node.inputs[0])
            continue
        for v in node.outputs:
            if v not in const:
                start[v], last[v], size[v] = i, i, nbytes(v)
    for v in graph.outputs:
        r = owner(v)
        if r in last:
            last[r] = end
    delta = [0.0] * (end + 2)
    for v, s in start.items():
        delta[s] += size[v]
        delta[last[v] + 1] -= size[v]
    peak = cur = 0.0
    for d in delta:
        cur += d
        peak = max(peak, cur)
    return peak


def analyze(model: ir.Model | ir.Graph) -> GraphStats:
    """Work, depth, parameters and peak activations of a shape-inferred model (module rules)."""
    graph = model.graph if isinstance(model, ir.Model) else model
    nodes = list(graph)
    const = constant_values(graph)
    costs = node_costs(graph, const)
    hist = Counter(n.op_type for n in nodes)

    params = parameter_values(graph, const)
    param_count = sum(numel(v) for v in params)
    param_bytes = sum(numel(v) * itemsize(v) for v in params)

    index = {id(n): i for i, n in enumerate(nodes)}
    dag = nx.DiGraph()
    dag.add_nodes_from(range(len(nodes) + 1))
    source = len(nodes)  # virtual source: a path's length = Σ depths of the nodes on it
    for i, node in enumerate(nodes):
        w = costs[i].depth
        dag.add_edge(source, i, weight=w)
        for v in node.inputs:
            if v is None:
                continue
            p = v.producer()
            if p is not None and id(p) in index:
                dag.add_edge(index[id(p)], i, weight=w)
    depth = float(nx.dag_longest_path_length(dag, weight="weight", default_weight=0)) if nodes else 0.0

    records = tuple(
        OpRecord(n.name or f"{n.op_type}_{i}", n.op_type, c.flops, c.bytes, c.depth)
        for i, (n, c) in enumerate(zip(nodes, costs))
    )
    total_flops = math.fsum(c.flops for c in costs)
    total_bytes = math.fsum(c.bytes for c in costs)
    work = math.fsum(c.work for c in costs)
    return GraphStats(
        num_nodes=len(nodes),
        op_histogram=dict(sorted(hist.items(), key=lambda kv: (-kv[1], kv[0]))),
        param_count=int(param_count),
        param_bytes=float(param_bytes),
        ops=records,
        total_flops=total_flops,
        total_bytes=total_bytes,
        work=work,
        depth=depth,
        parallelism=work / depth if depth > 0 else 0.0,
        peak_activation_bytes=peak_activation_bytes(graph, const),
    )
