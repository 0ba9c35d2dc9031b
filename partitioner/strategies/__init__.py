"""Strategies: policies that choose a :class:`Plan`; lowering (the mechanism) is shared.

Each strategy module exposes ``plan(view, cluster, *, degree=None, microbatches=None,
memory_limit=None, objective="latency") -> Plan`` and raises
:class:`StrategyNotApplicable` (one line saying why) when it does not apply.
"""

from __future__ import annotations

import importlib
from typing import Any, Mapping

from partitioner.core.errors import StrategyNotApplicable, UsageError
from partitioner.core.model_view import ModelView
from partitioner.core.plan import Plan, Sharding
from partitioner.strategies.propagate import Assignment, batch_axes, propagate

STRATEGIES = ("single", "data", "pipeline", "tensor", "spatial", "hybrid")


def get_strategy(name: str) -> Any:
    if name not in STRATEGIES:
        raise UsageError(f"unknown strategy {name!r}; choose one of: auto, {', '.join(STRATEGIES)}")
    return importlib.import_module(f"partitioner.strategies.{name}")


def make_plan(view: ModelView, strategy: str, world: int, mesh: tuple[int, ...], axes: tuple[str, ...],
              assign: Mapping[str, Assignment], inputs: Mapping[str, Sharding], *, microbatches: int = 1,
              num_stages: int = 1, notes: str = "") -> Plan:
    """Propagate layouts for ``assign`` and wrap them in a Plan (micro-batch axes included)."""
    nodes, tensors = propagate(view, assign, inputs)
    baxes = batch_axes(view, microbatches) if microbatches > 1 else {}
    return Plan(strategy, world, mesh, axes, nodes, tensors, microbatches, num_stages, baxes, notes)


def batch_size(view: ModelView) -> int:
    """The batch a strategy can split: the smallest batch dimension of the batched inputs
    (:meth:`ModelView.batch_dims`), so that every batched input splits the same way."""
    sizes = view.batch_dims()
    if not sizes:
        raise StrategyNotApplicable("the model has no batched input")
    return min(sizes)


def first_consumer_ranks(view: ModelView, assign: Mapping[str, Assignment], name: str) -> Assignment:
    users = view.consumers.get(name, [])
    if not users:
        return next(iter(assign.values()))
    return assign[min(users, key=lambda u: view.index[u])]
