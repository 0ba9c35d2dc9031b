"""``spatial``: split H (axis 2) of conv stacks over s devices; Conv/Pool exchange halo rows
(floor(K/2) for stride 1) with their neighbours via Send/Recv; where H cannot stay split
(global pooling, the classifier) the activation is gathered and the rest runs replicated."""

from __future__ import annotations

from typing import Any

from partitioner.core.errors import StrategyNotApplicable
from partitioner.core.model_view import ModelView
from partitioner.core.plan import Plan, Sharding
from partitioner.strategies import make_plan
from partitioner.strategies.propagate import assign_all


def plan(view: ModelView, cluster: Any, *, degree: int | None = None, microbatches: int | None = None,
         memory_limit: float | None = None, objective: str = "latency") -> Plan:
    s = degree or cluster.size
    images = [n for n in view.inputs if view.rank(n) == 4]
    if not images or not any(n.op_type == "Conv" for n in view.nodes):
        raise StrategyNotApplicable("spatial partitioning needs a 4-D image input and Conv layers")
    if s < 2:
        raise StrategyNotApplicable("spatial partitioning needs at least 2 devices")
    h = view.shape(images[0])[2]
    if h % s:
        raise StrategyNotApplicable(f"spatial partitioning: image height {h} is not divisible by {s}")
    ranks = tuple(range(s))
    inputs = {n: Sharding(ranks, 2 if n in images else None) for n in view.inputs}
    p = make_plan(view, "spatial", s, (s,), ("spatial",), assign_all(view, ranks, "spatial"), inputs,
                  microbatches=microbatches or 1, notes=f"image rows split over {s} devices with halo exchange")
    if not any(n.rule == "spatial" for n in p.nodes.values()):
        raise StrategyNotApplicable(f"spatial partitioning: no Conv/Pool can keep H split over {s} devices")
    return p
