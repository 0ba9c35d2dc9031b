"""The partition plan: plain data saying who runs what and how every tensor is laid out.

A :class:`Plan` is the only thing a strategy (policy) hands to lowering (mechanism).

Rules and invariants:

1. Every node of the model has a :class:`NodePlan`, keyed by node name (names are unique): the
   ordered device group (``ranks``) that runs it, its pipeline ``stage``, the layout each input
   must have on that group (``inputs``) and the layout each output has there (``outputs``), and
   the lowering ``rule`` (``plain``; ``bias_on_first``: a row-parallel Gemm/Conv keeps its bias
   only on the group's first rank so the partial sum adds it once; ``spatial``: halo exchange).
2. A :class:`Sharding` has ONNX ``ShardingSpec`` semantics: ``axis`` is split into
   ``len(ranks)`` equal chunks, chunk i on ``ranks[i]``; ``axis=None`` is replicated on every
   rank of the group; ``partial`` names a pending reduction (each rank holds an addend).
3. ``tensors`` gives each graph input's layout (how inputs are scattered) and each value's layout
   as produced; graph outputs may be split (the bindings assemble them) or partial (lowering
   reduces them first).
4. With ``microbatches = M > 1`` the per-rank programs run on one micro-batch; ``batch_axes``
   says which axis of each value carries the batch (and is divided by M).
5. Plans serialise to JSON (``to_json``/``from_json`` round-trip exactly) and to the ONNX
   multi-device annotations (``ModelProto.configuration``, ``NodeProto.device_configurations``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Any, Mapping

import onnx

from partitioner.core.errors import PlanError

CONFIGURATION_NAME = "partitioner"
RULES = ("plain", "bias_on_first", "spatial")


@dataclass(frozen=True)
class Sharding:
    """Layout of one tensor on an ordered device group (see rule 2)."""

    ranks: tuple[int, ...]
    axis: int | None = None
    partial: str | None = None

    def __post_init__(self) -> None:
        if not self.ranks:
            raise PlanError("a sharding needs at least one rank")
        if self.axis is not None and self.partial is not None:
            raise PlanError(f"a sharding cannot be both split (axis {self.axis}) and partial ({self.partial})")

    @property
    def replicated(self) -> bool:
        return self.axis is None and self.partial is None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"ranks": list(self.ranks)}
        if self.axis is not None:
            out["axis"] = self.axis
        if self.partial is not None:
            out["partial"] = self.partial
        return out

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Sharding:
        return cls(tuple(int(r) for r in d["ranks"]), d.get("axis"), d.get("partial"))

    def describe(self) -> str:
        where = ",".join(map(str, self.ranks))
        if self.axis is not None:
            return f"split(axis={self.axis})@[{where}]"
        if self.partial is not None:
            return f"partial({self.partial})@[{where}]"
        return f"replicated@[{where}]"


@dataclass(frozen=True)
class NodePlan:
    """Placement of one node (rule 1). ``inputs``/``outputs`` align with the node's; None = absent."""

    ranks: tuple[int, ...]
    inputs: tuple[Sharding | None, ...]
    outputs: tuple[Sharding | None, ...]
    stage: int = 0
    rule: str = "plain"

    def to_json(self) -> dict[str, Any]:
        return {"ranks": list(self.ranks), "stage": self.stage, "rule": self.rule,
                "inputs": [s.to_json() if s else None for s in self.inputs],
                "outputs": [s.to_json() if s else None for s in self.outputs]}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> NodePlan:
        def sh(x: Any) -> Sharding | None:
            return Sharding.from_json(x) if x else None

        return cls(tuple(d["ranks"]), tuple(sh(x) for x in d["inputs"]), tuple(sh(x) for x in d["outputs"]),
                   int(d.get("stage", 0)), d.get("rule", "plain"))


@dataclass(frozen=True)
class Plan:
    """A whole partition plan (see the module docstring)."""

    strategy: str
    world_size: int
    mesh_shape: tuple[int, ...]
    mesh_axes: tuple[str, ...]
    nodes: Mapping[str, NodePlan] = field(hash=False)
    tensors: Mapping[str, Sharding] = field(hash=False)
    microbatches: int = 1
    num_stages: int = 1
    batch_axes: Mapping[str, int] = field(default_factory=dict, hash=False)
    notes: str = ""

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise PlanError(f"plan {self.strategy!r}: world size must be >= 1")
        if self.microbatches < 1:
            raise PlanError(f"plan {self.strategy!r}: micro-batch count must be >= 1")
        for name, np_ in self.nodes.items():
            if np_.rule not in RULES:
                raise PlanError(f"plan: node {name!r} has unknown rule {np_.rule!r}; known: {', '.join(RULES)}")
            for r in np_.ranks:
                if not 0 <= r < self.world_size:
                    raise PlanError(f"plan: node {name!r} names rank {r} of world size {self.world_size}")

    def with_(self, **changes: Any) -> Plan:
        return replace(self, **changes)

    def ranks_of_stage(self, stage: int) -> tuple[int, ...]:
        return tuple(sorted({r for n in self.nodes.values() if n.stage == stage for r in n.ranks}))

    def summary(self) -> dict[str, Any]:
        per_rank = {r: 0 for r in range(self.world_size)}
        for n in self.nodes.values():
            for r in n.ranks:
                per_rank[r] += 1
        return {"strategy": self.strategy, "world_size": self.world_size, "mesh_shape": list(self.mesh_shape),
                "mesh_axes": list(self.mesh_axes), "microbatches": self.microbatches,
                "num_stages": self.num_stages, "nodes_per_rank": per_rank}

    # ---- JSON ---------------------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        return {
            "format": "partitioner.plan/1",
            "strategy": self.strategy, "world_size": self.world_size,
            "mesh_shape": list(self.mesh_shape), "mesh_axes": list(self.mesh_axes),
            "microbatches": self.microbatches, "num_stages": self.num_stages, "notes": self.notes,
            "nodes": {k: v.to_json() for k, v in self.nodes.items()},
            "tensors": {k: v.to_json() for k, v in self.tensors.items()},
            "batch_axes": dict(self.batch_axes),
        }

    @classmethod
    def from_json(cls, d: Mapping[str, Any] | str) -> Plan:
        if isinstance(d, str):
            d = json.loads(d)
        if d.get("format") != "partitioner.plan/1":
            raise PlanError(f"plan JSON has format {d.get('format')!r}; expected 'partitioner.plan/1'")
        return cls(d["strategy"], int(d["world_size"]), tuple(d["mesh_shape"]), tuple(d["mesh_axes"]),
                   {k: NodePlan.from_json(v) for k, v in d["nodes"].items()},
                   {k: Sharding.from_json(v) for k, v in d["tensors"].items()},
                   int(d.get("microbatches", 1)), int(d.get("num_stages", 1)),
                   {k: int(v) for k, v in d.get("batch_axes", {}).items()}, d.get("notes", ""))

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=1, sort_keys=True)


# ---- ONNX multi-device annotations ---------------------------------------------------------------

def _spec(name: str, s: Sharding, shape: list[int] | None) -> onnx.ShardingSpecProto:
    spec = onnx.ShardingSpecProto(tensor_name=name)
    if s.axis is None:
        # one shard replicated on the whole group: device -1 maps to the group (ShardingSpec rule)
        spec.device.append(-1)
        spec.index_to_device_group_map.append(onnx.IntIntListEntryProto(key=-1, value=list(s.ranks)))
        return spec
    spec.device.extend(s.ranks)
    dim = onnx.ShardedDimProto(axis=s.axis)
    simple = onnx.SimpleShardedDimProto(num_shards=len(s.ranks))
    if shape is not None and s.axis < len(shape):
        simple.dim_value = int(shape[s.axis])
    dim.simple_sharding.append(simple)
    spec.sharded_dim.append(dim)
    return spec


def annotate_model(model: onnx.ModelProto, plan: Plan) -> onnx.ModelProto:
    """Return a copy of ``model`` carrying ``plan`` as ONNX multi-device annotations (rule 5).

    ``ModelProto.configuration`` gets one ``DeviceConfigurationProto`` named
    :data:`CONFIGURATION_NAME`; each planned node gets a ``NodeDeviceConfigurationProto`` with its
    ``pipeline_stage`` and a ``ShardingSpecProto`` for each split or replicated input/output.
    Partial-sum layouts have no ShardingSpec form and are left out.
    """
    out = onnx.ModelProto()
    out.CopyFrom(model)
    del out.configuration[:]
    out.configuration.append(onnx.DeviceConfigurationProto(
        name=CONFIGURATION_NAME, num_devices=plan.world_size, device=[f"rank{i}" for i in range(plan.world_size)]))
    shapes = _shapes(out)
    for node in out.graph.node:
        np_ = plan.nodes.get(node.name)
        if np_ is None:
            continue
        del node.device_configurations[:]
        cfg = onnx.NodeDeviceConfigurationProto(configuration_id=CONFIGURATION_NAME, pipeline_stage=np_.stage)
        for names, shardings in ((node.input, np_.inputs), (node.output, np_.outputs)):
            for name, s in zip(names, shardings):
                if name and s is not None and s.partial is None:
                    cfg.sharding_spec.append(_spec(name, s, shapes.get(name)))
        node.device_configurations.append(cfg)
    return out


def _shapes(model: onnx.ModelProto) -> dict[str, list[int]]:
    g = model.graph
    out: dict[str, list[int]] = {}
    for vi in list(g.input) + list(g.output) + list(g.value_info):
        t = vi.type.tensor_type
        if t.HasField("shape"):
            out[vi.name] = [d.dim_value for d in t.shape.dim]
    for init in g.initializer:
        out[init.name] = list(init.dims)
    return out


def pinned_stages(model: Any) -> dict[str, int]:
    """User constraints: ``pipeline_stage`` annotations already on nodes (ir.Model or ModelProto)."""
    pins: dict[str, int] = {}
    if isinstance(model, onnx.ModelProto):
        for node in model.graph.node:
            for cfg in node.device_configurations:
                if cfg.HasField("pipeline_stage"):
                    pins[node.name] = int(cfg.pipeline_stage)
        return pins
    for node in model.graph:
        for cfg in getattr(node, "device_configurations", ()) or ():
            if getattr(cfg, "pipeline_stage", None) is not None:
                pins[node.name] = int(cfg.pipeline_stage)
    return pins
