"""``single``: the whole model on rank 0 (world size 1); the baseline every plan is compared with."""

from __future__ import annotations

from typing import Any

from partitioner.core.model_view import ModelView
from partitioner.core.plan import Plan, Sharding
from partitioner.strategies import make_plan
from partitioner.strategies.propagate import assign_all


def plan(view: ModelView, cluster: Any = None, *, degree: int | None = None, microbatches: int | None = None,
         memory_limit: float | None = None, objective: str = "latency") -> Plan:
    inputs = {n: Sharding((0,)) for n in view.inputs}
    return make_plan(view, "single", 1, (1,), ("single",), assign_all(view, (0,), "replicate"), inputs,
                     microbatches=microbatches or 1, notes="everything on rank 0")
