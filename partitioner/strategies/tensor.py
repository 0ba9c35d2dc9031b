"""``tensor``: operator (model) parallelism over t devices with Megatron-style sharding rules
(:mod:`partitioner.strategies.propagate`, mode ``tensor``): column- then row-parallel linear
pairs with one AllReduce, attention split by heads, Conv output channels, embedding width."""

from __future__ import annotations

from typing import Any

from partitioner.core.errors import StrategyNotApplicable
from partitioner.core.model_view import ModelView
from partitioner.core.plan import Plan, Sharding
from partitioner.strategies import make_plan
from partitioner.strategies.propagate import assign_all


def plan(view: ModelView, cluster: Any, *, degree: int | None = None, microbatches: int | None = None,
         memory_limit: float | None = None, objective: str = "latency") -> Plan:
    t = degree or cluster.size
    if t < 2:
        raise StrategyNotApplicable("tensor parallelism needs at least 2 devices")
    ranks = tuple(range(t))
    inputs = {n: Sharding(ranks) for n in view.inputs}
    p = make_plan(view, "tensor", t, (t,), ("tensor",), assign_all(view, ranks, "tensor"), inputs,
                  microbatches=microbatches or 1, notes=f"weights split over {t} devices")
    split = [n for n in p.nodes.values() for s in n.inputs if s is not None and s.axis is not None]
    if not split:
        raise StrategyNotApplicable(f"tensor parallelism: no weight of the model can be split over {t} devices")
    return p
