"""User constraints read from the model's ONNX multi-device annotations, and the check that a plan
keeps them (the way GSPMD reads sharding annotations: what the user wrote is fixed, the
partitioner chooses everything else).

Rules:
1. A ``pipeline_stage`` on a node's ``device_configurations`` pins that node to that stage. A plan
   keeps it when the node's ``NodePlan.stage`` is that stage. A plan with one stage (single,
   data, tensor, spatial, hybrid's data-convs + tensor-classifier) therefore keeps only pins to
   stage 0.
2. A ``ShardingSpecProto`` names a tensor the node reads or writes and its layout: ``device`` lists
   the ranks holding the shards in order (chunk i on ``device[i]``) with the split ``axis`` from
   ``sharded_dim``; ``device = [-1]`` with ``index_to_device_group_map[-1]`` is one copy
   replicated on that group. A plan keeps it when the node's input or output layout for that
   tensor is the same :class:`~partitioner.core.plan.Sharding` (axis and ordered ranks). Partial sums
   have no ShardingSpec form, so a spec is never met by a partial layout.
3. A node the passes removed (its name is not in the plan) constrains nothing.
4. :func:`violation` returns "" when the plan keeps every constraint, else one line naming the
   first node broken and how many constraints are broken in all; strategies and ``auto`` use it
   to drop plans, so a refusal says why in one line (``StrategyNotApplicable``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import onnx

from partitioner.core.plan import Plan, Sharding


@dataclass(frozen=True)
class TensorConstraint:
    """Node ``node`` must read or write ``tensor`` with layout ``sharding`` (rule 2)."""

    node: str
    tensor: str
    sharding: Sharding


@dataclass(frozen=True)
class UserConstraints:
    stages: dict[str, int] = field(default_factory=dict)
    shardings: tuple[TensorConstraint, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.stages) or bool(self.shardings)


def _spec_sharding(devices: list[int], group_map: dict[int, list[int]], axes: list[int]) -> Sharding | None:
    if devices == [-1] or (devices and all(d < 0 for d in devices)):
        ranks = group_map.get(devices[0])
        return Sharding(tuple(int(r) for r in ranks), None) if ranks else None
    if not devices:
        return None
    return Sharding(tuple(int(d) for d in devices), axes[0] if axes else None)


def _node_specs_proto(node: onnx.NodeProto) -> tuple[int | None, list[tuple[str, Sharding]]]:
    stage, specs = None, []
    for cfg in node.device_configurations:
        if cfg.HasField("pipeline_stage"):
            stage = int(cfg.pipeline_stage)
        for spec in cfg.sharding_spec:
            s = _spec_sharding(list(spec.device), {e.key: list(e.value) for e in spec.index_to_device_group_map},
                               [d.axis for d in spec.sharded_dim])
            if s is not None:
                specs.append((spec.tensor_name, s))
    return stage, specs


def _node_specs_ir(node: Any) -> tuple[int | None, list[tuple[str, Sharding]]]:
    stage, specs = None, []
    for cfg in getattr(node, "device_configurations", ()) or ():
        if getattr(cfg, "pipeline_stage", None) is not None:
            stage = int(cfg.pipeline_stage)
        for spec in getattr(cfg, "sharding_specs", ()) or ():
            value = getattr(spec, "value", None)
            name = getattr(value, "name", None) or getattr(spec, "tensor_name", None)
            groups = {int(e.key): list(e.value) for e in getattr(spec, "index_to_device_group_map", ()) or ()}
            axes = [int(d.axis) for d in getattr(spec, "sharded_dims", ()) or ()]
            s = _spec_sharding([int(d) for d in spec.device], groups, axes)
            if name and s is not None:
                specs.append((name, s))
    return stage, specs


def read_constraints(model: Any) -> UserConstraints:
    """The ``pipeline_stage`` and ``ShardingSpec`` annotations of ``model`` (an ``ir.Model`` or a
    ``ModelProto``) as constraints (rules 1-2)."""
    stages: dict[str, int] = {}
    shardings: list[TensorConstraint] = []
    if isinstance(model, onnx.ModelProto):
        items = [(n.name, _node_specs_proto(n)) for n in model.graph.node]
    else:
        items = [(n.name, _node_specs_ir(n)) for n in model.graph]
    for name, (stage, specs) in items:
        if stage is not None:
            stages[name] = stage
        shardings += [TensorConstraint(name, tensor, s) for tensor, s in specs]
    return UserConstraints(stages, tuple(shardings))


def _layout(plan: Plan, view: Any, c: TensorConstraint) -> Sharding | None | str:
    """The plan's layout of ``c.tensor`` at node ``c.node`` ("absent" when the node does not use it)."""
    np_ = plan.nodes[c.node]
    node = view.node_by_name[c.node]
    for names, layouts in ((list(node.inputs), np_.inputs), (list(node.outputs), np_.outputs)):
        for value, layout in zip(names, layouts):
            if value is not None and value.name == c.tensor:
                return layout
    return "absent"


def violation(plan: Plan, constraints: UserConstraints, view: Any) -> str:
    """"" when ``plan`` keeps every constraint, else a one-line reason (rule 4)."""
    broken: list[str] = []
    for name, stage in constraints.stages.items():
        if name in plan.nodes and plan.nodes[name].stage != stage:
            broken.append(f"node {name!r} is annotated pipeline_stage {stage} but this plan puts it on stage "
                          f"{plan.nodes[name].stage} of {plan.num_stages}")
    for c in constraints.shardings:
        if c.node not in plan.nodes or c.node not in view.node_by_name:
            continue
        got = _layout(plan, view, c)
        if got == "absent":
            continue
        if got != c.sharding:
            shown = got.describe() if isinstance(got, Sharding) else "no layout"
            broken.append(f"node {c.node!r} has a ShardingSpec {c.sharding.describe()} for {c.tensor!r} but this "
                          f"plan gives {shown}")
    if not broken:
        return ""
    more = f" (and {len(broken) - 1} more annotation(s) broken)" if len(broken) > 1 else ""
    return broken[0] + more
