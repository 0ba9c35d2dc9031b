"""``data``: split the batch over d devices, replicate the weights (survey: data parallelism).

Inputs are scattered on axis 0 and outputs gathered through the bindings; no communication
inside the model. Not applicable when the batch is smaller than or not divisible by d, or when
an op mixes the batch with other axes (the reason names the node)."""

from __future__ import annotations

from typing import Any

from partitioner.core.errors import StrategyNotApplicable
from partitioner.core.model_view import ModelView
from partitioner.core.plan import Plan, Sharding
from partitioner.strategies import batch_size, make_plan
from partitioner.strategies.propagate import assign_all


def check(view: ModelView, d: int, microbatches: int = 1) -> None:
    b = batch_size(view)
    if b < d * microbatches:
        raise StrategyNotApplicable(f"data parallelism: batch {b} < {d} devices x {microbatches} micro-batches")
    if b % (d * microbatches):
        raise StrategyNotApplicable(f"data parallelism: batch {b} is not divisible by {d * microbatches}")


def plan(view: ModelView, cluster: Any, *, degree: int | None = None, microbatches: int | None = None,
         memory_limit: float | None = None, objective: str = "latency") -> Plan:
    d = degree or cluster.size
    m = microbatches or 1
    check(view, d, m)
    ranks = tuple(range(d))
    inputs = {n: Sharding(ranks, 0 if view.rank(n) >= 1 else None) for n in view.inputs}
    return make_plan(view, "data", d, (d,), ("data",), assign_all(view, ranks, "data"), inputs, microbatches=m,
                     notes=f"batch split over {d} devices, weights replicated")
