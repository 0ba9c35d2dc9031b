"""``hybrid``: 2-D meshes (survey §6.4). Candidates, each tried where it applies:

- ``pipeline x data``: p stages, each a group of d ranks splitting the batch;
- ``pipeline x tensor``: p stages, each a group of t ranks with tensor-parallel rules;
- ``data convs + tensor classifier`` ("one weird trick"): nodes up to the last Conv/Pool split the
  batch over all ranks; the fully connected tail is tensor-parallel over the same ranks.

The candidate with the lowest predicted latency (``costing.estimate``) wins."""

from __future__ import annotations

from typing import Any

from partitioner.core.errors import StrategyNotApplicable
from partitioner.core.model_view import ModelView
from partitioner.core.plan import Plan, Sharding
from partitioner.strategies import costing, data, make_plan, pipeline
from partitioner.strategies.constraints import read_constraints, violation
from partitioner.strategies.propagate import Assignment


def candidates(view: ModelView, cluster: Any, n: int, microbatches: int | None, memory_limit: float | None) -> list[tuple[Plan | None, str]]:
    out: list[tuple[Plan | None, str]] = []
    for p in range(2, n):
        if n % p:
            continue
        k = n // p
        groups = [tuple(range(s * k, (s + 1) * k)) for s in range(p)]
        for mode in ("data", "tensor"):
            try:
                if mode == "data":
                    data.check(view, k, microbatches or 1)
                out.append((pipeline.build(view, cluster, groups, mode, "hybrid", microbatches, memory_limit),
                            f"pipeline {p} x {mode} {k}"))
            except StrategyNotApplicable as exc:
                out.append((None, f"pipeline {p} x {mode} {k}: {exc}"))
    try:
        out.append((data_conv_tensor_fc(view, n, microbatches), f"data convs + tensor classifier over {n}"))
    except StrategyNotApplicable as exc:
        out.append((None, f"data convs + tensor classifier: {exc}"))
    return out


def data_conv_tensor_fc(view: ModelView, n: int, microbatches: int | None) -> Plan:
    convs = [i for i, node in enumerate(view.nodes) if node.op_type in ("Conv", "MaxPool", "AveragePool",
                                                                        "GlobalAveragePool")]
    if not convs or not any(node.op_type in ("Gemm", "MatMul") for node in view.nodes[convs[-1]:]):
        raise StrategyNotApplicable("needs convolutions followed by a fully connected classifier")
    data.check(view, n, microbatches or 1)
    ranks = tuple(range(n))
    assign = {node.name: Assignment(ranks, 0, "data" if i <= convs[-1] else "tensor")
              for i, node in enumerate(view.nodes)}
    inputs = {x: Sharding(ranks, 0) for x in view.inputs}
    return make_plan(view, "hybrid", n, (n,), ("data|tensor",), assign, inputs, microbatches=microbatches or 1,
                     notes="data-parallel convolutions, tensor-parallel classifier")


def plan(view: ModelView, cluster: Any, *, degree: int | None = None, microbatches: int | None = None,
         memory_limit: float | None = None, objective: str = "latency") -> Plan:
    n = degree or cluster.size
    if n < 2:
        raise StrategyNotApplicable("hybrid parallelism needs at least 2 devices")
    cands = [(p, why) for p, why in candidates(view, cluster, n, microbatches, memory_limit) if p is not None]
    if not cands:
        raise StrategyNotApplicable(f"hybrid: no 2-D mesh applies to {n} devices")
    constraints = read_constraints(view.model)  # keep only meshes that keep the model's annotations
    kept = [(p, why) for p, why in cands if not (constraints and violation(p, constraints, view))]
    if not kept:
        raise StrategyNotApplicable(f"hybrid: no 2-D mesh over {n} devices keeps the model's annotations "
                                    f"({cands[0][1]}: {violation(cands[0][0], constraints, view)})")
    cands = kept
    scored = []
    for p, why in cands:
        pred = costing.estimate(view, p, cluster, memory_limit=memory_limit)
        key = pred.latency_s if objective == "latency" else -pred.throughput
        scored.append(((not pred.fits, key), p, why))
    scored.sort(key=lambda x: x[0])
    best = scored[0][1]
    return best.with_(notes=f"{scored[0][2]}; {best.notes}")
