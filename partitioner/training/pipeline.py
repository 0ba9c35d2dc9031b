"""Pipeline-parallel training: the step cut into stages, run as GPipe or 1F1B over micro-batches.

Rules (numbered; ``tests/training/test_pipeline_training.py`` checks them):

1. Stages are contiguous ranges of the forward graph's nodes (topological order) chosen by the
   pipeline strategy's stage DP (:func:`partitioner.strategies.pipeline.best_split`) over each
   node's training cost, with the bytes crossing each cut as the send cost. The cost is the
   node's forward+backward seconds measured by an ONNX Runtime profile (for TVM plans too:
   :mod:`partitioner.training.measured_cut`), else the cost model's (forward FLOPs x 3: the
   backward is about twice the forward); ``PipelinePlan.cut`` says which. A weight read by two
   stages is refused (tied weights would need their gradients summed across ranks).
2. Every stage but the last has two programs per micro-batch: ``F`` (its forward: the values
   later stages read, plus the *stash*) and ``B`` (its backward: from the stash and the gradients
   of the values it sent, the gradients of the values it received and of its weights). ``F`` is
   exactly the ancestors of what the stage sends (and of its BatchNormalization statistics);
   ``B`` is every other node; the stash is every value ``F`` has (inputs included) that ``B``
   reads. The last stage runs forward, loss and backward as one program per micro-batch.
3. Activations go forward and their gradients backward as point-to-point messages of the
   project's communicators (``send`` is non-blocking on both the in-process and the MPI one), one
   tag per (micro-batch, value, direction).
4. Gradients are accumulated over the ``M`` micro-batches (a sum in the rank), then one update
   program per stage applies ``optimizer(W, sum / M)``: with equal micro-batches the mean of the
   micro-batch mean losses' gradients is the global batch's mean gradient, so a pipeline step
   equals a 1-rank step of the same global batch (up to float summation order).
5. Schedules: ``gpipe`` runs every micro-batch's ``F`` (fill), then every ``B`` in reverse
   (drain): ``M`` stashes in flight. ``1f1b`` runs ``S - s - 1`` warm-up forwards on stage ``s``,
   then alternates one forward and one backward, then drains: at most ``S - s`` stashes in flight.
   The peak is recorded (``PipelineRunner.peak_stash``). With the plan's extra warm-up ``e``
   (``PipelinePlan.extra_warmup``: :func:`extra_warmup` of its backend, 1 on ONNX Runtime and 0
   on TVM by :data:`EXTRA_WARMUP_BY_BACKEND`) the stages before the last run ``e`` more warm-up
   forwards (``S - s + e`` stashes): on 2 stages stage 0's ``F(m)`` then waits for ``B(m-2-e)``
   instead of ``B(m-2)``, so the last stage's ``FB(m)`` no longer waits for a chain through both
   ranks and two messages when the stages are balanced (for models where that chain, not the
   slower stage, sets the step). The stage DP and the cost model count the same stashes
   (:func:`in_flight`); under ``memory_limit`` the plan drops ``e`` before recompute
   (:func:`warmup_cut`). With ``PLANNED_WARMUP`` (off) the plan chooses ``e`` itself by
   simulating its step both ways (:func:`chosen_warmup`).
6. State names are the 1-rank step's (``W``, ``W.m``, ``W.v``, ``W.velocity``,
   ``optimizer.step``, BN statistics); each stage holds its own weights' state (``optimizer.step``
   in every stage), so a checkpoint gathered from the stages is a 1-rank checkpoint.
7. BatchNormalization uses each micro-batch's statistics and updates its running statistics once
   per micro-batch (as GPipe does); pipeline equivalence with 1 rank holds for models without it.
8. Recompute (activation checkpointing), chosen by the planner when no split fits
   ``--memory-limit`` otherwise (:func:`stage_cut`): a stage but the last stashes only its inputs
   (the received values and the data it reads) and its ``B`` recomputes the forward before the
   backward: one micro-batch's activations live at a time, for one more forward per micro-batch.
9. (Weight-only work hoisted into a ``prepare`` program on TVM plans: :mod:`partitioner.training.hoist`.)
10. Deferred weight gradients (:mod:`partitioner.training.deferred_wgrad`, knob
    ``DEFER_WEIGHT_GRADIENTS``), on the last stage only: its per-micro-batch fused program
    computes only the loss and the gradients that leave the stage or feed earlier layers; its
    weight gradients run once per step in the ``weight_grad`` program built at the whole batch,
    on the micro-batches' ``w_stash`` values concatenated on their ``w_axes``, while the earlier
    stages drain. That sum replaces rule 4's accumulation for the deferred weights (rule 4
    still holds for the rest). An earlier stage's deferred program would run after its own last
    backward, on the step's critical path (deferred_wgrad rule 5). ONNX Runtime plans only, and
    only when measured prices say the step gets shorter (:func:`deferred_cut`, from
    measured_cut rule 7's rows; the cut then prices the last stage's nodes as it runs them).
    Not with ``--memory-limit`` or recompute (the deferred values stay alive for all ``M``
    micro-batches). Where the last stage's weight gradients are too big to defer the whole batch's
    (ONNX Runtime and TVM plans), it defers its last ``K`` micro-batches' (deferred_wgrad rule 7, the ZB-H1 tail:
    ``Stage.fused`` for the first ``M - K``, ``Stage.fused_tail`` for the last ``K``, then
    ``weight_grad`` built at ``K`` micro-batches; ``Stage.w_tail`` = ``K``, or ``M`` for the
    whole batch).
11. Where the last stage is the slower by more than a few columns of its first product's work,
    that product is split by output columns across the last cut
    (:mod:`partitioner.training.split_cut`, knob ``SPLIT_ACROSS_CUT``, off: measured 0-4% on the
    zoo mlp's replayed step, split_cut rule 6): the stage before runs the first part, the last
    stage the rest; the stages hold the parts' state (``PipelinePlan.parts``), joined back under
    rule 6's names.
12. The last stage's first product's weight gradient is split by output columns across the last
    cut (:mod:`partitioner.training.moved_wgrad`, knob ``MOVE_BY_BACKEND``: TVM on, ONNX Runtime
    off): the last stage sends the output gradient's moved columns back beside the input gradient,
    the stage before computes their weight-gradient columns from the ``x`` it sent (stashed) and
    sends their sum once per step, before the update. No forward work moves; the weight stays on
    the last stage. A 1F1B plan with moved columns (no memory limit) runs at least one extra
    warm-up forward (rule 5; moved_wgrad rule 6).
13. On TVM stages rule 4's sum runs inside the per-micro-batch programs
    (:func:`partitioner.training.pipeline_runner.accumulating`, knob
    ``pipeline_runner.ACCUMULATE_IN_PROGRAM``): ``B``, ``FB`` and ``FBt`` output ``W.grad.acc + g``
    from the previous call's sum (zeros on the first), the add on the weight gradient's MatMul /
    Gemm product where there is one (TVM fuses it into that kernel). Rule 10's deferred gradients
    and rule 12's moved columns are still added in the rank.
14. On TVM plans, with ``nhwc_stash.NHWC_STASH`` (off by default: no paired win, nhwc_stash
    rule 4), a stage's ``F`` returns the 4-d activations it stashes for ``B`` in NHWC, the layout
    TVM runs its convolutions in (:mod:`partitioner.training.nhwc_stash`): a ``Transpose`` pair
    at the stash boundary that TVM folds into its own layout permutes on both sides; sent values,
    rule 10's ``w_stash`` and values ``B``'s im2col reads keep the model's layout.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import os

import numpy as np
import onnx
import onnx_ir as ir
from onnx import helper

from partitioner.core.errors import UsageError
from partitioner.training import moved_wgrad, nhwc_stash, split_cut
from partitioner.training.autodiff import Emitter, backward, is_float
from partitioner.training.losses import emit_loss, label_spec, loss_input
from partitioner.training.optimizers import STEP_NAME, Optimizer
from partitioner.training.step import STEP_OPSET, _checked_forward, _infer, _load, _optimizer_updates, _promote

SCHEDULES = ("gpipe", "1f1b")
TAG_BASE = 20000
#: rule 5: how many more warm-up forwards 1F1B's stages before the last run (and micro-batches they
#: stash), per backend (:func:`extra_warmup`). ONNX Runtime 1: paired 2-rank MPI pipelines 1F1B x8
#: (session 12, quiet, 3 rounds): bert 198.1 -> 182.8 ms and resnet 303.7 -> 278.1 ms, faster in each
#: round; mlp 189.5 -> 193.7 (mixed rounds: noise). TVM 0: bert 162.7 -> 167.3 ms, slower in each
#: round (why is not measured). A backend not listed gets 0 (the plain schedule)
EXTRA_WARMUP_BY_BACKEND: dict[str, int] = {"onnxruntime": 1, "tvm": 0}
#: ``PARTITIONER_TRAIN_PIPE_EXTRA_WARMUP=N`` (in MPI ranks too) overrides the table for every backend,
#: both ways (``=0`` turns it off on ONNX Runtime); None: the table decides
_ENV_WARMUP = os.environ.get("PARTITIONER_TRAIN_PIPE_EXTRA_WARMUP")
EXTRA_WARMUP: int | None = int(_ENV_WARMUP) if _ENV_WARMUP not in (None, "") else None


#: rule 5: the plan chooses its extra warm-up (0 or 1) by simulating its 1F1B step both ways
#: (:func:`chosen_warmup`) wherever rule 1's cut has measured node prices; off (or a cost-model
#: cut): :data:`EXTRA_WARMUP_BY_BACKEND` decides. Off by default: the simulation prices a message
#: at the calibrated link's time (a few microseconds for the zoo's cuts), and with it it does not
#: reproduce the measured gain of the ONNX Runtime resnet at batch 16 (paired, quiet, session 12:
#: 303.7 -> 278.1 ms with the extra warm-up; the simulation, from the measured stage prices 36.3 /
#: 39.4 ms: no gain, so it would drop it). What the extra forward hides there is the ranks'
#: wake-up and jitter around a message, which nothing calibrates yet (docs/training.md, rule 5)
PLANNED_WARMUP = False
#: rule 5: the share of the simulated step the extra warm-up must save to be kept. The simulation
#: prices neither its cost in memory traffic (one more micro-batch of stashed activations alive)
#: nor the ranks' jitter it absorbs; a gain below this is left to the smaller stash
WARMUP_MIN_GAIN = 0.01

#: rule 1: a forced cut, for measuring one cut against another (``benchmarks/pipeline_stages.py
#: --cuts``): the names of the last forward node of each stage but the last; None: the stage DP
#: decides. ``PARTITIONER_TRAIN_PIPE_CUT_AFTER=name[,name...]`` sets it (in MPI ranks too). Not a
#: tuning knob: a name the model lacks, or a count other than ``stages - 1``, is a usage error
_ENV_CUT = os.environ.get("PARTITIONER_TRAIN_PIPE_CUT_AFTER")
CUT_AFTER: tuple[str, ...] | None = tuple(_ENV_CUT.split(",")) if _ENV_CUT else None


def forced_ends(graph: ir.Graph, stages: int, ends: list[int]) -> list[int]:
    """Rule 1 with :data:`CUT_AFTER`: the stages ending after the named nodes (and the last node);
    ``ends`` (the DP's) when it is None."""
    if CUT_AFTER is None:
        return ends
    names = [n.name for n in graph]
    idx = [names.index(c) for c in CUT_AFTER if c in names]
    ordered = idx == sorted(set(idx)) and (not idx or idx[-1] < len(names) - 1)
    if len(idx) != len(CUT_AFTER) or len(idx) != stages - 1 or not ordered:
        raise UsageError(f"pipeline cut after {','.join(CUT_AFTER)}: expected {stages - 1} node name(s) of the model, "
                         f"in order, none its last node")
    return idx + [len(names) - 1]


def extra_warmup(backend: str | None) -> int:
    """Rule 5: the extra warm-up forwards a 1F1B plan for ``backend`` runs on its stages before
    the last (``EXTRA_WARMUP`` when set, else ``EXTRA_WARMUP_BY_BACKEND``; ONNX Runtime when None,
    as :func:`build_pipeline` defaults). The plan records it (``PipelinePlan.extra_warmup``): the
    runner's order, the stage DP's in-flight counts and the cost model's stash all read it."""
    if EXTRA_WARMUP is not None:
        return max(int(EXTRA_WARMUP), 0)
    return EXTRA_WARMUP_BY_BACKEND.get(backend or "onnxruntime", 0)


@dataclass
class Stage:
    """One pipeline stage's programs and the values it exchanges (rule 2)."""

    index: int
    recv: list[tuple[int, str]]  # (producer stage, value) received each micro-batch, in order
    send: list[tuple[int, str]]  # (consumer stage, value) sent each micro-batch, in order
    data: list[str]
    weights: list[str]
    grad_in: list[str]  # received float values that get a gradient (sent back)
    bn_state: list[tuple[str, str]]
    forward: onnx.ModelProto | None = None
    backward: onnx.ModelProto | None = None
    fused: onnx.ModelProto | None = None
    update: onnx.ModelProto | None = None
    prepare: onnx.ModelProto | None = None  # rule 9: weight-only work, once per step
    weight_grad: onnx.ModelProto | None = None  # rule 10: deferred weight gradients, once per step
    fused_tail: onnx.ModelProto | None = None  # rule 10's tail: the last w_tail micro-batches' fused program
    w_tail: int = 0  # rule 10: how many trailing micro-batches weight_grad covers (M: all of them)
    w_stash: list[str] = field(default_factory=list)  # rule 10: values it reads from every micro-batch
    w_axes: dict[str, int] = field(default_factory=dict)  # rule 10: their batch axes
    stash: list[str] = field(default_factory=list)
    initial: dict[str, np.ndarray] = field(default_factory=dict)
    update_pairs: list[tuple[str, str]] = field(default_factory=list)
    moved: Any = None  # rule 12: moved_wgrad.Moved, this stage's side of the moved weight-gradient columns


@dataclass
class Defer:
    """Rule 10's build settings: ``whole`` is the stage's program built at the ``micro_batches``
    micro-batches it defers (None while building it); ``tail``: those are the step's last ones
    (deferred_wgrad rule 7), the others keep the full program."""

    whole: onnx.ModelProto | None
    micro_batches: int
    tail: bool = False


@dataclass
class PipelinePlan:
    """The stages of a pipelined step and the run's settings."""

    stages: list[Stage]
    micro_batches: int
    micro_batch: int
    batch: int  # samples one pipeline replica runs per step
    schedule: str
    loss: str
    labels: str
    optimizer: Optimizer
    value_ids: dict[str, int]  # one id per exchanged value (message tags)
    recompute: bool = False  # rule 8: stages but the last recompute their forward in B
    cut: str = "cost model"  # rule 1: which node costs the stage DP balanced
    parts: dict[str, tuple[str, int, int]] = field(default_factory=dict)  # rule 11: split_cut.parts_of
    extra_warmup: int = 0  # rule 5: 1F1B's extra warm-up forwards on the stages before the last

    @property
    def num_stages(self) -> int:
        return len(self.stages)


def stage_ends(graph: ir.Graph, stages: int, *, memory_limit: float | None = None, state_copies: int = 0,
               in_flight: Sequence[int] | None = None, seconds: np.ndarray | None = None) -> list[int]:
    """Rule 1's cut: the last node index of each stage (:func:`stage_cut`, recompute aside)."""
    return stage_cut(graph, stages, memory_limit=memory_limit, state_copies=state_copies, in_flight=in_flight,
                     seconds=seconds)[0]


def stage_cut(graph: ir.Graph, stages: int, *, memory_limit: float | None = None, state_copies: int = 0,
              in_flight: Sequence[int] | None = None, seconds: np.ndarray | None = None,
              last_seconds: np.ndarray | None = None) -> tuple[list[int], bool]:
    """Rule 1: the last node index of each stage, by the pipeline strategy's DP, and whether the
    stages recompute (rule 8). With ``memory_limit`` every stage must fit it: stage s holds its
    trainable weights as the training cost model counts them (``state_copies`` optimizer copies)
    plus its nodes' outputs x ``in_flight[s]`` (its stashed micro-batches: ``M`` for GPipe,
    ``min(S - s, M)`` for 1F1B); the bottleneck is then minimised over the splits that fit
    (:func:`_memory_split`). When no split fits, the planner tries recompute: a stage but the last
    then stashes only its inputs and holds one micro-batch's activations (rule 8). ``seconds``:
    measured seconds per node in place of the FLOPs (:mod:`partitioner.training.measured_cut`
    rule 4: a byte sent still weighs a thousand FLOPs' time, at the measured seconds per FLOP);
    ``last_seconds``: the last stage's node prices when it defers its weight gradients (rule 10)."""
    from partitioner.core.errors import StrategyNotApplicable
    from partitioner.cost.ops import nbytes, op_cost
    from partitioner.strategies.pipeline import best_split

    nodes = list(graph)
    flops = np.array([max(float(op_cost(n).flops), 1.0) * 3.0 for n in nodes])
    pos = {id(n): i for i, n in enumerate(nodes)}
    diff = np.zeros(len(nodes) + 1)
    for i, n in enumerate(nodes):
        for o in n.outputs:
            last = max((pos[id(u)] for u, _ in o.uses() if id(u) in pos), default=i)
            if last > i:
                diff[i] += nbytes(o)
                diff[last] -= nbytes(o)
    cut = np.cumsum(diff)[:len(nodes)]  # bytes crossing the cut after each node
    send = cut * 1e-3  # a byte sent costs about a thousand FLOPs' time
    if seconds is not None:
        send, flops = send * (float(np.sum(seconds)) / float(np.sum(flops))), np.asarray(seconds, dtype=float)
    if memory_limit is not None:
        flight = list(in_flight) if in_flight is not None else [1] * stages
        try:
            return _memory_split(graph, flops, send, stages, float(memory_limit), state_copies, flight), False
        except UsageError:
            data = float(sum(nbytes(v) for v in graph.inputs))
            return _memory_split(graph, flops, send, stages, float(memory_limit), state_copies, flight,
                                 np.concatenate([[data], cut[:-1]])), True
    last = flops if last_seconds is None or seconds is None else np.asarray(last_seconds, dtype=float)
    try:
        ends, _ = best_split([flops] * (stages - 1) + [last], send)
    except StrategyNotApplicable as exc:
        raise UsageError(f"pipeline training on {stages} stages: {exc}") from None
    return ends, False


def warmup_bound(backend: str | None, seconds: np.ndarray | None) -> int:
    """Rule 5: the most extra warm-up a 1F1B plan may keep, before the cut (the stage DP's stash
    counts under ``memory_limit`` read it: :func:`warmup_cut`): ``EXTRA_WARMUP`` when set; 1 where
    :func:`chosen_warmup` will simulate (``PLANNED_WARMUP`` and measured node ``seconds``); else the
    backend's table entry (:func:`extra_warmup`)."""
    if EXTRA_WARMUP is None and PLANNED_WARMUP and seconds is not None:
        return 1
    return extra_warmup(backend)


def warmup_step_times(graph: ir.Graph, ends: list[int], micro_batches: int, seconds: np.ndarray,
                      defer: bool = False, cluster: Any = None) -> list[float]:
    """Rule 5: the 1F1B step simulated (:func:`partitioner.cost.pipeline.simulated_step_time`)
    with no extra warm-up and with one, from what the planner already has: each stage's measured
    seconds per micro-batch (rule 1's node prices at the micro-batch, ``seconds``; a deferring
    last stage at its deferring prices, measured_cut rule 7's second row), split a third forward
    and two thirds backward (the backward about twice the forward, rule 1), and each cut's
    message both ways priced by the cost model's link (``collective_time("send")`` of the bytes
    crossing it, on ``cluster``, default ``cpu:S``)."""
    from partitioner.cluster import resolve_cluster
    from partitioner.cost.comm import collective_time
    from partitioner.cost.pipeline import simulated_step_time
    from partitioner.cost.training import cut_bytes

    rows = np.atleast_2d(np.asarray(seconds, dtype=float))
    starts = [0] + [e + 1 for e in ends[:-1]]
    last = len(ends) - 1
    total = [float(rows[1 if defer and s == last else 0][a:b + 1].sum()) for s, (a, b) in enumerate(zip(starts, ends))]
    cl = resolve_cluster(cluster if cluster is not None else f"cpu:{len(ends)}")
    sends = [collective_time("send", cut_bytes(graph, e), [k, k + 1], cl).seconds for k, e in enumerate(ends[:-1])]
    return [simulated_step_time([t / 3 for t in total], [2 * t / 3 for t in total], sends, micro_batches, "1f1b", e)
            for e in (0, 1)]


def chosen_warmup(graph: ir.Graph, ends: list[int], micro_batches: int, seconds: np.ndarray | None, bound: int,
                  defer: bool = False) -> int:
    """Rule 5's choice for a 1F1B plan, after the cut (``bound``: :func:`warmup_bound`, 0 once the
    memory limit dropped it): the extra warm-up is kept when :func:`warmup_step_times` says it
    shortens the step by at least ``WARMUP_MIN_GAIN``. On 2 stages (``t0``, ``t1`` a micro-batch,
    ``c`` one message) it pays (a) when the stages are balanced within the round trip (``|t1 -
    t0| < 2 c``: without it every micro-batch waits ``c - |t1 - t0| / 2`` for a chain through both
    ranks and both messages, the chain the extra forward spreads over one more micro-batch), or
    (b) once per step when stage 0 is the slower (``t0 > t1``): after its warm-up forwards its
    first ``B`` waits for the last stage's first ``FB``, about ``t1 + 2 c - f0`` with ``f0`` its
    forward; the extra forward fills ``f0`` of it. Where the last stage is the slower by more than
    the round trip the extra forward only stashes one more micro-batch (no gain; with 3 or more
    stages a later first backward can even lengthen the step).
    ``EXTRA_WARMUP``, ``PLANNED_WARMUP`` off or no measured ``seconds`` (a cost-model cut):
    ``bound`` as the table gave it."""
    if not bound or EXTRA_WARMUP is not None or not PLANNED_WARMUP or seconds is None:
        return bound
    without, with_one = warmup_step_times(graph, ends, micro_batches, seconds, defer)
    return int(with_one < (1.0 - WARMUP_MIN_GAIN) * without)


def warmup_cut(graph: ir.Graph, stages: int, schedule: str, micro_batches: int, extra: int,
               **cut: Any) -> tuple[list[int], bool, int]:
    """Rules 1, 5 and 8: :func:`stage_cut` with the stages' in-flight counts, and the extra warm-up
    the plan keeps. Under ``memory_limit`` the extra warm-up (one more stashed micro-batch on the
    stages before the last) is kept only when a split fits with it without recompute; else it is
    dropped before recompute or a refusal: it buys a message's latency, a recomputed forward per
    micro-batch costs far more (the plan, the runner and the cost model then all use 0)."""
    if extra and cut.get("memory_limit") is not None:
        try:
            ends, recompute = stage_cut(graph, stages, in_flight=in_flight(schedule, stages, micro_batches, extra),
                                        **cut)
            if not recompute:
                return ends, False, extra
        except UsageError:
            pass
        extra = 0
    ends, recompute = stage_cut(graph, stages, in_flight=in_flight(schedule, stages, micro_batches, extra), **cut)
    return ends, recompute, extra


def _memory_split(graph: ir.Graph, flops: np.ndarray, send: np.ndarray, stages: int, limit: float, copies: int,
                  in_flight: list[int], recompute_inputs: np.ndarray | None = None) -> list[int]:
    """The contiguous split of least bottleneck (stage work + its send) whose every stage fits
    ``limit`` with its own in-flight count (a DP over (stage, last node)). With
    ``recompute_inputs`` (bytes a stage starting at node i receives) a stage but the last holds
    one micro-batch's activations plus its inputs x its in-flight count (rule 8)."""
    from partitioner.cost.ops import nbytes
    from partitioner.cost.training import PIPELINE_GRADIENT_COPIES, resident_bytes
    from partitioner.training.step import default_trainable

    nodes = list(graph)
    n = len(nodes)
    trainable, seen = set(default_trainable(graph)), set()
    wmem, amem = np.zeros(n), np.zeros(n)
    for i, node in enumerate(nodes):
        amem[i] = sum(nbytes(o) for o in node.outputs)
        for v in node.inputs:
            if v is not None and v.name in trainable and v.name not in seen:
                seen.add(v.name)
                wmem[i] += resident_bytes(nbytes(v), copies, 0.0, PIPELINE_GRADIENT_COPIES)  # cost rule 3
    pt, pw, pa = (np.concatenate([[0.0], np.cumsum(a)]) for a in (flops, wmem, amem))
    send = send.copy()
    send[-1] = 0.0
    inf = float("inf")
    f = np.full((stages, n), inf)
    arg = np.zeros((stages, n), dtype=np.int64)
    ks = np.arange(n)
    def held(s: int, k: int, j: np.ndarray) -> np.ndarray:  # stage s = nodes j+1..k
        act = pa[k + 1] - pa[j + 1]
        if recompute_inputs is None or s == stages - 1:
            return pw[k + 1] - pw[j + 1] + act * in_flight[s]
        return pw[k + 1] - pw[j + 1] + act + recompute_inputs[j + 1] * in_flight[s]

    fits0 = held(0, ks, np.full(n, -1)) <= limit
    f[0] = np.where(fits0, pt[ks + 1] + send, inf)
    for s in range(1, stages):
        for k in range(s, n):
            j = np.arange(s - 1, k)  # the previous stage ends at j
            fits = held(s, k, j) <= limit
            val = np.where(fits, np.maximum(f[s - 1][j], pt[k + 1] - pt[j + 1] + send[k]), inf)
            b = int(np.argmin(val))
            f[s][k], arg[s][k] = val[b], j[b]
    if not np.isfinite(f[stages - 1][n - 1]):
        raise UsageError(f"pipeline training: no split into {stages} stages fits --memory-limit "
                         f"{limit / 2**20:.1f} MiB per device (weights, gradients, optimizer state and stashed "
                         "activations); use more devices or a larger limit")
    ends = [n - 1]
    for s in range(stages - 1, 0, -1):
        ends.append(int(arg[s][ends[-1]]))
    return ends[::-1]


def build_pipeline(model: Any, loss: str, optimizer: Optimizer, *, batch: int, stages: int, micro_batches: int,
                   schedule: str = "1f1b", trainable: Sequence[str] | None = None,
                   label_name: str = "labels", memory_limit: float | None = None,
                   backend: str = "onnxruntime", comm: Any = None, ranks: Sequence[int] = ()) -> PipelinePlan:
    """Rules 1-2 and 9: the stages' F/B (or fused), prepare and update programs for micro-batches
    of ``batch / M``, for ``backend`` (rule 1's measured cut and rule 9's Gemm rewrite depend on
    it). On MPI ranks (``comm``), ``ranks[0]`` measures the cut's node costs for all ``ranks``."""
    from partitioner.training.hoist import hoist_stage_programs
    from partitioner.training.measured_cut import COST_MODEL, MEASURED, shared_node_seconds
    from partitioner.training.step import default_trainable

    if schedule not in SCHEDULES:
        raise UsageError(f"unknown pipeline schedule {schedule!r}; choose one of {', '.join(SCHEDULES)}")
    if micro_batches < 1 or batch % micro_batches:
        raise UsageError(f"--batch {batch} does not split into {micro_batches} equal micro-batches")
    micro = batch // micro_batches
    fwd = _load(model, micro)
    names = list(default_trainable(fwd.graph) if trainable is None else trainable)
    nodes = list(fwd.graph)
    if len(nodes) < stages:
        raise UsageError(f"pipeline: the model has {len(nodes)} nodes, fewer than {stages} stages")
    whole = _load(model, batch) if _defers(memory_limit, micro_batches) and backend == "onnxruntime" else None
    seconds = shared_node_seconds(fwd, loss, backend, comm, list(ranks), whole, micro_batches,
                                  stages if memory_limit is None else 0)  # measured_cut rule 8
    defer, extra = False, warmup_bound(backend, seconds) if schedule == "1f1b" else 0
    if seconds is not None and seconds.ndim == 2:  # rule 10: measured_cut rule 7's rows
        (ends, defer), recompute = deferred_cut(fwd.graph, stages, micro_batches, seconds), False
    else:
        ends, recompute, extra = warmup_cut(fwd.graph, stages, schedule, micro_batches, extra, seconds=seconds,
                                            memory_limit=memory_limit, state_copies=len(optimizer.slots))
    ends = forced_ends(fwd.graph, stages, ends)  # rule 1: a forced cut, for measuring
    extra = chosen_warmup(fwd.graph, ends, micro_batches, seconds, extra, defer)  # rule 5
    split = _balancing_split(fwd.graph, ends, seconds, names, recompute, memory_limit, micro_batches)
    if split is not None:  # rule 11
        fwd, ends = split_cut.apply(fwd, split), split_cut.shifted(ends, split)
        parts = split_cut.parts_of(fwd, split)
        names = split_cut.renamed(names, parts)
    proto = ir.serde.serialize_model(fwd)
    starts = [0] + [e + 1 for e in ends[:-1]]
    owner = {o: s for s, (a, b) in enumerate(zip(starts, ends)) for n in proto.graph.node[a:b + 1] for o in n.output}
    _refuse_shared_weights(proto, starts, ends, set(names))
    value_ids: dict[str, int] = {}
    out_stages = []
    count = micro_batches if defer else _tail(fwd.graph, ends, micro_batches)
    wholes = _whole_stages(model, micro * count, count, memory_limit, recompute, starts, ends, owner, names, loss,
                           optimizer, label_name, tail=not defer, split=split) if count else None
    for s, (a, b) in enumerate(zip(starts, ends)):
        stage = _stage(proto, s, a, b, owner, stages, names, loss, optimizer, label_name, recompute,
                       None if wholes is None or wholes[s] is None else Defer(wholes[s], count, not defer))
        if backend == "tvm" and nhwc_stash.NHWC_STASH:  # rule 14
            nhwc_stash.apply(stage)
        programs, stage.prepare = hoist_stage_programs(
            f"{fwd.graph.name or 'model'}.stage{s}",
            [stage.forward, stage.backward, stage.fused, stage.weight_grad, stage.fused_tail],
            stage.weights, micro_batches=micro_batches, backend=backend)
        stage.forward, stage.backward, stage.fused, stage.weight_grad, stage.fused_tail = programs
        for _, v in stage.recv:
            value_ids.setdefault(v, len(value_ids))
        out_stages.append(stage)
    plan = PipelinePlan(out_stages, micro_batches, micro, batch, schedule, loss, label_name, optimizer, value_ids,
                        recompute, MEASURED if seconds is not None else COST_MODEL,
                        split_cut.parts_of(fwd, split) if split is not None else {}, extra)
    moved_wgrad.apply(plan, backend, memory_limit)  # rule 12
    return plan


def _balancing_split(graph: ir.Graph, ends: list[int], seconds: np.ndarray | None, names: list[str],
                     recompute: bool, memory_limit: float | None, micro_batches: int) -> Any:
    """Rule 11 (split_cut rules 3 and 5): the product split across the last cut, or None."""
    if seconds is None or recompute or memory_limit is not None or micro_batches < 2:
        return None
    return split_cut.choose(graph, ends, seconds[0] if seconds.ndim == 2 else seconds, names)


def deferred_cut(graph: ir.Graph, stages: int, micro_batches: int, rows: np.ndarray) -> tuple[list[int], bool]:
    """Rule 10's choice, from measured_cut rule 7's rows (rule 1's prices, the deferring last
    stage's, and its weight-gradient share): the cut with the last stage at its deferring prices
    when that stage's weight gradients are small (deferred_wgrad rule 6:
    :func:`~partitioner.training.deferred_wgrad.small_gradients`), else rule 1's cut without
    deferral (always the first with ``DEFER_ALWAYS``)."""
    from partitioner.training import deferred_wgrad

    ends = stage_cut(graph, stages, seconds=rows[0], last_seconds=rows[1])[0]
    if deferred_wgrad.DEFER_ALWAYS or deferred_wgrad.small_gradients(graph, ends[-2] + 1):
        return ends, True
    return stage_cut(graph, stages, seconds=rows[0])[0], False


def _defers(memory_limit: float | None, micro_batches: int) -> bool:
    """Rule 10: whether a plan defers its last stage's weight gradients."""
    from partitioner.training import deferred_wgrad

    return deferred_wgrad.DEFER_WEIGHT_GRADIENTS and micro_batches > 1 and memory_limit is None


def _tail(graph: ir.Graph, ends: list[int], micro_batches: int) -> int:
    """Rule 10's tail (deferred_wgrad rule 7): how many trailing micro-batches the last stage
    defers when it does not defer them all (0: none; also where its weight gradients are small,
    deferred_wgrad rule 6, so that a TVM plan whose ONNX Runtime twin defers the whole batch
    keeps per-micro-batch gradients)."""
    from partitioner.training import deferred_wgrad

    k = deferred_wgrad.DEFER_TAIL_MICRO_BATCHES
    if not 2 <= k < micro_batches or len(ends) < 2 or deferred_wgrad.small_gradients(graph, ends[-2] + 1):
        return 0
    return k


def _whole_stages(model: Any, rows: int, micro_batches: int, memory_limit: float | None, recompute: bool,
                  starts: list[int], ends: list[int], owner: dict[str, int], names: list[str], loss: str,
                  optimizer: Optimizer, label_name: str, tail: bool = False,
                  split: Any = None) -> list[onnx.ModelProto | None] | None:
    """Rule 10: the last stage's program built at the ``rows`` of the ``micro_batches`` it defers
    (the whole batch; ``tail``: its last micro-batches, and only the last stage) (the others:
    None, they do not defer; all None when the plan does not: the knob off, one micro-batch,
    ``--memory-limit`` or recompute)."""
    from partitioner.training import deferred_wgrad

    if not _defers(memory_limit, micro_batches) or recompute:
        return None
    loaded = _load(model, rows)
    proto = ir.serde.serialize_model(split_cut.apply(loaded, split) if split is not None else loaded)
    return [_stage(proto, s, a, b, owner, len(starts), names, loss, optimizer, label_name, False,
                   Defer(None, micro_batches)).fused
            if s == len(starts) - 1 or (deferred_wgrad.DEFER_EARLIER_STAGES and not tail) else None
            for s, (a, b) in enumerate(zip(starts, ends))]


def _deferral(stage: Stage, full: onnx.ModelProto, f_outputs: list[str], act_grads: list[str],
              defer: Defer | None) -> Any:
    """Rule 10: the stage's deferred weight-gradient split (None: nothing deferred)."""
    from partitioner.training.deferred_wgrad import split

    if defer is None or defer.whole is None:
        return None
    forward = _ancestors(full.graph, f_outputs) if f_outputs else set()
    per_step = set(stage.weights) | {a for a, _ in stage.bn_state}
    d = split(full, defer.whole, forward, act_grads, stage.weights, per_step, defer.micro_batches)
    if d is not None:
        stage.weight_grad, stage.w_stash, stage.w_axes, stage.w_tail = d.program, d.stash, d.axes, defer.micro_batches
    return d


def _micro_program(full: onnx.ModelProto, d: Any, suffix: str) -> onnx.ModelProto:
    """Rule 10: the last stage's per-micro-batch program: every output but the deferred weight
    gradients, plus the values the whole-batch program reads that it makes."""
    g = full.graph
    nodes = [n for i, n in enumerate(g.node) if i in d.micro_nodes]
    made = {o for n in nodes for o in n.output}
    deferred = {f"{w}.grad" for w in d.deferred}
    outs = [o.name for o in g.output if o.name not in deferred] + [v for v in d.stash if v in made]
    return _subprogram(full, nodes, [i.name for i in g.input], list(dict.fromkeys(outs)), suffix)


def _refuse_shared_weights(proto: onnx.ModelProto, starts: list[int], ends: list[int], trainable: set[str]) -> None:
    users: dict[str, set[int]] = {}
    for s, (a, b) in enumerate(zip(starts, ends)):
        for n in proto.graph.node[a:b + 1]:
            for i in n.input:
                if i in trainable:
                    users.setdefault(i, set()).add(s)
    shared = sorted(w for w, st in users.items() if len(st) > 1)
    if shared:
        raise UsageError(f"pipeline training: weight(s) {', '.join(shared[:5])} are read by more than one stage "
                         "(tied weights); train this model with --strategy data")


def _stage(proto: onnx.ModelProto, s: int, a: int, b: int, owner: dict[str, int], stages: int, trainable: list[str],
           loss: str, optimizer: Optimizer, label_name: str, recompute: bool = False,
           defer: Defer | None = None) -> Stage:
    """Cut stage ``s`` (nodes a..b) out of the forward model and build its programs (``defer``: rule 10)."""
    g = proto.graph
    mine = list(g.node[a:b + 1])
    produced = {o for n in mine for o in n.output}
    inits = {t.name: t for t in g.initializer}
    data_names = [i.name for i in g.input if i.name not in inits]
    read = [i for n in mine for i in n.input if i and i not in produced]
    recv = [(owner[v], v) for v in dict.fromkeys(read) if v in owner]
    data = [v for v in dict.fromkeys(read) if v in data_names]
    later = {i for n in g.node[b + 1:] for i in n.input}
    outs = [o.name for o in g.output]
    send_vals = [v for v in dict.fromkeys(o for n in mine for o in n.output) if v in later]
    send = [(c, v) for v in send_vals for c in sorted({owner[o] for n in g.node[b + 1:] if v in n.input
                                                        for o in n.output[:1]})]
    last = s == stages - 1
    infos = {vi.name: vi for vi in list(g.value_info) + list(g.input) + list(g.output)}
    sub = helper.make_graph(mine, f"{g.name or 'model'}.stage{s}",
                            [infos[v] for v in data + [v for _, v in recv]],
                            [infos[v] for v in (outs if last else send_vals)],
                            [inits[i] for i in dict.fromkeys(i for n in mine for i in n.input) if i in inits])
    sub.value_info.extend(vi for vi in g.value_info if vi.name in produced)
    sub_model = helper.make_model(sub, opset_imports=list(proto.opset_import), ir_version=proto.ir_version)
    stage_model = ir.serde.deserialize_model(sub_model)
    weights = [w for w in trainable if w in stage_model.graph.initializers]
    return _stage_programs(stage_model, s, recv, send, data, weights, last, loss, optimizer, label_name, recompute,
                           defer)


def _stage_programs(fwd: ir.Model, s: int, recv: list[tuple[int, str]], send: list[tuple[int, str]],
                    data: list[str], weights: list[str], last: bool, loss: str, optimizer: Optimizer,
                    label_name: str, recompute: bool = False, defer: Defer | None = None) -> Stage:
    from partitioner.training.deferred_wgrad import activation_grads, forward_activations

    graph = fwd.graph
    dtype = next((v.dtype for v in graph.outputs if is_float(v)), ir.DataType.FLOAT)
    em = Emitter(graph, dtype)
    initial: dict[str, np.ndarray] = {}
    promote = _promote(graph, initial)
    recv_vals = {v: graph.inputs[len(data) + i] for i, (_, v) in enumerate(recv)}
    grad_in = [v for v, val in recv_vals.items() if is_float(val)]
    w_values, bn_state, out_value = _checked_forward(fwd, em, promote, weights, graph.outputs[0])
    activations = forward_activations(graph) if defer is not None else []  # rule 10
    sent = list(graph.outputs)
    if last:
        labels_spec = label_spec(loss, out_value, label_name)
        labels = ir.Value(name=labels_spec.name, shape=ir.Shape(labels_spec.shape), type=ir.TensorType(labels_spec.dtype))
        graph.inputs.append(labels)
        target = loss_input(loss, out_value)  # a Softmax output's logits (losses module docstring)
        loss_value, dout = emit_loss(loss, em, target, labels)
        seeds = {target.name: dout}
    else:
        seeds = {}
        for v in sent:
            if is_float(v):
                seed = ir.Value(name=f"{v.name}.grad_out", shape=v.shape, type=ir.TensorType(v.dtype))
                graph.inputs.append(seed)
                seeds[v.name] = seed
    sources = list(w_values) + [recv_vals[v] for v in grad_in]
    grads = backward(graph, None, seeds, sources + activations, em) if sources else {}
    act_grads = activation_grads(grads, activations)
    em.tag = "optimizer"
    grad_outs = [em.op("Identity", grads[v], _name=f"{v}.grad_in") for v in grad_in]
    w_grads = [em.op("Identity", grads[w.name], _name=f"{w.name}.grad") for w in w_values]
    bn_next = [b for _, b in bn_state]
    graph.outputs.clear()
    head = [loss_value] if last else sent
    for v in head + grad_outs + w_grads + bn_next:
        graph.outputs.append(v)
    fwd.opset_imports[""] = max(fwd.opset_imports.get("", STEP_OPSET), STEP_OPSET)
    full = ir.serde.serialize_model(_infer(fwd))
    stage = Stage(s, recv, send, data, weights, grad_in, [(a.name, b.name) for a, b in bn_state], initial=initial)
    f_outputs = [] if last else [v.name for v in sent] + [b.name for b in bn_next]
    if defer is not None and defer.whole is None:  # rule 10: the whole-batch build only gives its program
        stage.fused = full
        return stage
    deferral = _deferral(stage, full, f_outputs, act_grads, defer)
    if last and deferral is not None and defer is not None and defer.tail:  # rule 10's tail
        stage.fused, stage.fused_tail = full, _micro_program(full, deferral, "FBt")
    elif last:
        stage.fused = full if deferral is None else _micro_program(full, deferral, "FB")
    else:
        _split_forward_backward(stage, full, f_outputs, recompute, deferral)
    stage.update = _update_program(fwd.graph.name, optimizer, weights, initial, dtype, stage)
    return stage


def _ancestors(g: onnx.GraphProto, outputs: list[str]) -> set[int]:
    """Indices of the nodes ``outputs`` depend on."""
    producer = {o: i for i, n in enumerate(g.node) for o in n.output}
    need, todo = set(), list(outputs)
    while todo:
        v = todo.pop()
        i = producer.get(v)
        if i is None or i in need:
            continue
        need.add(i)
        todo.extend(x for x in g.node[i].input if x)
    return need


def _split_forward_backward(stage: Stage, full: onnx.ModelProto, f_outputs: list[str], recompute: bool = False,
                            deferral: Any = None) -> None:
    """Rule 2: F = ancestors of what the stage sends and its BN statistics; B = the rest. Rule 8
    (``recompute``): B = every ancestor of its outputs, the forward included, so the stash is
    only the stage's inputs. Rule 10 (``deferral``): B = the per-micro-batch nodes; F and B also
    output the values the deferred weight-gradient program reads."""
    g = full.graph
    need = _ancestors(g, f_outputs)
    f_nodes = [n for i, n in enumerate(g.node) if i in need]
    w_reads = set(deferral.stash) if deferral is not None else set()
    deferred = {f"{w}.grad" for w in deferral.deferred} if deferral is not None else set()
    if recompute:
        keep = _ancestors(g, [o.name for o in g.output if o.name not in f_outputs])
        b_nodes = [n for i, n in enumerate(g.node) if i in keep]
    elif deferral is not None:
        b_nodes = [n for i, n in enumerate(g.node) if i in deferral.micro_nodes]
    else:
        b_nodes = [n for i, n in enumerate(g.node) if i not in need]
    state = set(stage.weights) | {a for a, _ in stage.bn_state}
    inputs = [i.name for i in g.input]
    f_have = {o for n in f_nodes for o in n.output} | {i for i in inputs if i not in state and not i.endswith(".grad_out")}
    b_reads = {i for n in b_nodes for i in n.input if i} - {o for n in b_nodes for o in n.output}
    stage.stash = sorted((v for v in f_have if v in b_reads), key=lambda v: (v not in inputs, v))
    b_made = {o for n in b_nodes for o in n.output}
    b_outputs = [o.name for o in g.output if o.name not in f_outputs and o.name not in deferred]
    b_outputs = list(dict.fromkeys(b_outputs + sorted(v for v in w_reads if v in b_made)))
    f_w = sorted(v for v in w_reads if v in f_have and v not in inputs)
    stage.forward = _subprogram(full, f_nodes, [i for i in inputs if not i.endswith(".grad_out")
                                                and i in {x for n in f_nodes for x in n.input}],
                                list(dict.fromkeys(f_outputs + [v for v in stage.stash if v not in inputs] + f_w)),
                                "F")
    b_inputs = [v for v in stage.stash] + [i for i in inputs if i in b_reads and i not in stage.stash]
    stage.backward = _subprogram(full, b_nodes, b_inputs, b_outputs, "B")


def _subprogram(full: onnx.ModelProto, nodes: list[onnx.NodeProto], inputs: list[str], outputs: list[str],
                suffix: str) -> onnx.ModelProto:
    g = full.graph
    infos = {vi.name: vi for vi in list(g.value_info) + list(g.input) + list(g.output)}
    inits = {t.name: t for t in g.initializer}
    used = {i for n in nodes for i in n.input}
    produced = {o for n in nodes for o in n.output}
    sub = helper.make_graph(nodes, f"{g.name}.{suffix}", [infos[v] for v in inputs if v not in inits],
                            [infos[v] for v in outputs], [t for n, t in inits.items() if n in used])
    sub.value_info.extend(vi for vi in g.value_info if vi.name in produced and vi.name not in outputs)
    return helper.make_model(sub, opset_imports=list(full.opset_import), ir_version=full.ir_version)


def _update_program(name: str, optimizer: Optimizer, weights: list[str], initial: dict[str, np.ndarray],
                    dtype: ir.DataType, stage: Stage) -> onnx.ModelProto:
    """Rule 4: ``W' = optimizer(W, accumulated / M)``, the scale an input (``grad.scale``)."""
    graph = ir.Graph(inputs=[], outputs=[], nodes=[], opset_imports={"": STEP_OPSET}, name=f"{name}.update")
    em = Emitter(graph, dtype)
    em.tag = "optimizer"
    scale = ir.Value(name="grad.scale", shape=ir.Shape([]), type=ir.TensorType(dtype))
    graph.inputs.append(scale)
    w_values, grads = [], {}
    for w in weights:
        shape = ir.Shape(initial[w].shape)
        wv = ir.Value(name=w, shape=shape, type=ir.TensorType(dtype))
        gv = ir.Value(name=f"{w}.grad", shape=shape, type=ir.TensorType(dtype))
        graph.inputs.extend([wv, gv])
        w_values.append(wv)
        grads[w] = em.op("Mul", gv, scale)
    start = dict(initial)
    pairs = _optimizer_updates(graph, em, optimizer, w_values, grads, start, dtype, [])
    for _, out in pairs:
        graph.outputs.append(out)
    stage.initial.update({k: v for k, v in start.items() if k not in stage.initial})
    stage.update_pairs = [(a.name, b.name) for a, b in pairs]
    return ir.serde.serialize_model(_infer(ir.Model(graph, ir_version=8)))


def in_flight(schedule: str, stages: int, micro_batches: int, extra: int = 0) -> list[int]:
    """Rule 5: the most micro-batches each stage stashes at once (``extra``: the plan's
    :func:`extra_warmup`, on the stages before the last): the cost model's count, cost rule 3."""
    from partitioner.cost.training import stashed_micro_batches

    return stashed_micro_batches(schedule, stages, micro_batches, extra)


def schedule_order(schedule: str, stage: int, stages: int, micro_batches: int,
                   extra: int = 0) -> list[tuple[str, int]]:
    """Rule 5: the stage's ``("F", m)`` / ``("B", m)`` order (the last stage: ``("FB", m)``);
    ``extra``: the plan's extra warm-up (1F1B only). The cost model's simulation runs the same
    order (:func:`partitioner.cost.pipeline.schedule_order`)."""
    from partitioner.cost.pipeline import schedule_order as order

    return order(schedule, stage, stages, micro_batches, extra)


def tag(plan: PipelinePlan, m: int, value: str, backward_dir: bool) -> int:
    """Rule 3: one message tag per (micro-batch, value, direction)."""
    return TAG_BASE + 2 * (m * max(len(plan.value_ids), 1) + plan.value_ids[value]) + int(backward_dir)


def plan_state(plan: PipelinePlan) -> dict[str, np.ndarray]:
    """Rule 6: every stage's start state, merged (a 1-rank step's state names)."""
    out: dict[str, np.ndarray] = {}
    for st in plan.stages:
        out.update({k: v.copy() for k, v in st.initial.items()})
    return split_cut.join_state(plan.parts, out)


def stage_state_names(stage: Stage) -> list[str]:
    names = [a for a, _ in stage.update_pairs] + [a for a, _ in stage.bn_state]
    return list(dict.fromkeys(names))


def merged(parts: Sequence[Mapping[str, np.ndarray]]) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    for p in parts:
        out.update(p)
    return out
