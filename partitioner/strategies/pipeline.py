"""``pipeline``: contiguous stages over a topological order, one stage per device (or group).

Rules:
1. The order is the graph's topological order without constant-only nodes (these join the stage
   of their first consumer), so branches (Inception, U-Net skips) are cut like chains and every
   value crossing a boundary is sent to the stage that reads it.
2. :func:`best_split` is a dynamic programme over (stage, last node): it minimises the bottleneck
   max over stages of (stage time on that stage's device + the send after it) under each
   device's memory capacity; it is optimal for the order. Heterogeneous devices give their own
   node times, so faster devices take longer stages. Pinned ``pipeline_stage`` annotations
   (user constraints) bound where each stage may end.
3. The micro-batch count minimises the GPipe fill-drain step time among the divisors of the
   batch the model can be micro-batched by (or is the user's).
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np

from partitioner.core.errors import PlanError, StrategyNotApplicable
from partitioner.core.model_view import ModelView
from partitioner.core.plan import Plan, Sharding, pinned_stages
from partitioner.cost.pipeline import pipeline_step_time
from partitioner.strategies import batch_size, make_plan
from partitioner.strategies.costing import node_times, p2p_time
from partitioner.strategies.propagate import Assignment, batch_axes


def best_split(times: Sequence[np.ndarray], send: np.ndarray, mem: np.ndarray | None = None,
               caps: Sequence[float] | None = None, pins: Mapping[int, int] | None = None) -> tuple[list[int], float]:
    """Optimal contiguous split (rule 2). ``times[s][i]`` = node i on stage s's device; ``send[k]``
    = cost of cutting after node k. Returns (last node index of each stage, bottleneck)."""
    p, n = len(times), len(times[0])
    if n < p:
        raise StrategyNotApplicable(f"pipeline: {n} nodes cannot fill {p} stages")
    mem = np.zeros(n) if mem is None else np.asarray(mem, dtype=np.float64)
    caps = [float("inf")] * p if caps is None else list(caps)
    send = np.append(np.asarray(send, dtype=np.float64), 0.0)[:n]
    send[n - 1] = 0.0
    lo_end, hi_end = [0] * p, [n - 1] * p
    for i, s in (pins or {}).items():
        if not 0 <= s < p:
            raise StrategyNotApplicable(f"pipeline: node {i} is pinned to stage {s} but there are {p} stages")
        for st in range(s, p):
            lo_end[st] = max(lo_end[st], i)
        for st in range(0, s):
            hi_end[st] = min(hi_end[st], i - 1)
    mpre = np.concatenate([[0.0], np.cumsum(mem)])
    inf = float("inf")
    f = np.full(n, inf)
    arg = np.zeros((p, n), dtype=np.int64)
    pre = np.concatenate([[0.0], np.cumsum(times[0])])
    for k in range(n):
        if lo_end[0] <= k <= hi_end[0] and mpre[k + 1] <= caps[0]:
            f[k] = pre[k + 1] + send[k]
    js_all = np.arange(n)
    bound = _upper_bound(times, send, mpre, caps, n, p) if not pins else inf
    for s in range(1, p):
        pre = np.concatenate([[0.0], np.cumsum(times[s])])
        g = np.full(n, inf)
        ks_all = np.arange(max(s, lo_end[s]), min(n - 1, hi_end[s]) + 1)
        # vectorised over (k, j) in row blocks: cost of stage s covering nodes j+1..k
        # a stage longer than a known feasible bottleneck cannot be optimal: only columns j with
        # T(j+1..k) + send[k] <= bound are candidates (pruning keeps the DP exact)
        # send[k] = inf (a fusion group must not be cut after k) with bound = inf gives NaN;
        # searchsorted puts NaN past the end, so k gets no candidate columns, as it should
        with np.errstate(invalid="ignore"):
            jlo = np.maximum(np.searchsorted(pre, pre[ks_all + 1] + send[ks_all] - bound * (1 + 1e-12), "left") - 1, s - 1)
        for start in range(0, len(ks_all), 256):
            ks = ks_all[start:start + 256][:, None]
            c0 = int(jlo[start:start + 256].min())
            cols = js_all[c0:int(ks[-1, 0])]
            if cols.size == 0:
                continue
            cost = pre[ks + 1] - pre[cols + 1][None, :] + send[ks]
            ok = ((mpre[ks + 1] - mpre[cols + 1][None, :]) <= caps[s]) & (cols[None, :] >= s - 1) & (cols[None, :] < ks)
            val = np.where(ok, np.maximum(f[cols][None, :], cost), inf)
            b = np.argmin(val, axis=1)
            rows = ks[:, 0]
            g[rows] = val[np.arange(len(rows)), b]
            arg[s, rows] = cols[b]
        f = g
    if not np.isfinite(f[n - 1]):
        raise StrategyNotApplicable(f"pipeline: no split into {p} stages fits the devices' memory "
                                    "(or the pinned stages)")
    ends = [n - 1]
    for s in range(p - 1, 0, -1):
        ends.append(int(arg[s, ends[-1]]))
    return ends[::-1], float(f[n - 1])


def _split_cost(times, send, mpre, caps, ends) -> float:
    """Bottleneck of a given split, or inf when a stage is empty or over its memory cap."""
    start, worst = 0, 0.0
    for s, e in enumerate(ends):
        if e < start or mpre[e + 1] - mpre[start] > caps[s]:
            return float("inf")
        worst = max(worst, float(np.sum(times[s][start:e + 1])) + float(send[e]))
        start = e + 1
    return worst


def _upper_bound(times, send, mpre, caps, n: int, p: int) -> float:
    """A feasible bottleneck (equal node counts or equal time), used only to prune the DP."""
    pre0 = np.cumsum(times[0])
    total = float(pre0[-1]) if n else 0.0
    splits = [[(s + 1) * n // p - 1 for s in range(p)]]
    if total > 0:
        by_time = [min(n - p + s, max(s, int(np.searchsorted(pre0, total * (s + 1) / p)))) for s in range(p)]
        by_time[-1] = n - 1
        splits.append(by_time)
    return min(_split_cost(times, send, mpre, caps, e) for e in splits)


def brute_force_split(times: Sequence[np.ndarray], send: np.ndarray) -> float:
    """Exhaustive bottleneck over all contiguous splits (for tests on small chains)."""
    from itertools import combinations

    p, n = len(times), len(times[0])
    best = float("inf")
    for cuts in combinations(range(n - 1), p - 1):
        ends = list(cuts) + [n - 1]
        start, worst = 0, 0.0
        for s, e in enumerate(ends):
            t = float(np.sum(times[s][start:e + 1])) + (float(send[e]) if e < n - 1 else 0.0)
            worst = max(worst, t)
            start = e + 1
        best = min(best, worst)
    return best


def cut_bytes(view: ModelView, order: list[str]) -> np.ndarray:
    """Bytes of the values produced at or before position k and read after it (per micro-batch 1)."""
    pos = {name: i for i, name in enumerate(order)}
    n = len(order)
    diff = np.zeros(n + 1)
    for name in order:
        node = view.node_by_name[name]
        for v in view.node_outputs(node):
            users = [pos[u] for u in view.consumers.get(v, []) if u in pos]
            last = max(users, default=-1)
            if v in view.outputs:
                last = max(last, n - 1)
            i = pos[name]
            if last > i:
                b = view.nbytes(v)
                diff[i] += b
                diff[last] -= b
    return np.cumsum(diff)[:n]


def node_weight_bytes(view: ModelView, order: list[str]) -> np.ndarray:
    """Initializer bytes charged to the first node (in ``order``) that reads them."""
    seen: set[str] = set()
    out = np.zeros(len(order))
    const_nodes = view.constant_nodes
    for i, name in enumerate(order):
        node = view.node_by_name[name]
        for v in view.node_inputs(node):
            if v and v not in seen and (view.is_const(v) or view.producer.get(v) in const_nodes):
                seen.add(v)
                out[i] += view.nbytes(v)
    return out


def stage_assignment(view: ModelView, groups: Sequence[tuple[int, ...]], mode: str, cluster: Any,
                     memory_limit: float | None = None, shard_memory: bool = False) -> tuple[dict[str, Assignment], list[int], float]:
    """Assign every node to a stage on ``groups[s]`` by :func:`best_split`; returns (assignment,
    stage end positions, bottleneck seconds)."""
    const_nodes = view.constant_nodes
    order = [n.name for n in view.nodes if n.name not in const_nodes]
    idx = [view.index[n] for n in order]
    p = len(groups)
    times = []
    for g in groups:
        t = node_times(view, cluster.devices[g[0]])[idx]
        times.append(t / len(g))
    bytes_ = cut_bytes(view, order)
    send = np.array([p2p_time(b / max(1, len(groups[0])), groups[0][0], groups[min(1, p - 1)][0], cluster)
                     if p > 1 else 0.0 for b in bytes_])
    send[fused_group_interior(view, order)] = np.inf  # a stage boundary never cuts a fusion group
    mem = node_weight_bytes(view, order)
    if shard_memory:
        mem = mem / len(groups[0])
    caps = [min(cluster.devices[g[0]].memory_bytes, memory_limit or float("inf")) for g in groups]
    pins_by_name = pinned_stages(view.model)
    pos = {name: i for i, name in enumerate(order)}
    pins = {pos[n]: s for n, s in pins_by_name.items() if n in pos}
    ends, bottleneck = best_split(times, send, mem, caps, pins)
    assign: dict[str, Assignment] = {}
    start = 0
    for s, e in enumerate(ends):
        for i in range(start, e + 1):
            assign[order[i]] = Assignment(tuple(groups[s]), s, mode)
        start = e + 1
    for node in reversed(view.nodes):  # constant-only nodes join their first consumer's stage
        if node.name in assign:
            continue
        stages = [assign[u] for v in view.node_outputs(node) for u in view.consumers.get(v, []) if u in assign]
        assign[node.name] = min(stages, key=lambda a: a.stage) if stages else Assignment(tuple(groups[0]), 0, mode)
    return assign, ends, bottleneck


def fused_group_interior(view: ModelView, order: Sequence[str]) -> np.ndarray:
    """Positions k where a cut between order[k] and order[k+1] would split a fusion group (the
    ``partitioner.fusion_group`` annotation of :mod:`passes.fusion_groups`): a fused group is
    compiled as one kernel, so the partitioner treats it as one unit."""
    from passes.fusion_groups import group_of

    span: dict[str, list[int]] = {}
    for i, name in enumerate(order):
        gid = group_of(view.node_by_name[name])
        if gid:
            span.setdefault(gid, [i, i])[1] = i
    inside = np.zeros(len(order), dtype=bool)
    for lo, hi in span.values():
        inside[lo:hi] = True
    return inside


def choose_microbatches(view: ModelView, stage_times: Sequence[float], send: float, p: int, split: int = 1) -> int:
    """Rule 3: the divisor m of the batch (micro-batchable) with the smallest fill-drain step;
    ``split`` = how many ranks further split each micro-batch (data-parallel stages)."""
    try:
        b = batch_size(view) // split
    except StrategyNotApplicable:
        return 1
    best, best_t = 1, pipeline_step_time(list(stage_times), [send] * (len(stage_times) - 1), 1)
    for m in range(2, min(b, 8 * p) + 1):
        if b % m:
            continue
        t = pipeline_step_time([x / m + 1e-6 for x in stage_times], [send / m + 1e-6] * (len(stage_times) - 1), m)
        if t < best_t:
            try:
                batch_axes(view, m)
            except StrategyNotApplicable:
                break
            best, best_t = m, t
    return best


def plan(view: ModelView, cluster: Any, *, degree: int | None = None, microbatches: int | None = None,
         memory_limit: float | None = None, objective: str = "latency") -> Plan:
    p = degree or cluster.size
    if p < 2:
        raise StrategyNotApplicable("pipeline parallelism needs at least 2 devices")
    return build(view, cluster, [(r,) for r in range(p)], "replicate", "pipeline", microbatches, memory_limit)


def build(view: ModelView, cluster: Any, groups: list[tuple[int, ...]], mode: str, strategy: str,
          microbatches: int | None, memory_limit: float | None) -> Plan:
    """A pipeline over ``groups`` whose stages run in ``mode`` (replicate, data or tensor)."""
    assign, ends, bottleneck = stage_assignment(view, groups, mode, cluster, memory_limit,
                                                shard_memory=(mode == "tensor"))
    p = len(groups)
    stage_times = [bottleneck] * p
    m = microbatches or choose_microbatches(view, stage_times, 0.0, p, len(groups[0]) if mode == "data" else 1)
    world = sum(len(g) for g in groups)
    inputs = {}
    for n in view.inputs:
        users = [assign[u] for u in view.consumers.get(n, [])]
        a = min(users, key=lambda x: x.stage) if users else assign[view.nodes[0].name]
        axis = 0 if (mode == "data" and view.rank(n) >= 1) else None
        inputs[n] = Sharding(a.ranks, axis if len(a.ranks) > 1 else None)
    mesh = (p,) if all(len(g) == 1 for g in groups) else (p, len(groups[0]))
    axes = ("pipeline",) if len(mesh) == 1 else ("pipeline", mode)
    try:
        return make_plan(view, strategy, world, mesh, axes, assign, inputs, microbatches=m, num_stages=p,
                         notes=f"{p} stages, bottleneck {bottleneck * 1e3:.3f} ms, {m} micro-batches")
    except PlanError:
        raise
