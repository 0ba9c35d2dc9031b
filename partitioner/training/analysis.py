"""Work and depth of a training step, split into forward, loss, backward and optimizer.

The survey's W (work) and D (depth) of the backward pass: every node of the step is charged by
the cost model's per-op rules (:mod:`partitioner.cost.workdepth`) and assigned to a part by its
``training.forward_node`` metadata (no tag: forward; ``loss``/``optimizer``: those parts; any
other tag: backward of that forward node). D of a part is the longest path through that part's
nodes alone. The backward pass is expected to cost about twice the forward (a product's two
operand gradients each cost one forward product).
"""

from __future__ import annotations

import math
from typing import Any

import networkx as nx
import onnx_ir as ir

from partitioner.training.autodiff import FORWARD_NODE_KEY


def part_of(node: ir.Node) -> str:
    tag = node.metadata_props.get(FORWARD_NODE_KEY)
    if tag is None:
        return "forward"
    return tag if tag in ("loss", "optimizer") else "backward"


def step_live_bytes(step: ir.Graph) -> float:
    """The most bytes the step graph's forward, loss and backward values hold at once in its node
    order (views share their input's buffer; :func:`partitioner.cost.workdepth.peak_activation_bytes`):
    cost rule 3's activations on 1-rank and data ranks (``cost.training.STEP_LIVE_ACTIVATIONS``).
    Left out, as rule 3's other terms price them: the state (the graph's initializers: weights,
    optimizer state, BN statistics; ``3 S``) and the optimizer's nodes (the update's new state and
    temporaries; ``3 S``, and ``G`` for the gradients they read)."""
    from partitioner.cost.workdepth import peak_activation_bytes

    return float(peak_activation_bytes(step, const=set(step.initializers.values()),
                                       skip=lambda n: part_of(n) == "optimizer"))


def training_stats(model: Any, loss: str = "cross_entropy", optimizer: Any = None) -> dict[str, Any]:
    """``{part: {flops, work, depth, nodes}}`` for the step of ``model``, plus backward/forward ratios."""
    from partitioner.cost.workdepth import constant_values, node_costs
    from partitioner.training.step import build_training_graph, step_program

    step = ir.serde.deserialize_model(step_program(build_training_graph(model, loss=loss, optimizer=optimizer)))
    graph = step.graph
    nodes = list(graph)
    costs = node_costs(graph, constant_values(graph))
    parts: dict[str, dict[str, Any]] = {}
    for name in ("forward", "loss", "backward", "optimizer"):
        idx = [i for i, n in enumerate(nodes) if part_of(n) == name]
        members = set(idx)
        dag = nx.DiGraph()
        position = {id(n): i for i, n in enumerate(nodes)}
        for i in idx:
            dag.add_edge("src", i, weight=costs[i].depth)
            for v in nodes[i].inputs:
                p = v.producer() if v is not None else None
                if p is not None and position.get(id(p)) in members:
                    dag.add_edge(position[id(p)], i, weight=costs[i].depth)
        depth = float(nx.dag_longest_path_length(dag, weight="weight")) if idx else 0.0
        parts[name] = {"nodes": len(idx), "flops": math.fsum(costs[i].flops for i in idx),
                       "work": math.fsum(costs[i].work for i in idx), "depth": depth}
    fwd = parts["forward"]
    parts["backward_over_forward"] = {k: (parts["backward"][k] / fwd[k] if fwd[k] else None)
                                      for k in ("flops", "work", "depth")}
    return parts
