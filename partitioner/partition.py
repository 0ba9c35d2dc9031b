"""Public API: ``partition(model, cluster, strategy=...)`` -> plan + per-rank programs + bindings +
predicted costs. Strategies are policies (:mod:`partitioner.strategies`); :func:`lower` is the
shared mechanism; every result is verified (``passes.verify.verify_programs``) before it is
returned. The programs stay onnx-ir (``PartitionResult.models``): the simulator reads them as they
are; ``PartitionResult.programs`` is their serialised form, made once, on first use."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import onnx
import onnx_ir as ir

from partitioner.core.bindings import Bindings
from partitioner.core.errors import StrategyNotApplicable, UsageError
from partitioner.core.model_view import ModelView
from partitioner.core.plan import Plan
from partitioner.core.programs import to_proto
from partitioner.lowering.lower import lower as lower_plan
from partitioner.strategies import costing, get_strategy
from partitioner.strategies.constraints import read_constraints, violation
from partitioner.strategies.search import search


#: ``partition(lower=None)`` lowers only plans of at most this many node copies (ranks x nodes):
#: a 70B decoder on 128 ranks is 600k copies, minutes and gigabytes for a prediction the
#: analytical estimate already gives (docs/large_models.md).
LOWER_AUTO_LIMIT = 150_000


@dataclass(frozen=True)
class PartitionResult:
    plan: Plan
    models: tuple[ir.Model, ...] = field(hash=False)
    bindings: Bindings
    prediction: dict[str, Any] = field(hash=False)
    explanation: str = ""
    alternatives: tuple[dict[str, Any], ...] = ()
    simulation: Any = field(default=None, hash=False, compare=False)  # cost.simulate.SimResult

    @cached_property
    def programs(self) -> tuple[onnx.ModelProto, ...]:
        """The per-rank programs serialised (for an export, a backend, a test), once."""
        return tuple(to_proto(m) for m in self.models)

    def to_json(self) -> dict[str, Any]:
        return {"plan": self.plan.summary(), "prediction": self.prediction, "explanation": self.explanation,
                "alternatives": list(self.alternatives)}


def partition(model: ir.Model, cluster: Any, *, strategy: str = "auto", microbatches: int | None = None,
              objective: str = "latency", memory_limit: float | None = None, degree: int | None = None,
              lower: bool | None = True) -> PartitionResult:
    """Partition ``model`` (static shapes, shape-inferred) for ``cluster`` with ``strategy``.

    ``lower``: True lowers every rank, verifies and simulates the programs (what ``compile``
    needs); False stops at the plan and its analytical estimate (no programs, no bindings, no
    ``simulated`` prediction); None lowers when the plan is at most :data:`LOWER_AUTO_LIMIT`
    node copies.
    """
    if objective not in ("latency", "throughput"):
        raise UsageError(f"objective must be latency or throughput, not {objective!r}")
    from partitioner.cluster import resolve_cluster

    cluster = resolve_cluster(cluster)
    view = ModelView(model)
    alternatives: tuple[dict[str, Any], ...] = ()
    if strategy == "auto":
        plan, cands, explanation = search(view, cluster, objective=objective, memory_limit=memory_limit,
                                          microbatches=microbatches, max_devices=degree)
        alternatives = tuple(c.to_json() for c in cands)
    else:
        plan = get_strategy(strategy).plan(view, cluster, degree=degree, microbatches=microbatches,
                                           memory_limit=memory_limit, objective=objective)
        broken = violation(plan, read_constraints(model), view)
        if broken:  # annotations already in the model are user constraints (DESIGN.md, "Plan")
            raise StrategyNotApplicable(f"{strategy}: {broken}; choose a strategy that keeps the "
                                        "model's annotations (auto searches only those) or remove them")
        explanation = f"{strategy}: {plan.notes}"
    pred = costing.estimate(view, plan, cluster, memory_limit=memory_limit)
    if strategy != "auto" and not pred.fits:
        explanation += " (warning: predicted peak memory exceeds a device's capacity or the limit)"
    copies = plan.world_size * len(view.nodes)
    if not (lower if lower is not None else copies <= LOWER_AUTO_LIMIT):
        prediction = pred.to_json()
        prediction["simulated"] = None
        explanation += (f" (not lowered: {plan.world_size} ranks x {len(view.nodes)} nodes; the prediction is the "
                        "analytical estimate; `plan --simulate` lowers and simulates every rank)")
        return PartitionResult(plan, (), None, prediction, explanation, alternatives, None)  # type: ignore[arg-type]
    lowered = lower_plan(view, plan)
    sim = simulate_programs(lowered.models, cluster, plan.microbatches, view.batch_size(), _input_bytes(view))
    prediction, explanation = one_prediction(pred.to_json(), sim.to_json(), explanation)
    return PartitionResult(plan, lowered.models, lowered.bindings, prediction, explanation, alternatives, sim)


def one_prediction(estimate: dict[str, Any], simulated: dict[str, Any], explanation: str) -> tuple[dict[str, Any], str]:
    """One prediction, one number: once the plan is lowered, the simulation of its programs is
    the prediction (``latency_s``, ``throughput_samples_per_s``, ``step_latency_s``); the search's
    analytical estimate stays under ``search_estimate`` and the explanation says which is shown
    and why they differ, when they do by more than 1%."""
    out = dict(estimate)
    est = {"latency_s": estimate["latency_s"], "throughput_samples_per_s": estimate["throughput_samples_per_s"]}
    step = simulated["step_latency_s"]
    out.update(latency_s=step, step_latency_s=step, throughput_samples_per_s=simulated["throughput_samples_per_s"],
               simulated=simulated, search_estimate=est)
    if est["latency_s"] > 0 and abs(step / est["latency_s"] - 1) > 0.01:
        explanation += (f" The prediction shown is the simulation of the lowered programs, {step * 1e3:.3f} ms per "
                        f"step; the search ranked the candidates with the analytical estimate "
                        f"({est['latency_s'] * 1e3:.3f} ms for this plan), which costs each layout conversion "
                        f"once per tensor instead of each inserted comm op in program order.")
    return out, explanation


def auto_partition(model: ir.Model, cluster: Any, **kw: Any) -> PartitionResult:
    """``partition(..., strategy="auto")``: search strategies, degrees and meshes with the cost model."""
    return partition(model, cluster, strategy="auto", **kw)


def _input_bytes(view: ModelView) -> float:
    """The model's whole input per step (what every MPI rank reads, cost/memory.py)."""
    from partitioner.cost.ops import nbytes

    return float(sum(nbytes(v) for v in view.model.graph.inputs if v.const_value is None))


def simulate_programs(programs: Any, cluster: Any, microbatches: int, batch_size: int,
                      input_bytes: float | None = None, node_seconds: Any = None) -> Any:
    """Run the event simulator on the lowered per-rank programs (the faithful prediction: it sees
    every comm op the lowering inserted, in program order). ``programs`` are ``ir.Model`` (the
    lowering's output) or protobuf (read back from an artifact). ``node_seconds``: per rank,
    measured node times (``cost.simulate.compile_program``)."""
    from partitioner.core.programs import to_ir
    from partitioner.cost.simulate import simulate

    # Ranks whose programs differ only in weight values (tensor- and data-parallel shards) cost
    # the same: cost each distinct structure once.
    by_key: dict[str, ir.Model] = {}
    models = []
    for p in programs:
        m = to_ir(p)
        models.append(by_key.setdefault(_structure_key(m), m))
    return simulate(models, cluster, microbatches, batch_size, input_bytes=input_bytes, node_seconds=node_seconds)


def _structure_key(program: ir.Model) -> str:
    """A digest of everything the cost model reads, with value names replaced by their order of
    first use (ranks name their comm outputs differently): each node's op, domain, attributes and
    wiring, each value's type and shape, each initializer's type and dims; not weight data."""
    import hashlib

    g = program.graph
    ids: dict[int, int] = {}
    h = hashlib.sha256()

    def ref(v: ir.Value | None) -> bytes:
        if v is None:
            return b"-"
        if id(v) not in ids:
            ids[id(v)] = len(ids)
            init = v.const_value is not None and v.name in g.initializers
            h.update(f"{'init:' if init else ''}{v.dtype}:{v.shape}".encode())
        return str(ids[id(v)]).encode()

    for v in g.inputs:
        h.update(b"in:" + ref(v))
    for node in g:
        h.update(f"{node.domain}::{node.op_type}(".encode())
        for a in node.attributes.values():
            h.update(_attr_key(a))
        h.update(b",".join(ref(i) for i in node.inputs) + b"->")
        h.update(b",".join(ref(o) for o in node.outputs) + b")")
    for v in g.outputs:
        h.update(b"out:" + ref(v))
    return h.hexdigest()


def _attr_key(a: Any) -> bytes:
    """An attribute's name and value; a tensor by its bytes, a subgraph by identity (each rank's
    copy of a subgraph is its own, so nodes with subgraphs are costed per rank)."""
    if a.type == ir.AttributeType.TENSOR:
        t = a.value
        return f"{a.name}=tensor:{t.dtype}:{t.shape}:".encode() + t.tobytes() + b";"
    if a.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS, ir.AttributeType.TENSORS):
        return f"{a.name}=<{id(a)}>;".encode()
    return f"{a.name}={a.value!r};".encode()
