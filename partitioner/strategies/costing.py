"""The one interface strategies use for costs (numbers live in :mod:`partitioner.cost`).

- :func:`node_times` — seconds of each node on a device (roofline of ``cost.ops.op_cost``).
- :func:`estimate` — an analytical prediction of a :class:`Plan` on a cluster, from the plan alone
  (no lowering): per rank compute = node time / shard count (whole for replicated nodes); per
  rank comm = the collective or point-to-point time of every layout conversion the plan implies;
  latency = the slowest rank, or for pipelines the GPipe fill-drain step over the stages;
  memory = the rank's weight shards + twice its largest local activation (times the micro-batches
  in flight for pipelines) + the graph outputs it produces, which stay resident until the step
  ends (a decoder's KV cache, ``present.*``, is such an output: its bytes grow with batch and
  sequence length). Fast enough to rank hundreds of candidate plans.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from partitioner.core.model_view import ModelView
from partitioner.core.plan import Plan, Sharding
from partitioner.cost.comm import collective_time, p2p_time, send_overhead
from partitioner.cost.memory import activation_copies, rank_peak, runtime_memory
from partitioner.cost.ops import op_cost
from partitioner.cost.pipeline import pipeline_step_time
from partitioner.cost.threads import class_thread_speedup, rank_threads
from partitioner.cost.resharding import communicates, conversion
from partitioner.cost.roofline import graph_op_times
from partitioner.cost.runtime_overhead import rank_overhead, step_sync


def node_times(view: ModelView, device: Any) -> np.ndarray:
    """Seconds of each node (in view order) on ``device``, with the device's per-class efficiency
    and fused elementwise ops (:func:`cost.roofline.graph_op_times`); cached per device kind."""
    cache = view.__dict__.setdefault("_node_time_cache", {})
    key = (device.kind, tuple(sorted(device.peak_flops.items())), device.memory_bandwidth,
           device.efficiency, device.launch_overhead_s,
           tuple(sorted((getattr(device, "efficiency_by_class", None) or {}).items())))
    if key not in cache:
        if "_op_costs" not in view.__dict__:
            view.__dict__["_op_costs"] = [op_cost(n) for n in view.nodes]
        cache[key] = np.array(graph_op_times(view.model.graph, device, view.__dict__["_op_costs"]), dtype=np.float64)
    return cache[key]


def _by_device(cluster: Any, ranks: tuple[int, ...]) -> dict[Any, list[int]]:
    """The ranks of a group by device (identical devices are costed once)."""
    out: dict[Any, list[int]] = {}
    for r in ranks:
        out.setdefault(cluster.devices[r], []).append(r)
    return out


def _weight_bytes(view: ModelView, node: Any, reqs: Any) -> tuple[float, float]:
    """(bytes of the node's constant inputs, the bytes one rank holds of them): a replicated
    weight is read whole by every rank, a sharded one in its shard."""
    full = local = 0.0
    for name, req in zip(view.node_inputs(node), reqs):
        if name and view.is_const(name):
            b = float(view.nbytes(name))
            full += b
            local += b / (len(req.ranks) if req is not None and req.axis is not None else 1)
    return full, local


def shard_time(view: ModelView, i: int, device: Any, shard: int, microbatches: int, w_full: float,
               w_local: float, threads: int = 1) -> float:
    """Seconds one rank spends on node ``i`` per step when the node is split ``shard`` ways and
    the step runs ``microbatches`` micro-batches: what the simulator charges the lowered program.

    Per micro-batch the rank computes 1/(shard·m) of the FLOPs and of the activation bytes, but
    reads its whole local weight (replicated: all of it; sharded: its shard) every time, and pays
    the launch overhead every time; on ``threads`` threads the op's class speeds it up
    (:func:`partitioner.cost.threads.class_thread_speedup`, as the simulator does). Dividing the whole roofline by shard·m (the previous rule)
    made a batch split of a weight-bound layer look twice as fast as the program it lowers to
    (the demo's data x2 resnet: estimate 2.43 ms, simulation 3.31 ms)."""
    from partitioner.cost.ops import OpCost, op_class
    from partitioner.cost.roofline import fused_nodes, op_time

    costs = view.__dict__.get("_op_costs")
    if costs is None:
        costs = view.__dict__["_op_costs"] = [op_cost(n) for n in view.nodes]
    fused = view.__dict__.get("_fused_nodes")
    if fused is None:
        fused = view.__dict__["_fused_nodes"] = fused_nodes(view.model.graph)
    c = costs[i]
    if c.flops <= 0 and c.bytes <= 0:
        return 0.0
    k = max(1, shard) * max(1, microbatches)
    w_full = min(w_full, c.bytes_read)
    w_local = min(w_local, w_full)
    part = OpCost(c.flops / k, (c.bytes_read - w_full) / k + w_local, c.bytes_written / k, c.depth, c.elements / k)
    node = view.nodes[i]
    cls = op_class(node)
    return (max(1, microbatches) * op_time(part, device, "float32", cls, node in fused)
            / class_thread_speedup(device, cls, threads))


def comm_seconds(kind: str, nbytes: float, ranks: tuple[int, ...], cluster: Any) -> tuple[float, dict[str, float]]:
    c = collective_time(kind, nbytes, ranks, cluster)
    return c.seconds, dict(c.bytes_per_level)


@dataclass(frozen=True)
class Prediction:
    compute_s: tuple[float, ...]
    comm_s: tuple[float, ...]
    idle_s: tuple[float, ...]
    memory_bytes: tuple[float, ...]
    latency_s: float
    throughput: float
    bytes_per_level: dict[str, float] = field(default_factory=dict, hash=False)
    fits: bool = True
    #: per rank (weights, activations, resident outputs such as a KV cache) in bytes
    memory_parts: tuple[tuple[float, float, float], ...] = field(default=(), compare=False)

    def to_json(self) -> dict[str, Any]:
        return {"latency_s": self.latency_s, "throughput_samples_per_s": self.throughput,
                "per_device": [{"rank": r, "compute_s": c, "comm_s": m, "idle_s": i, "peak_memory_bytes": b,
                                **_parts_json(self.memory_parts, r)}
                               for r, (c, m, i, b) in enumerate(zip(self.compute_s, self.comm_s, self.idle_s,
                                                                    self.memory_bytes))],
                "bytes_per_link_level": dict(self.bytes_per_level), "fits_memory": self.fits}


def _parts_json(parts: tuple[tuple[float, float, float], ...], r: int) -> dict[str, float]:
    if r >= len(parts):
        return {}
    w, a, o = parts[r]
    return {"weight_bytes": w, "activation_bytes": a, "resident_output_bytes": o}


def _is_external(view: ModelView, name: str) -> bool:
    import onnx_ir as ir

    v = view.initializers.get(name)
    return v is not None and isinstance(v.const_value, ir.ExternalTensor)


def _memory(view: ModelView, plan: Plan, cluster: Any, weights: dict[int, set[tuple[str, Sharding]]],
            act: np.ndarray, held: np.ndarray) -> tuple[np.ndarray, list[tuple[float, float, float]]]:
    """Per rank: (weights, activations x copies in flight + the rest of the runtime's terms,
    resident graph outputs) and the peak, by the one rule :func:`partitioner.cost.memory.rank_peak`
    of the device's runtime (twice the largest local activation stands for the peak live bytes)."""
    mem = np.zeros(plan.world_size)
    parts = []
    inflight = activation_copies(plan.microbatches, plan.num_stages)
    inputs = float(sum(view.nbytes(n) for n in view.inputs))
    for r in range(plan.world_size):
        wb = mapped = 0.0
        for n, s in weights[r]:
            b = view.nbytes(n) / (len(s.ranks) if s.axis is not None else 1)
            if _is_external(view, n):  # kept as external data: mapped from rank<i>.data at run time
                mapped += b
            else:
                wb += b
        rule = runtime_memory(getattr(cluster.devices[r], "runtime", ""))
        t = rank_peak(rule, embedded_weight_bytes=float(wb), mapped_weight_bytes=float(mapped),
                      activation_bytes=float(2 * act[r] * inflight), global_input_bytes=inputs,
                      output_bytes=float(held[r]))
        out = t.outputs if rule.worker_buffers else float(held[r])  # the plain sum keeps them too
        steady = t.steady - t.outputs + out
        if t.load_peak > steady:  # the peak is the load: the library's copies of the weights
            parts.append((t.load_peak - t.runtime, t.runtime, 0.0))
        else:
            parts.append((t.weights, steady - t.weights - out, out))
        mem[r] = max(t.load_peak, steady)
    return mem, parts


def _step_latency(plan: Plan, busy: np.ndarray) -> float:
    """A pipeline's step from its stages' per-micro-batch times; otherwise the busiest rank."""
    if plan.num_stages <= 1:
        return float(busy.max())
    m = plan.microbatches
    stage_t = []
    for s in range(plan.num_stages):
        rs = plan.ranks_of_stage(s)
        stage_t.append(max(busy[r] for r in rs) / m if rs else 0.0)
    return pipeline_step_time(stage_t, [0.0] * (len(stage_t) - 1), m)


def _timing(plan: Plan, cluster: Any, compute: np.ndarray, comm: np.ndarray,
            ops: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, float]:
    """Per rank compute and comm with the fixed runtime costs the simulator
    charges (:mod:`partitioner.cost.runtime_overhead`: per run and per comm op of every
    micro-batch, the barrier that ends the step as comm), the busy time and the step latency."""
    w, m = plan.world_size, plan.microbatches
    compute = compute + np.array([rank_overhead(cluster.devices[r], m, ops[r]) for r in range(w)])
    sync = step_sync(cluster, w)
    latency = _step_latency(plan, compute + comm) + sync
    return compute, comm + sync, compute + comm + sync, latency


def estimate(view: ModelView, plan: Plan, cluster: Any, *, memory_limit: float | None = None,
             times: dict[int, np.ndarray] | None = None) -> Prediction:
    """Predict ``plan`` on ``cluster`` (see the module docstring)."""
    w = plan.world_size
    m = plan.microbatches
    times = times if times is not None else {}
    compute = np.zeros(w)
    comm = np.zeros(w)
    ops = np.zeros(w)  # comm ops each rank runs per micro-batch
    threads = rank_threads(cluster, w)  # fewer ranks than cores: threads per rank
    weights: dict[int, set[tuple[str, Sharding]]] = {r: set() for r in range(w)}
    act = np.zeros(w)
    held = np.zeros(w)  # graph outputs (logits, KV cache) stay resident until the step ends
    graph_outputs = set(view.outputs)
    levels: dict[str, float] = {}
    produced: dict[str, Sharding] = dict((k, v) for k, v in plan.tensors.items() if k in view.inputs)
    seen_conv: set[tuple[str, Sharding]] = set()
    for i, node in enumerate(view.nodes):
        np_ = plan.nodes[node.name]
        g = np_.ranks
        shard = max((len(s.ranks) for s in np_.outputs if s is not None and (s.axis is not None or s.partial)), default=1)
        w_full, w_local = _weight_bytes(view, node, np_.inputs)
        for dev, ranks_on in _by_device(cluster, g).items():
            t = shard_time(view, i, dev, shard, m, w_full, w_local, threads)
            for r in ranks_on:
                compute[r] += t
        for name, req in zip(view.node_inputs(node), np_.inputs):
            if not name or req is None:
                continue
            if view.is_const(name):
                for r in req.ranks:
                    weights[r].add((name, req))
                continue
            src = produced.get(name)
            if src is None or (name, req) in seen_conv:
                continue
            seen_conv.add((name, req))
            kind = conversion(src, req)
            if not communicates(kind):
                continue
            nbytes = view.nbytes(name) / m
            if kind == "send":
                s0 = src.ranks[0]
                for t in req.ranks:
                    if t not in src.ranks:
                        part = nbytes / (len(req.ranks) if req.axis is not None else 1)
                        sec = p2p_time(part, s0, t, cluster)
                        comm[t] += sec * m
                        comm[s0] += send_overhead(part, s0, t, cluster) * m  # the sender posts it
                        ops[s0] += 1
                        ops[t] += 1
                        lv = cluster.link(s0, t).name
                        levels[lv] = levels.get(lv, 0.0) + nbytes * m
            else:
                sec, per = comm_seconds(kind, nbytes, g, cluster)
                for r in g:
                    comm[r] += sec * m
                    ops[r] += 1
                for k, v in per.items():
                    levels[k] = levels.get(k, 0.0) + v * m
        for name, s in zip(view.node_outputs(node), np_.outputs):
            if s is not None:
                produced[name] = s
                local = view.nbytes(name) / m / (len(s.ranks) if s.axis is not None else 1)
                for r in g:
                    act[r] = max(act[r], local)
                if name in graph_outputs:
                    for r in g:
                        held[r] += local * m
    mem, parts = _memory(view, plan, cluster, weights, act, held)
    compute, comm, busy, latency = _timing(plan, cluster, compute, comm, ops)
    batch = view.batch_size()
    caps = [min(cluster.devices[r].memory_bytes, memory_limit or float("inf")) for r in range(w)]
    fits = all(mem[r] <= caps[r] for r in range(w))
    return Prediction(tuple(compute.tolist()), tuple(comm.tolist()), tuple(float(latency - b) for b in busy),
                      tuple(mem.tolist()), float(latency), float(batch / latency) if latency > 0 else float("inf"),
                      levels, fits, tuple(parts))
