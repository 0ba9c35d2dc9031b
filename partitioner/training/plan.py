"""``predict_training``: the training cost model applied to a model and a plan.

Loads the forward graph at the batch one rank runs, finds what the runtime would run (the
pipeline stages by :func:`partitioner.training.pipeline.stage_ends`, the tensor pairs by
:func:`partitioner.training.tensor.find_pairs`) and applies the formulas of
:mod:`partitioner.cost.training` on the cluster's devices (default ``cpu:<devices>``).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

import onnx_ir as ir

from partitioner.core.errors import UsageError
from partitioner.cost import training as cost
from partitioner.cost import memory as cost_memory
from partitioner.cost.training import TrainingPrediction

STRATEGIES = ("single", "data", "pipeline", "tensor", "hybrid")


@dataclass
class PipelinePrediction(TrainingPrediction):
    """A pipeline plan's prediction and which node costs its stage cut balanced
    (:mod:`partitioner.training.measured_cut`: measured, or the cost model's)."""

    cut: str = "cost model"


def predict_training(model: Any, strategy: str, devices: int, *, batch: int, optimizer: str = "sgd",
                     schedule: str = "1f1b", micro_batches: int | None = None, cluster: Any = None,
                     stages: int | None = None, memory_limit: float | None = None,
                     overlap: bool = True, overheads: cost.StepOverheads | None = None,
                     loss: str = "cross_entropy", backend: str | None = None) -> TrainingPrediction:
    """Predicted step time, samples/s and peak memory per rank of training ``model`` so
    (``hybrid``: ``devices / stages`` replicas of a ``stages``-stage pipeline, default 2).
    ``overlap``: data-parallel ranks reduce beside the backward and AllReduce their buckets as
    lists (:mod:`partitioner.training.buckets`, when ``LIST_ALLREDUCE`` is on: no concatenation
    and split passes, 2 weight copies fewer): ONNX Runtime ranks, and TVM ranks while
    ``LIST_ALLREDUCE`` is on (one library per segment, overlap rule 7); False: one blocking step.
    ``overheads`` (:func:`partitioner.training.overheads.calibrate`): the fixed per-step, per-call
    and per-node costs (cost rule 7), counted on the step graph built with ``loss``; without them
    the prediction is compute and communication only. ``backend`` (default: ``overheads``'
    backend, else ONNX Runtime) decides the pipeline cut as the runtime does (measured on ONNX
    Runtime, :mod:`partitioner.training.measured_cut`)."""
    from partitioner.cluster import resolve_cluster
    from partitioner.training.step import _load

    if strategy not in STRATEGIES:
        raise UsageError(f"training cost: unknown strategy {strategy!r}; choose one of {', '.join(STRATEGIES)}")
    if devices < 1 or batch < 1:
        raise UsageError("--devices and --batch must be at least 1")
    if strategy == "hybrid" and devices > 1:
        return _hybrid(model, devices, stages or 2, batch=batch, optimizer=optimizer, schedule=schedule,
                       micro_batches=micro_batches, cluster=cluster, overheads=overheads, loss=loss)
    cl = resolve_cluster(cluster if cluster is not None else f"cpu:{devices}")
    device = cost.co_located(cl.devices[0], devices)  # cost rule 11: the ranks share the memory system
    copies = cost.OPTIMIZER_COPIES.get(optimizer, 0)
    m = micro_batches or 2 * devices
    if strategy == "pipeline" and devices > 1 and batch % m:
        raise UsageError(f"--batch {batch} does not split into {m} equal micro-batches")
    local = {"data": batch // devices, "pipeline": batch // m}.get(strategy, batch) if devices > 1 else batch
    fwd = _load(model, local)
    graph = fwd.graph
    step = _step_graph(model, local, loss, optimizer)
    prof = _profile(graph, device, step)
    if overheads is not None:
        _count_step_nodes(prof, model, local, loss, optimizer, overheads, step)
    if strategy == "pipeline" and devices > 1:
        from partitioner.training.measured_cut import COST_MODEL, MEASURED, node_seconds
        from partitioner.training.pipeline import chosen_warmup, warmup_bound, warmup_cut

        be = backend or (overheads.backend if overheads is not None and overheads.backend else "onnxruntime")
        from partitioner.training.pipeline import _defers, deferred_cut

        whole = _load(model, batch) if _defers(memory_limit, m) and be == "onnxruntime" else None  # measured_cut rule 7
        seconds = node_seconds(fwd, loss, be, whole, m, devices if memory_limit is None else 0)
        extra = warmup_bound(be, seconds) if schedule == "1f1b" else 0  # pipeline rule 5, as build_pipeline keeps it
        defers = False
        if seconds is not None and seconds.ndim == 2:  # pipeline rule 10 decides the cut
            (ends, defers), recompute = deferred_cut(graph, devices, m, seconds), False
            if defers:  # cost rule 9: the last stage's weight gradients once, at the whole batch
                prof.deferred = _deferred_prices(model, graph, step, local, batch, loss, optimizer, device)
        else:
            ends, recompute, extra = warmup_cut(graph, devices, schedule, m, extra, memory_limit=memory_limit,
                                                state_copies=copies, seconds=seconds)
        extra = chosen_warmup(graph, ends, m, seconds, extra, defers)  # pipeline rule 5's simulated choice
        if be == "tvm" and step is not None:  # cost rule 10: hoist rules 5 and 7 on TVM stages
            prof.constants = _step_constants(graph, step, m, device)
        memory = _stage_memory_terms(be, step is not None, model, loss, optimizer, batch, devices, m, schedule,
                                     memory_limit)
        pred = cost.pipeline(prof, ends, batch, copies, schedule, m, cl, device, recompute, extra, *memory)
        return PipelinePrediction(**{f.name: getattr(pred, f.name) for f in fields(pred)},
                                  cut=MEASURED if seconds is not None else COST_MODEL)
    from partitioner.training.buckets import LIST_ALLREDUCE

    from partitioner.training.overlap import SHARDED_UPDATE

    be = backend or (overheads.backend if overheads is not None and overheads.backend else "onnxruntime")
    if strategy == "tensor" and devices > 1:
        pred = _tensor(prof, graph, devices, batch, copies, cl, device)
    else:
        pred = cost.single_or_data(prof, strategy, devices, batch, copies, cl, device, overlap,
                                   list_buckets=overlap and LIST_ALLREDUCE,
                                   sharded_update=be == "tvm" and LIST_ALLREDUCE and SHARDED_UPDATE)
    planned = _tvm_rank_memory(_tvm_rank_step(model, strategy, devices, local, loss, optimizer, step)) \
        if be == "tvm" and cost_memory.TVM_PLANNED_MEMORY and step is not None else None
    return replace(pred, memory_per_rank=[planned.total] * devices) if planned is not None else pred


def _profile(graph: ir.Graph, device: Any, step: ir.Model | None) -> Any:
    """Cost rule 1's profile of the rank's forward ``graph`` with its ``step`` (when built), and
    rule 3's activations of 1-rank and data ranks, the step graph's peak live bytes."""
    from partitioner.training.analysis import step_live_bytes
    from partitioner.training.step import default_trainable

    prof = cost.profile(graph, device, set(default_trainable(graph)), step.graph if step is not None else None)
    if step is not None:
        prof.step_live = step_live_bytes(step.graph)
    return prof


def _tvm_rank_step(model: Any, strategy: str, devices: int, local: int, loss: str, optimizer: str,
                   step: ir.Model) -> ir.Model | None:
    """Rank 0's step as ``train`` builds it on TVM ranks of one thread: ``step`` on 1 rank, a data
    rank's buckets sized by ``loop.bucket_bytes`` (one bucket), a tensor rank's forward sharded
    (its ranks' steps are alike)."""
    if devices == 1 or strategy not in ("data", "tensor"):
        return step
    if strategy == "data":
        from partitioner.training.loop import bucket_bytes

        return _step_graph(model, local, loss, optimizer, world_size=devices,
                           bucket_bytes=bucket_bytes("tvm", 1))
    from partitioner.training.tensor import shard_forward

    return _step_graph(model, local, loss, optimizer, forward_rewrite=lambda m: shard_forward(m, 0, devices))


def _tvm_rank_memory(step: ir.Model | None) -> cost_memory.TvmRankMemory | None:
    """Cost rule 3 on TVM ``single`` / ``data`` / ``tensor`` ranks (``memory.TVM_PLANNED_MEMORY``):
    the libraries the runner builds of ``step``, priced by their own memory plans (lowered and
    scheduled, not compiled); None when one of them does not lower on TVM alone."""
    from backends.tvm.planned_memory import planned_bytes
    from partitioner.cost.ops import nbytes
    from partitioner.runtime.comm_mpi import SHM_MIN_BYTES
    from partitioner.training.runner import tvm_rank_programs
    from partitioner.training.step import signature

    if step is None:
        return None
    sig = signature(step)
    programs = tvm_rank_programs(step)
    planned = [planned_bytes(p) for p in programs]
    if any(p is None for p in planned):
        return None
    held = {a for a, _ in sig.state}
    copied = set(sig.data) | {sig.labels}
    g = step.graph
    state = sum(float(v.const_value.nbytes) for v in g.inputs if v.name in held and v.const_value is not None)
    inputs = sum(cost_memory.value_bytes(v) for p in programs for v in p.graph.input if v.name in copied)
    largest = max((nbytes(n.inputs[0]) for n in g if n.op_type == "AllReduce"), default=0.0)
    window = sig.world_size * largest if sig.world_size > 1 and largest >= SHM_MIN_BYTES else 0.0
    return cost_memory.tvm_rank_memory(state_bytes=state, planned=planned, input_bytes=inputs,
                                       window_bytes=window)


def _tvm_stage_memory(model: Any, loss: str, optimizer: str, batch: int, stages: int, m: int, schedule: str,
                      memory_limit: float | None) -> list[float]:
    """Cost rule 3 on TVM stages (:data:`partitioner.cost.memory.TVM_STAGE_MEMORY`): each stage's
    peak priced from the programs the runner builds (the plan as ``train`` makes it; each program
    lowered for its memory plan, ``memory.TVM_STAGE_PLANNED_POOL``, nothing compiled), with rule 3's
    in-flight counts of the plan's schedule."""
    from backends.tvm.lift_step_constants import step_constant_inputs
    from backends.tvm.planned_memory import planned_bytes

    plan = _runner_plan("tvm", model, loss, optimizer, batch, stages, m, schedule, memory_limit)
    counts = cost.stashed_micro_batches(schedule, plan.num_stages, m, plan.extra_warmup)
    return [cost_memory.tvm_stage_memory(st, micro_batches=m, in_flight=counts[st.index],
                                         constant_inputs=step_constant_inputs, planned=planned_bytes).total
            for st in plan.stages]


def _stage_memory_terms(be: str, has_step: bool, *args: Any) -> tuple[list[float] | None, float | None]:
    """Cost rule 3's terms priced from a pipeline plan's programs: each TVM stage's peak
    (``memory.TVM_STAGE_MEMORY``), an ONNX Runtime plan's last-stage activations
    (``memory.ORT_LAST_STAGE_LIVE``); None where the rule does not apply (no step graph)."""
    tvm = be == "tvm" and cost_memory.TVM_STAGE_MEMORY and has_step
    ort = be == "onnxruntime" and cost_memory.ORT_LAST_STAGE_LIVE and has_step
    return (_tvm_stage_memory(*args) if tvm else None), (_ort_last_stage_activations(*args) if ort else None)


def _ort_last_stage_activations(model: Any, loss: str, optimizer: str, batch: int, stages: int, m: int,
                                schedule: str, memory_limit: float | None) -> float:
    """Cost rule 3's activations on an ONNX Runtime plan's last stage from the programs its runner
    runs (the plan as ``train`` makes it; :func:`partitioner.cost.memory.ort_last_stage_activations`)."""
    plan = _runner_plan("onnxruntime", model, loss, optimizer, batch, stages, m, schedule, memory_limit)
    return cost_memory.ort_last_stage_activations(plan.stages[-1])


def _runner_plan(backend: str, model: Any, loss: str, optimizer: str, batch: int, stages: int, m: int,
                 schedule: str, memory_limit: float | None) -> Any:
    """The pipeline plan ``train`` makes for ``backend`` (its stages' programs, as the runner runs them)."""
    from partitioner.training.optimizers import make_optimizer
    from partitioner.training.pipeline import build_pipeline

    return build_pipeline(model, loss, make_optimizer(optimizer, 1e-3), batch=batch, stages=stages, micro_batches=m,
                          schedule=schedule, memory_limit=memory_limit, backend=backend)


def _step_graph(model: Any, batch: int, loss: str, optimizer: str, **kw: Any) -> ir.Model | None:
    """The 1-rank training step at ``batch`` whose nodes cost rule 1 times (None when the
    step cannot be built with ``loss``, e.g. a loss that does not fit the model's output: the
    prediction then falls back to the factor rule; ``train`` itself refuses such a run)."""
    from partitioner.core.errors import InputError
    from partitioner.training.optimizers import make_optimizer
    from partitioner.training.step import build_training_graph

    try:
        return build_training_graph(model, loss=loss, optimizer=make_optimizer(optimizer, 1e-3), batch=batch,
                                    **kw)
    except (UsageError, InputError):
        return None


def _deferred_prices(model: Any, graph: ir.Graph, step: ir.Model | None, local: int, batch: int, loss: str,
                     optimizer: str, device: Any) -> cost.DeferredWeightGradients | None:
    """Cost rule 9's prices: every forward node's weight-gradient-only nodes in the step at the
    micro-batch ``local`` and at the whole ``batch`` (None without a step graph)."""
    whole = _step_graph(model, batch, loss, optimizer)
    if step is None or whole is None:
        return None
    names = [n.name or f"node{i}" for i, n in enumerate(graph)]
    micro, nodes = cost.weight_gradient_times(step.graph, device, names)
    return cost.DeferredWeightGradients(micro, cost.weight_gradient_times(whole.graph, device, names)[0], nodes)


def _step_constants(graph: ir.Graph, step: ir.Model, m: int, device: Any) -> cost.StepConstants | None:
    """Cost rule 10's prices when the TVM stages hoist their conv weights' work out of the
    micro-batch loop (:mod:`partitioner.training.hoist`: rules 1-2 and 5 on, ``m >= 2``; rule 7
    lifts the packing of weights of at least ``LIFT_MIN_BYTES``, 0 bytes lifted when it is off)."""
    from partitioner.training import hoist

    if m < 2 or not (hoist.HOIST_WEIGHT_NODES and hoist.HWIO_CONV_WEIGHTS):
        return None
    names = [n.name or f"node{i}" for i, n in enumerate(graph)]
    lift = hoist.LIFT_MIN_BYTES if hoist.LIFT_STEP_CONSTANTS else float("inf")
    return cost.step_constant_prices(step.graph, device, names, lift)


def _count_step_nodes(prof: Any, model: Any, batch: int, loss: str, optimizer: str,
                      overheads: cost.StepOverheads, step: ir.Model | None = None) -> None:
    """Cost rule 7's counts: the step graph's nodes per forward node, the loss's, the optimizer's."""
    from partitioner.training.optimizers import make_optimizer
    from partitioner.training.overheads import step_node_counts

    prof.step_nodes, prof.loss_nodes, prof.optimizer_nodes = step_node_counts(
        model, batch, loss, make_optimizer(optimizer, 1e-3), prof.names, step)
    prof.overheads = overheads


def _hybrid(model: Any, devices: int, stages: int, **kw: Any) -> TrainingPrediction:
    """One replica's pipeline on its share of the batch, plus each stage's gradient AllReduce over
    the replicas (the biggest stage's weights; the replicas' groups reduce at the same time)."""
    from partitioner.cluster import resolve_cluster
    from partitioner.cost.comm import collective_time

    if stages < 2 or devices % stages:
        raise UsageError(f"--stages {stages}: a pipeline needs at least 2 stages, and --devices {devices} must be a "
                         "multiple of it")
    replicas, batch = devices // stages, kw.pop("batch")
    if batch % replicas:
        raise UsageError(f"--batch {batch} does not split evenly over {replicas} pipeline replicas")
    cluster = kw.pop("cluster")
    cl = resolve_cluster(cluster if cluster is not None else f"cpu:{devices}")
    p = predict_training(model, "pipeline", stages, batch=batch // replicas, cluster=cl, **kw)
    comm = collective_time("allreduce", max(p.stage_weight_bytes or [0.0]), [k * stages for k in range(replicas)],
                           cl).seconds
    step = p.step_time_s + comm
    parts = {**p.breakdown, "replica_allreduce_s": comm}
    return TrainingPrediction("hybrid", devices, batch, step, batch / step, p.memory_per_rank * replicas, parts,
                              p.schedule, p.micro_batches, p.stage_weight_bytes)


def _tensor(prof: Any, graph: ir.Graph, world: int, batch: int, copies: int, cl: Any, device: Any) -> TrainingPrediction:
    from partitioner.cost.ops import nbytes
    from partitioner.training.tensor import find_pairs, shard_axes

    proto = ir.serde.serialize_model(ir.Model(graph, ir_version=8))
    axes = shard_axes(proto, world)  # refuses a model without a pair, as the runtime does
    pairs = [p for p in find_pairs(proto.graph) if p[0].input[1] in axes]
    split = {n.name for col, chain, row in pairs for n in (col, *chain, row)}
    values = {v.name: v for n in graph for v in (*n.inputs, *n.outputs) if v is not None}
    sizes = [nbytes(values[name]) for col, _chain, row in pairs for name in (row.output[0], col.input[0])]
    return cost.tensor(prof, world, batch, copies, split, sizes, cl, device)


def choose_strategy(model: Any, devices: int, *, batch: int, optimizer: str = "sgd", micro_batches: int | None = None,
                    memory_limit: float | None = None, cluster: Any = None) -> tuple[str, dict[str, TrainingPrediction]]:
    """``--strategy auto``: the plan with the highest predicted samples/s among data, pipeline
    (1F1B), tensor and hybrid (devices >= 4) whose predicted peak memory per rank fits
    ``memory_limit``; plans the model does not admit are skipped. Returns (strategy, predictions)."""
    if devices == 1:
        return "data", {}
    candidates = ["data", "pipeline", "tensor"]
    preds: dict[str, TrainingPrediction] = {}
    for strategy in candidates:
        try:
            preds[strategy] = predict_training(model, strategy, devices, batch=batch, optimizer=optimizer,
                                               micro_batches=micro_batches, cluster=cluster, memory_limit=memory_limit)
        except UsageError:
            continue
    fits = {k: p for k, p in preds.items() if memory_limit is None or max(p.memory_per_rank) <= memory_limit}
    if not fits:
        raise UsageError(f"train --strategy auto: no plan on {devices} devices fits the memory limit "
                         f"({', '.join(f'{k}: {max(p.memory_per_rank) / 2**20:.0f} MiB' for k, p in preds.items())})")
    best = max(fits, key=lambda k: fits[k].samples_per_s)
    return best, preds
