"""The cost of a training step: time and per-rank memory for single, data, pipeline and tensor.

The formulas only: :func:`partitioner.training.plan.predict_training` loads the model at the
rank's batch, finds the stages or the tensor pairs as the runtime does, and calls these.

Rules (``tests/training/test_training_cost.py`` checks them):

1. Forward and backward time per forward node: the roofline model
   (:func:`partitioner.cost.roofline.op_time`) on the cluster's first device at the batch a rank
   runs (the local batch for ``data``, the micro-batch for ``pipeline``, the whole batch for
   ``tensor``), applied to the nodes the training step really runs (:func:`step_times`): each
   node of the step graph built at that batch counts for the forward node it is (a rewritten
   node, BatchNormalization's training-mode expansion, for the node it replaces) or
   differentiates (``training.forward_node``); the loss's nodes count as the last node's
   forward. A backward contraction (the weight gradient's Gemm with a transposed operand, the
   input gradient's ConvTranspose, the weight gradient's Conv whose kernel is the output
   gradient) runs at the efficiency the calibration measured for such kernels
   (``<class>_backward``: :func:`partitioner.calibrate.micro_kernels`' backward probes), not the
   forward one: those kernels run at other rates than the forward's (the zoo resnet's step took
   9x its forward on ONNX Runtime where its FLOPs are 3x). A forward conv of the step runs at
   ``conv_train`` when calibrated (:func:`forward_class`: the probes' convs with their weights
   as a graph input, as the step's state is; ``TRAIN_FORWARD_PROBES``; on a TVM rank at the
   small-map point of its batch's pixels, not one image's: :func:`tvm_batch_columns`,
   ``TVM_CONV_BATCH_COLUMNS``), a forward GEMM / MatMul whose weight is a graph input (the
   step's state) on the ``gemm_train`` / ``gemm_large_train`` pair when calibrated
   (:func:`train_gemm_device`, ``TRAIN_GEMM_PROBES``: ONNX Runtime packs an input weight on every
   call, 1.06-1.11x a prepacked constant one's time), and a Where (the ReLU
   gradient) at ``where`` when calibrated (:func:`node_class`, ``TRAIN_WHERE_CLASS``: ONNX
   Runtime's Where runs at about 2 GB/s, a thirtieth of its Add), a batched MatMul's weight
   gradient's ReduceSum over the batch at ``reduce_batch`` (``TRAIN_REDUCE_BATCH_CLASS``: 1.4-5
   GB/s for batches of 4-16), and on a TVM rank a Slice feeding only Concats (the im2col of a
   conv's weight gradient) at nothing beyond its Concat (``TVM_FUSED_IM2COL_SLICES``: TVM fuses
   them into one kernel), on a TVM rank a Conv-form weight gradient at the forward conv's class
   (``TVM_CONV_WGRAD_AS_CONV``: TVM builds it as a ``conv2d``) and the channels-last im2col
   Concat as one copy at the copy bandwidth (``TVM_IM2COL_AS_COPY``); elementwise and
   data-movement nodes by their working set (roofline rule 7: a step's maps are far larger than
   the in-cache class probes'). Without a step graph (or for a node
   the step graph does not name) the backward is the forward time x ``BACKWARD_FACTOR[op
   class]`` (contractions 2: one product per operand gradient; the rest 1).
2. Optimizer time: a memory-bound pass over the weights reading and writing the weight, its
   gradient and the optimizer's state copies (``OPTIMIZER_COPIES``: SGD 0, momentum 1, Adam 2):
   one fused kernel per weight, as TVM runs the update. On ONNX Runtime (``OPTIMIZER_FROM_STEP``,
   :func:`optimizer_seconds`) every node of the step's update is its own kernel (SGD: ``lr x g``
   then ``W - that``, 5 weight-sized passes where the formula has 3), priced by the roofline with
   its working-set rule; a rank or stage pays its weights' share. Measured (the zoo resnet's
   batch-16 step, 45 MiB of weights, ORT node profiler, load 1.2): the update's nodes 11.8 ms,
   the formula 5.5 ms. Elsewhere the formula's pass runs at the roofline's working-set
   efficiency of an elementwise op of its bytes (``OPTIMIZER_WORKING_SET``,
   :func:`optimizer_stream_efficiency`).
3. Memory per rank, as the runtime holds it at a step's peak (measured by ``train --bench``:
   :mod:`partitioner.training.memory_window`). With the state ``S`` = weights x (1 + optimizer
   copies) and the gradients ``G`` = the weights' bytes: ``3 S`` (the resident state, the step's
   next state returned as new arrays while the old is alive, and the backend's own output
   buffers: ONNX Runtime's arena keeps the last call's outputs) + ``G`` + the activations
   (``single`` and ``data``: the step graph's peak live bytes at the rank's batch when the step
   graph is given, :data:`STEP_LIVE_ACTIVATIONS`; otherwise and for the other strategies the
   stash: every forward value's bytes at the rank's batch, times the micro-batches in flight:
   ``data``/``tensor``: 1; GPipe: ``M``; 1F1B: ``min(S - s + e, M)`` on stage ``s``, ``e`` the
   plan's extra warm-up on the stages before the last, 0 on the last: pipeline rule 5, 1 on ONNX
   Runtime plans, 0 on TVM's). ``data`` adds
   ``BUCKET_COPIES`` x the weights (each gradient bucket is concatenated, returned, copied into
   the MPI communicator's shared-memory slot, AllReduced into a new array and split: 5 copies
   between the program's segments); ``LIST_BUCKET_COPIES`` = 3 for ranks that AllReduce each
   bucket as a list (ONNX Runtime, :mod:`partitioner.training.buckets`: the gradients returned,
   the slot, the reduced arrays; no concatenation, no split). ``pipeline``
   adds ``PIPELINE_GRADIENT_COPIES`` = 3 ``G`` (the backward's gradient outputs, the
   accumulator over the micro-batches, the weight-sized temporaries of the backward and update
   programs in the rank's one shared arena; measured: 2.4 G with SGD, 3.65 G with Adam on the
   mlp 2048's first stage); on ONNX Runtime plans the last stage's activations are its programs'
   (``memory.ORT_LAST_STAGE_LIVE``: its fused forward-backward call's peak live bytes and the
   arrays kept for rule 9's deferred program), not its stash. ``tensor``
   adds its comm ops' inputs and outputs (alive in the rank's value table for the whole step,
   the program running as segments between them) and ``R`` copies of the largest (the
   deterministic reduction gathers every rank's). Measured (``train --bench``, ONNX Runtime
   ranks sharing one arena across their sessions, 2 MPI ranks; the zoo mlp 2048 wide at batch 32
   and 4x1024 at batch 1024): single, data and pipeline 1F1B (SGD, Adam) within 0.80-1.03 of the
   prediction on every rank; tensor 0.62-0.67 at batch 1024 (docs/training.md, "What the
   measured peak holds"). A TVM pipeline stage (``memory.TVM_STAGE_MEMORY``) is priced from the
   programs its runner builds instead (:func:`partitioner.cost.memory.tvm_stage_memory`: the
   state, the persistent input buffers of what the programs take as arrays, the prepared and
   lifted step constants, TVM's pooled storage as each program's peak live bytes, the stash in
   flight, the held gradients, the deferred program's stash and the sends): rule 3's sum, made for
   ONNX Runtime's one arena, priced the zoo mlp's TVM stages at 0.61 and 0.39 of their measured peaks.
   A TVM ``single`` or ``data`` rank (``memory.TVM_PLANNED_MEMORY``) is priced from its libraries'
   own memory plans (:func:`partitioner.cost.memory.tvm_rank_memory`: 2 x the state, each
   library's planned storage and outputs, the batch's buffers, the data ranks' shared-memory
   window): rule 3 priced bert's TVM 1-rank step +50% over its measured peak, this rule -13%.
4. Step time:
   - ``single``: forward + backward + optimizer;
   - ``data``: the same at the local batch, plus ``BUCKET_PASSES`` memory passes over the
     weights' bytes (each bucket's concatenation and its split back: read and write; the mean's
     ``1/R`` scales the loss gradient, step rule 5; none with ``list_buckets``: ONNX Runtime
     and TVM ranks AllReduce the gradients as they lie, :mod:`partitioner.training.buckets`), plus the gradient AllReduce (all weight bytes, the cluster's collective model),
     overlapping the backward as rule 5 simulates: the ONNX Runtime
     ranks run each bucket's AllReduce on a communication thread beside the rest of the
     backward (:mod:`partitioner.training.overlap`; with one bucket the simulation gives about
     the blocking step, as the runtime then runs it). With ``overlap=False`` (a TVM rank with
     ``LIST_ALLREDUCE`` off, whose comm ops are blocking calls inside one VM invocation) the
     AllReduce is added after the backward. The breakdown gives both (``step_with_overlap_s``, ``step_without_overlap_s``);
   - ``pipeline``: fill-drain over ``M`` micro-batches of per-stage (forward + backward) times
     with the activation and gradient sends between stages
     (:func:`partitioner.cost.pipeline.pipeline_step_time`), plus the slowest stage's update.
     The stages are given (the runtime's cut, :func:`partitioner.training.pipeline.stage_ends`).
     The extra warm-up (rule 3's ``e``) does not change it: the fill-drain formula already has
     the slowest stage set the pace after the fill; the warm-up removes a wait through both ranks
     and two messages that the formula never priced (pipeline rule 5);
   - ``tensor``: the Megatron pairs' nodes run 1/R of their work; every pair adds one AllReduce
     of its output forward and one of its input's gradient backward.
5. Overlap: the gradients are cut into buckets of at most
   ``BUCKET_BYTES`` in the order the backward pass finishes them (last layer first, as the step
   builder does); bucket ``b``'s AllReduce could start once the backward has passed the
   bucket's first-read node, on a link that carries one AllReduce at a time:
   ``start_b = max(ready_b, end_{b-1})``. The step with overlap is forward + max(backward end,
   last AllReduce end) + optimizer.
6. Recompute (pipeline rule 8, chosen by the stage planner when no split fits the memory limit
   otherwise): a stage but the last holds one micro-batch's activations plus its inputs x its
   in-flight count, and runs its forward twice per micro-batch.
7. Fixed costs (when :class:`StepOverheads` are given: ``train --bench`` and
   ``benchmarks/train_step.py`` measure them, :mod:`partitioner.training.overheads`): each step
   pays ``per_step`` (the Python driver); each program call ``per_call`` + its step-graph nodes x
   ``per_node`` + its input and output arrays x ``per_array`` + its output bytes x
   ``per_output_byte`` (the backend returns new arrays: allocation, page faults, a copy). Calls:
   ``single``: 1; ``data`` and ``tensor``: one per segment between comm ops (each comm op adds
   its two arrays); ``pipeline``: per micro-batch ``F`` and ``B`` (the last stage one fused
   call), their output bytes the stage's gradients, plus one update call per step, and the
   runner's Python per micro-batch (``per_micro_batch``). Every
   point-to-point message and collective already pays the link's calibrated ``alpha``
   (:mod:`partitioner.cost.comm`). Without overheads the model is compute and communication only.
8. Pipeline gradient accumulation: every micro-batch after the first adds its gradients into the
   accumulator in place, a memory-bound pass (read two, write one) over the stage's weights.
9. Deferred weight gradients (pipeline rule 10, :mod:`partitioner.training.deferred_wgrad`; for
   ONNX Runtime plans whose last stage's weight products sum over few rows, as the zoo resnet's
   layer3-4 at micro-batch 2): the last stage's micro-batches run without their
   weight-gradient-only nodes (:func:`weight_gradient_only`: deferred_wgrad rule 1's ``W``,
   found on the 1-rank step graph) and accumulate nothing (rule 8), and its ``W`` program runs
   once per step at the whole batch (those nodes priced by rule 1 on the step built at the
   whole batch) after its last micro-batch, beside the earlier stages' last backwards: the
   step is longer by what ``W`` takes beyond them. Rule 7: the micro-batch calls return no
   weight gradients, and ``W`` is one more call. Before this rule the plan was priced as if it
   accumulated (the zoo resnet's ORT pipeline: 226.1 ms predicted with accumulation, 206.0
   deferred; measured, paired, session 10: 342.4 and 310.2 ms). ``PRICE_DEFERRED_WGRAD``.
10. Step constants (TVM pipeline plans whose stages hoist their weights' work,
   :mod:`partitioner.training.hoist` rules 5 and 7, ``M >= 2``; :func:`step_constant_prices`): a
   conv over a stage weight (a forward Conv of a weight, a ConvTranspose TVM runs as a Conv: the
   input gradient) does per-call weight-only work when its weight is a program input: the HWIO
   transpose ConvertLayout adds and the schedule's panel packing. Rule 1 prices that work inside
   the ``conv_train`` probes (weights as inputs); a hoisting stage runs it once per step (rule 5
   hoists the transposes of every conv weight; rule 7 lifts the packing of weights of at least
   ``hoist.LIFT_MIN_BYTES``; the packing of the smaller ones stays, 0.01-0.1 ms a call for the zoo
   resnet's layer1-2 weights at batch 16, VM instrument). So per conv the work is its rule-1 price
   minus its price at the constant-weight ``conv`` class (the same multiply-adds, per-image
   columns: the calibration's convs with constant weights): subtracted from every micro-batch of
   its stage, paid once per step before the stage's first micro-batch, which delays the step by
   what it takes beyond the fill that reaches the stage (the earlier stages' first forwards).
   Memory: each such conv's filter (the transposed weight; the input gradient's flipped or
   phase-form filter, ``tvm_conv_flops_ratio`` x the weight) is alive for the whole step (hoist
   rule 6), and a lifted one's packed copy too (lift_step_constants: one per lifted weight per
   program). Before this rule the zoo resnet's TVM pipeline (session 11, quiet) was predicted at
   437.7 ms against 348.8 measured (+25.5%), its peaks at 84 / 225 MiB against 222 / 524.
   ``PRICE_STEP_CONSTANTS``.
11. Co-run bandwidth (:func:`co_located`): the ranks of a plan with more than one rank run at the
   same time on one node and share its memory system, so every rank's node prices run at
   ``memory_bandwidth x co_run_bandwidth`` (the device's share while every core copies at once,
   calibration probe 7; 1.0 when not measured): memory-bound nodes (BN, ReLU gradients, im2col,
   pooling gradients, the optimizer) slow down, compute-bound ones do not (a GEMM kept 0.96-1.02
   of its rate on both cores, measured). The 1-rank plans are unchanged. Measured on the 2-core
   Zen 4 machine (session 22, ``benchmarks/co_run.py``, ``session22_zen4/co_run.json``): copies
   kept 0.43-0.71 (median 0.54) of one core's bandwidth with both cores copying; the zoo
   resnet's TVM steps (batch 16) measured 156.6 ms data and 210.7 ms 1F1B against 115.7 (-26%)
   and 157.7 ms (-25%) predicted without this rule (1 rank: 210.5 against 201.3).
   ``CO_RUN_BANDWIDTH``. Since session 27 a node's price takes the share of its working set
   (roofline rule 8: the caches are not shared, the DRAM path is) when the calibration measured
   the in-cache co-run copy; the optimizer's pass, the gradient accumulation and the bucket
   copies (weight-sized) keep the out-of-cache share.
12. Reuse distance (:func:`reuse_reads`, ``CO_RUN_REUSE_DISTANCE``): on a co-running rank
   (rule 11) a node's input last touched long before it is read from beyond the core's caches
   whatever the node's size: the forward activations the backward reads (stashed across the
   whole forward), the weights the backward reads again, the state read by the next step. Each
   input's reuse distance is the bytes the step's nodes read and wrote between its last access
   (its producer, or an earlier reader) and this node, the step taken as a cycle (what no
   earlier node of the step touched was last touched in the previous step); an input whose
   distance exceeds the node's own bytes is priced at the co-run share of its distance (roofline
   rule 8). Why: rule 8 alone keyed every read on the node's bytes, so a backward node of the zoo
   bert (every map under 2 MiB) read its stashed activations at the in-cache share (0.93-0.97 of
   the lone rate) where they come from DRAM (0.42-0.53 beyond 16 MiB moved per core on Zen 5):
   its 2-rank data step was predicted at 0.517 of the 1-rank step, measured 0.574 (session 27).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np

BACKWARD_FACTOR = {"gemm": 2.0, "conv": 2.0, "depthwise_conv": 2.0}
#: the step builder's bucket size (partitioner/training/step.py rule 5)
BUCKET_BYTES = 25 * 2**20
#: data parallel: weight-sized copies between the step's segments (rule 3)
BUCKET_COPIES = 5
#: data parallel with list AllReduces (no concatenation, no split; rule 3)
LIST_BUCKET_COPIES = 3
#: pipeline: gradient-sized buffers beside the state's three copies (rule 3)
PIPELINE_GRADIENT_COPIES = 3
#: data parallel: weight-sized memory passes (read and write) the buckets add to a step: the
#: concatenation and the split back (rule 4)
BUCKET_PASSES = 2
OPTIMIZER_COPIES = {"sgd": 0, "momentum": 1, "adam": 2, "adamw": 2, "SGD": 0, "Momentum": 1, "AdamW": 2}
#: rule 11: ranks of a multi-rank plan run at their device's co-run share of the memory bandwidth
#: (off: every rank at the lone core's bandwidth, as before 2026-12-03 pm)
CO_RUN_BANDWIDTH = True
#: rule 12: a co-running rank's reads priced by their reuse distance (off: at the node's bytes)
CO_RUN_REUSE_DISTANCE = True


def co_located(device: Any, ranks: int) -> Any:
    """Rule 11: ``device`` as each of ``ranks`` ranks running at once on its node sees it."""
    share = device.co_run_bandwidth
    if ranks <= 1 or not CO_RUN_BANDWIDTH or share >= 1.0:
        return device
    return replace(device, memory_bandwidth=device.memory_bandwidth * share, co_running=True)


@dataclass
class TrainingPrediction:
    """Predicted step time (s), throughput and peak memory per rank (bytes) of one plan."""

    strategy: str
    devices: int
    batch: int
    step_time_s: float
    samples_per_s: float
    memory_per_rank: list[float]
    breakdown: dict[str, float] = field(default_factory=dict)
    schedule: str | None = None
    micro_batches: int | None = None
    stage_weight_bytes: list[float] | None = None  # pipeline: the trainable bytes of each stage
    recompute: bool = False  # pipeline: the stages but the last recompute their forward (rule 6)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class StepOverheads:
    """Rule 7's fixed costs (seconds; ``per_output_byte_s`` per byte), measured by
    :func:`partitioner.training.overheads.calibrate`."""

    per_step_s: float = 0.0
    per_call_s: float = 0.0
    per_node_s: float = 0.0
    per_array_s: float = 0.0
    per_output_byte_s: float = 0.0
    per_micro_batch_s: float = 0.0  # the pipeline runner's Python per micro-batch, beyond its calls
    backend: str = ""

    def call(self, nodes: float, arrays: float, output_bytes: float) -> float:
        """One program call of ``nodes`` nodes taking and returning ``arrays`` arrays."""
        return (self.per_call_s + nodes * self.per_node_s + arrays * self.per_array_s
                + output_bytes * self.per_output_byte_s)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class DeferredWeightGradients:
    """Rule 9's prices per forward node: its weight-gradient-only nodes' seconds at the
    micro-batch (``micro``) and at the whole batch (``whole``), and their step-node count."""

    micro: np.ndarray
    whole: np.ndarray
    nodes: np.ndarray


@dataclass(frozen=True)
class StepConstants:
    """Rule 10's prices per forward node: the seconds of weight-only work its convs over a stage
    weight do on every call (``work``: saved per micro-batch, paid once per step) and the bytes of
    the buffers that work leaves alive for the whole step (``held``)."""

    work: np.ndarray
    held: np.ndarray


@dataclass
class _Profile:
    forward: np.ndarray  # seconds per node
    backward: np.ndarray
    activation: np.ndarray  # output bytes per node
    weight: np.ndarray  # trainable bytes first read by each node
    names: list[str]
    graph: Any
    #: rule 7 (set by the planner when overheads are given): step-graph nodes per forward node
    #: (its forward and backward nodes), the loss's nodes, the optimizer's nodes, the overheads
    step_nodes: np.ndarray | None = None
    loss_nodes: int = 0
    optimizer_nodes: int = 0
    overheads: StepOverheads | None = None
    weight_tensors: np.ndarray | None = None  # trainable tensors first read by each node
    #: rule 2 from the step graph (ONNX Runtime): its optimizer nodes' seconds for all the weights
    optimizer_s: float | None = None
    #: rule 9 (set by the planner when the pipeline's last stage defers its weight gradients)
    deferred: DeferredWeightGradients | None = None
    #: rule 10 (set by the planner for a TVM pipeline whose stages hoist and lift their weight work)
    constants: StepConstants | None = None
    #: rule 3 (:data:`STEP_LIVE_ACTIVATIONS`, set by the planner): the step graph's peak live bytes
    #: (:func:`partitioner.training.analysis.step_live_bytes`)
    step_live: float | None = None

    def fixed(self, calls: float, nodes: float, arrays: float, output_bytes: float) -> float:
        """Rule 7 for ``calls`` program calls with these totals; 0 without overheads."""
        o = self.overheads
        if o is None:
            return 0.0
        return (calls - 1) * o.per_call_s + o.call(nodes, arrays, output_bytes)


def profile(graph: Any, device: Any, trainable: set[str], step: Any = None) -> _Profile:
    """Rule 1 on a forward graph whose shapes are bound at the rank's batch; ``step``: the
    training step's graph built at that batch (:func:`step_times`), else the factor rule."""
    from partitioner.cost.ops import nbytes, op_class
    from partitioner.cost.roofline import graph_op_times

    nodes = list(graph)
    times = np.array(graph_op_times(graph, device), dtype=np.float64)
    factor = np.array([BACKWARD_FACTOR.get(op_class(n), 1.0) for n in nodes])
    backward = times * factor
    if step is not None:
        times, backward = step_times(step, device, [n.name or f"node{i}" for i, n in enumerate(nodes)],
                                     times, backward)
    seen: set[str] = set()
    weight = np.zeros(len(nodes))
    tensors = np.zeros(len(nodes))
    for i, n in enumerate(nodes):
        for v in n.inputs:
            if v is not None and v.name in trainable and v.name not in seen:
                seen.add(v.name)
                weight[i] += nbytes(v)
                tensors[i] += 1
    act = np.array([sum(nbytes(o) for o in n.outputs) for n in nodes], dtype=np.float64)
    return _Profile(times, backward, act, weight, [n.name or f"node{i}" for i, n in enumerate(nodes)], graph,
                    weight_tensors=tensors, optimizer_s=optimizer_seconds(step, device) if step is not None else None)


#: rule 3 on ``single`` and ``data`` ranks: the activations are the step graph's peak live bytes
#: (``_Profile.step_live``: :func:`partitioner.training.analysis.step_live_bytes`) where the planner
#: gives them; off: every forward value's bytes (the stash), as before session 30. Why: the sum of
#: the forward values counts views and values the backward never reads, and leaves out the
#: backward's own temporaries (activation gradients, transposed copies for the weight gradients),
#: so its error depended on the model. Measured (session 30, ONNX Runtime ranks without the memory
#: pattern, ``benchmarks/train_step.py`` sizes, peak RSS above the loaded process,
#: ``session30_zen5_train/stash_rule``): 1 rank mlp / resnet / bert 79 / 446 / 172 MiB, predicted
#: +32% / -25% / +45% with the stash and +17% / -29% / -19% with this rule; data ranks 133 / 389 /
#: 116, predicted 0% / -2% / +39% and -3% / -4% / -10%. Outside the zoo (``benchmarks/heldout_models.py``,
#: 1 rank, ``train --bench``): heldout_mbv2 batch 16 175 MiB, predicted -14% (stash -15%);
#: heldout_inception batch 8 148 MiB, predicted -45% (stash -34%): on the conv nets ONNX Runtime
#: holds about 1.6-1.8x the graph's live bytes, not located (docs/training.md).
STEP_LIVE_ACTIVATIONS = True


#: rule 2 on ONNX Runtime: the optimizer's own step nodes, each its own kernel (off: the formula)
OPTIMIZER_FROM_STEP = True


def optimizer_seconds(step: Any, device: Any) -> float | None:
    """Rule 2 on an ONNX Runtime device (``device.runtime``): the step graph's optimizer nodes,
    each priced as its own kernel (ONNX Runtime's CPU provider fuses no elementwise chain, and
    the update's inputs are the state, not constants) with the roofline's working-set rule;
    None elsewhere (TVM fuses each weight's update into one kernel: the formula)."""
    if not OPTIMIZER_FROM_STEP or getattr(device, "runtime", None) != "onnxruntime":
        return None
    from partitioner.cost.roofline import op_time
    from partitioner.cost.workdepth import constant_values, node_costs

    total = 0.0
    for node, c in zip(step, node_costs(step, constant_values(step))):
        if node.metadata_props.get(FORWARD_NODE_KEY) == "optimizer":
            total += op_time(c, device, "float32", node_class(device, node, False), False, working_set=True)
    return total


FORWARD_NODE_KEY = "training.forward_node"  # partitioner.training.autodiff's metadata
REWRITE_KEY = "training.rewrite_of"  # partitioner.training.batchnorm's metadata


#: rule 1: a step's forward convs at ``conv_train`` when calibrated (off: at ``conv``)
TRAIN_FORWARD_PROBES = True


def forward_class(device: Any, op_class: str) -> str:
    """Rule 1: the class a training step's forward node of ``op_class`` runs at: ``conv_train``
    for a conv when the calibration measured it (the step's weights are graph inputs, which
    ONNX Runtime does not prepack), else the class itself."""
    key = f"{op_class}_train"
    ok = TRAIN_FORWARD_PROBES and op_class == "conv" and key in getattr(device, "efficiency_by_class", {})
    return key if ok else op_class


def backward_class(device: Any, op_class: str) -> str:
    """Rule 1: the class whose efficiency a backward node of ``op_class`` runs at:
    ``<class>_backward`` when the device's calibration measured it, else the class itself."""
    key = f"{op_class}_backward"
    return key if key in getattr(device, "efficiency_by_class", {}) else op_class


#: rule 1: a step's Where nodes (the ReLU gradient) at the calibrated ``where`` class (off: at
#: ``elementwise``)
TRAIN_WHERE_CLASS = True


#: rule 1: a step's ReduceSum over axis 0 of a 3-D or higher tensor (a batched weight
#: gradient's sum over its batch) at the calibrated ``reduce_batch`` class (off: ``reduction``).
#: A 2-D MatMul weight's gradient has no such sum since session 10 (one Gemm over the flattened
#: rows: ``training.rules.linear.MATMUL_FLAT_WEIGHT_GRAD``); the sums left are broadcast operands'
#: gradients (the zoo bert's position embedding) and the batched form with that rule off
TRAIN_REDUCE_BATCH_CLASS = True


#: rule 1: on TVM ranks (``device.runtime == "tvm"``) a one-group ConvTranspose of a weight (a
#: conv's input gradient) runs as a Conv (``partitioner.training.runner.TVM_CONV_TRANSPOSE_AS_CONV``
#: and pipeline hoist rule 4): stride 1 as a Conv of the flipped weight, equal strides ``s > 1`` in
#: hoist rule 4's phase form (a Conv with ``s*s`` times the output channels and ``Ty x Tx`` taps,
#: then DepthToSpace), so it is priced as the step's forward conv (:func:`forward_class` of
#: ``conv``) at the multiply-adds of the form it runs as (:func:`tvm_conv_flops_ratio`: 16/9 for
#: resnet's 3x3 stride-2, 4 for its 1x1 stride-2), not at the TVM ``conv_backward`` probe's
#: conv2d_transpose rate (the zoo resnet's 1-rank TVM step at batch 16: predicted 934 ms against
#: 470 measured before the stride-1 case).
TVM_CONV_TRANSPOSE_AS_CONV = True


def _tvm_runs_as_conv(device: Any, node: Any) -> bool:
    """The case of :data:`TVM_CONV_TRANSPOSE_AS_CONV`: a TVM device, a 2-d ConvTranspose with unit
    dilations, one group, unit strides and no output padding or equal strides without a bias,
    whose filter no node computes."""
    if not TVM_CONV_TRANSPOSE_AS_CONV or node.op_type != "ConvTranspose" or getattr(device, "runtime", "") != "tvm":
        return False
    attrs = node.attributes
    ints = {k: list(attrs[k].as_ints()) for k in ("strides", "dilations", "output_padding") if k in attrs}
    group = attrs["group"].as_int() if "group" in attrs else 1
    w = node.inputs[1] if len(node.inputs) > 1 else None
    strides = ints.get("strides", [1, 1])
    form = (strides == [1, 1] and not any(ints.get("output_padding", []))) or \
        (len(strides) == 2 and strides[0] == strides[1] > 1 and (len(node.inputs) < 3 or node.inputs[2] is None))
    return (group == 1 and form and all(v == 1 for v in ints.get("dilations", [1]))
            and w is not None and w.producer() is None)


def tvm_conv_flops_ratio(node: Any) -> float:
    """Multiply-adds of the form a :func:`_tvm_runs_as_conv` ConvTranspose runs as, over its own:
    1 at stride 1; ``s*s*Ty*Tx / (ky*kx)`` in the phase form (``T = (s-1+lo)//s + (k-1-lo)//s + 1``
    taps per axis, hoist rule 4; the Conv's output map is the ConvTranspose's input map when the
    output is a multiple of ``s``)."""
    attrs = node.attributes
    s = list(attrs["strides"].as_ints())[0] if "strides" in attrs else 1
    shape = node.inputs[1].shape
    if s == 1 or shape is None or len(shape) != 4 or not all(isinstance(d, int) for d in shape[2:]):
        return 1.0
    pads = list(attrs["pads"].as_ints()) if "pads" in attrs else [0, 0, 0, 0]
    taps = [(s - 1 + pads[a]) // s + (k - 1 - pads[a]) // s + 1 for a, k in enumerate(shape[2:])]
    return s * s * taps[0] * taps[1] / (shape[2] * shape[3])


#: rule 1: on TVM ranks a step's ``conv_train`` node takes roofline rule 6's small-map term at its
#: batch's output pixels (images x pixels per image) over the probes' batch
#: (:data:`CONV_PROBE_BATCH`), not per image (:func:`tvm_batch_columns`); off: per image, as on
#: ONNX Runtime
TVM_CONV_BATCH_COLUMNS = True
#: the batch of the calibration's ``conv_train`` probes (``calibrate.backward_kernels``: batch 4)
CONV_PROBE_BATCH = 4


def tvm_batch_columns(device: Any, node: Any, cls: str, columns: float) -> float:
    """Rule 1's columns for roofline rule 6 of a TVM rank's ``conv_train`` node (a forward conv, or
    an input gradient TVM runs as one): ``columns x N / CONV_PROBE_BATCH`` for a batch of ``N``
    images, so the probes' points (2x2 and 4x4 maps at batch 4) stand for the same pixels per
    call. Why: TVM's small-map cost is per call, not per image: it repacks a conv's weight (a
    graph input: the step's state) into its blocked layout on every call
    (``conv2d_weight_prepack``), and a weight's bytes over the conv's multiply-adds is
    ``2 / (N x pixels)`` whatever the channels and kernel. Measured (TVM, one thread, CPU time,
    a 3x3 conv with its weight as an input): 512 channels on 2x2 maps 10.3 ms at batch 4 and
    11.8 ms at batch 16 (7.4 and 25.5 GFLOP/s), 3.6 ms at batch 16 with a constant weight;
    256 channels on 4x4 maps 35 and 63 GFLOP/s at batch 4 and 16. Per image, the step's
    batch-16 layer4 convs were priced at the batch-4 probe's 7 GFLOP/s. ONNX Runtime (and any
    other class, or a node of unknown batch) keeps the per-image columns: its small-map loss is
    per image (roofline rule 6)."""
    x = node.inputs[0] if node.inputs else None
    shape = x.shape if x is not None else None
    if not TVM_CONV_BATCH_COLUMNS or cls != "conv_train" or getattr(device, "runtime", "") != "tvm" \
            or shape is None or len(shape) < 1 or not isinstance(shape[0], int):
        return columns
    return columns * shape[0] / CONV_PROBE_BATCH


def _sums_the_batch(node: Any) -> bool:
    """A ReduceSum over axis 0 only (constant axes input) of a tensor of rank 3 or more."""
    if node.op_type != "ReduceSum" or len(node.inputs) < 2 or node.inputs[1] is None:
        return False
    axes, x = node.inputs[1].const_value, node.inputs[0]
    if axes is None or x is None or x.shape is None or len(x.shape) < 3:
        return False
    return [int(a) for a in axes.numpy().reshape(-1)] == [0]


def node_class(device: Any, node: Any, backward: bool) -> str:
    """Rule 1: the class a training step's ``node`` runs at: ``where`` for a Where and
    ``reduce_batch`` for a ReduceSum over the batch axis of a batched product when the
    calibration measured them (ONNX Runtime runs both far below its other elementwise and
    reduction kernels: ``calibrate.backward_kernels``); a TVM rank's stride-1 ConvTranspose of a
    weight and its Conv-form weight gradient as the forward conv they run as
    (:data:`TVM_CONV_TRANSPOSE_AS_CONV`, :data:`TVM_CONV_WGRAD_AS_CONV`); else
    :func:`backward_class` of a backward node's class and :func:`forward_class` of the others'."""
    from partitioner.cost.ops import op_class

    table = getattr(device, "efficiency_by_class", {})
    if TRAIN_WHERE_CLASS and node.op_type == "Where" and "where" in table:
        return "where"
    if TRAIN_REDUCE_BATCH_CLASS and "reduce_batch" in table and _sums_the_batch(node):
        return "reduce_batch"
    if _tvm_runs_as_conv(device, node) or _tvm_conv_weight_gradient(device, node):
        return forward_class(device, "conv")
    return backward_class(device, op_class(node)) if backward else forward_class(device, op_class(node))


#: rule 1: on TVM ranks a Conv-form weight gradient (a one-group 2-D Conv whose kernel is the output
#: gradient: ``rules.linear.weight_grad``, the 7x7 stem's and any conv of more than
#: ``GEMM_MAX_OFFSETS`` offsets) runs at the step's forward conv class, not at ``conv_backward``
#: (off: at ``conv_backward``, the TVM ConvTranspose probes' rate)
TVM_CONV_WGRAD_AS_CONV = True


def _tvm_conv_weight_gradient(device: Any, node: Any) -> bool:
    """The case of :data:`TVM_CONV_WGRAD_AS_CONV`: a TVM device, a one-group 2-D Conv whose kernel
    (input 1) a node computes (the transposed output gradient), not a constant. TVM builds it as
    the ``conv2d`` it builds for a forward conv of an input weight (NHWC, the kernel packed per
    call), not as a transposed conv, so it runs at :func:`forward_class` of ``conv``
    (``conv_train``), at its own multiply-adds. Measured (the zoo resnet's 1-rank TVM step at batch
    16, ``benchmarks/train_tvm_profile.py``, VM instrument, thread CPU, Zen 4, load 0.6): the stem's
    weight gradient (x [3, 16, 64, 64] over a [64, 16, 32, 32] kernel, 308 MFLOP) 3.2 ms, priced
    20.0 ms at ``conv_backward`` (0.22 of the GEMM rate: TVM's ``conv2d_transpose`` probes), 4.1 at
    ``conv_train``. A Conv with a constant kernel (the MaxPool gradient's one-hot tap bank) and
    grouped or 1-D/3-D Conv forms (not measured) keep ``conv_backward``."""
    if not TVM_CONV_WGRAD_AS_CONV or node.op_type != "Conv" or getattr(device, "runtime", "") != "tvm":
        return False
    key = node.metadata_props.get(FORWARD_NODE_KEY)
    if key is None or key in ("loss", "optimizer") or len(node.inputs) < 2 or node.inputs[1] is None:
        return False
    w = node.inputs[1]
    group = node.attributes["group"].as_int() if "group" in node.attributes else 1
    made = w.producer() is not None and w.producer().op_type != "Constant" and w.const_value is None
    return group == 1 and made and w.shape is not None and len(w.shape) == 4


#: rule 1: on TVM ranks a Slice whose every use is a Concat, directly or through an Unsqueeze (the
#: conv weight gradient's im2col: Pad, 9 Slices of the padded map, Unsqueeze, Concat) costs nothing
#: of its own: TVM fuses the slices into the one kernel that writes the Concat's output, which
#: the Concat's price already streams (off: each Slice its own pass)
TVM_FUSED_IM2COL_SLICES = True


def _tvm_fused_gather_slice(device: Any, node: Any) -> bool:
    """The case of :data:`TVM_FUSED_IM2COL_SLICES`: a TVM device, a Slice, each of whose uses is a
    Concat or an Unsqueeze whose every use is a Concat. Measured (the zoo resnet's 1-rank TVM step
    at batch 16, VM instrument, thread CPU, load about 4): its 16 im2col chains ran as
    ``fused_transpose*_pad*_strided_slice*...`` kernels, 37.9 ms in all for 33 calls, where the
    model priced the 147 Slices 15.8 ms on top of the Concats' 39.4 and the Pads' 4.7 ms.
    ONNX Runtime runs every Slice as its own kernel."""
    if not TVM_FUSED_IM2COL_SLICES or node.op_type != "Slice" or getattr(device, "runtime", "") != "tvm":
        return False
    uses = [u for o in node.outputs for u, _ in o.uses()]

    def into_concat(u: Any) -> bool:
        if u.op_type == "Concat":
            return True
        return u.op_type == "Unsqueeze" and all(c.op_type == "Concat" for o in u.outputs for c, _ in o.uses()) \
            and any(True for o in u.outputs for _ in o.uses())

    return bool(uses) and all(into_concat(u) for u in uses)


#: rule 1: on TVM ranks the channels-last im2col Concat (``rules.linear`` rule "NHWC im2col": the
#: slices of the padded [N, H, W, C] map concatenated on the channel axis) is priced as one copy at
#: the calibrated copy bandwidth (:func:`tvm_im2col_copy_bytes`); off: a data-movement node by its
#: working set (roofline rule 7, the 16 MiB Transpose probe's rate)
TVM_IM2COL_AS_COPY = True


def tvm_im2col_copy_bytes(device: Any, node: Any) -> float:
    """The bytes of :data:`TVM_IM2COL_AS_COPY`'s copy (0 when the rule does not apply): a TVM
    device, a Concat on its last axis all of whose inputs are :func:`_tvm_fused_gather_slice`
    Slices (directly or through an Unsqueeze); the bytes are the Concat's output written and the
    slices' distinct sources read once (TVM fuses the slices, and the Pad before them, into the
    one kernel that writes the output: ``fused_transpose*_pad*_strided_slice*``; the Injective
    rule splits it into one vector copy per offset, ``backends/tvm/schedules/injective.py``), at
    ``memory_bandwidth`` (calibration probe 2: an array copy's read + write bytes a second).
    Why not roofline rule 7: its large-map point is a Transpose, a strided gather, where these
    copies move whole channel rows. Measured (the zoo resnet's 1-rank TVM step at batch 16,
    ``benchmarks/train_tvm_profile.py``, VM instrument, thread CPU, Zen 4, load 0.6): layer1's
    [16, 16, 16, 9 x 64] columns 0.49 ms a call (priced 3.97 ms by rule 7, 0.66 ms so), layer2's
    [16, 8, 8, 9 x 128] 0.24 ms (1.46; 0.33); all the im2col kernels 4.8 ms a step against 24.9
    priced. The channels-first form (layer4's, a Concat on axis 2 then a Transpose: a select
    over the offsets per element, 0.7 ms for 1.2 MB) is not a copy and keeps rule 7."""
    from partitioner.cost.ops import nbytes

    if not TVM_IM2COL_AS_COPY or node.op_type != "Concat" or getattr(device, "runtime", "") != "tvm":
        return 0.0
    y = node.outputs[0]
    axis = node.attributes["axis"].as_int() if "axis" in node.attributes else 0
    if y.shape is None or axis not in (-1, len(y.shape) - 1):
        return 0.0
    sources: dict[int, Any] = {}
    for v in node.inputs:
        p = v.producer() if v is not None else None
        if p is not None and p.op_type == "Unsqueeze":
            p = p.inputs[0].producer() if p.inputs[0] is not None else None
        if p is None or not _tvm_fused_gather_slice(device, p) or p.inputs[0] is None:
            return 0.0
        sources[id(p.inputs[0])] = p.inputs[0]
    return nbytes(y) + sum(nbytes(v) for v in sources.values())


def reuse_reads(nodes: list[Any], costs: list[Any]) -> list[tuple[tuple[float, float], ...]]:
    """Rule 12: per node (in step order), (bytes, reuse distance) of each distinct input whose
    distance exceeds the node's own bytes (``costs[i].bytes``): the bytes the nodes between the
    input's last access and this node read and wrote, over the step as a cycle (two passes; the
    second's distances count)."""
    from partitioner.cost.ops import nbytes

    ends, total = [], 0.0
    for c in costs:
        total += c.bytes
        ends.append(total)  # the traffic when node i is done
    last: dict[int, float] = {}
    out: list[tuple[tuple[float, float], ...]] = [()] * len(nodes)
    for lap in (0.0, total):
        for i, (node, c) in enumerate(zip(nodes, costs)):
            start = lap + ends[i] - c.bytes
            values = [v for v in dict.fromkeys(node.inputs) if v is not None]
            if lap:
                far = ((nbytes(v), start - last[id(v)]) for v in values if id(v) in last)
                out[i] = tuple((b, d) for b, d in far if b > 0 and d > c.bytes)
            for v in (*values, *node.outputs):
                last[id(v)] = lap + ends[i]
    return out


def priced_step_nodes(step: Any, device: Any) -> list[tuple[Any, str | None, float]]:
    """Rule 1's price of every node of the step graph ``step``: (node, its forward-node key
    (``training.forward_node``: None for a forward node), seconds)."""
    from partitioner.cost.roofline import fused_nodes, op_time
    from partitioner.cost.workdepth import constant_values, node_costs

    fused = fused_nodes(step)
    out = []
    nodes, costs = list(step), node_costs(step, constant_values(step))
    if CO_RUN_REUSE_DISTANCE and getattr(device, "co_running", False):  # rule 12
        costs = [replace(c, reuse=r) if r else c for c, r in zip(costs, reuse_reads(nodes, costs))]
    for node, c in zip(nodes, costs):
        key = node.metadata_props.get(FORWARD_NODE_KEY)
        if _tvm_fused_gather_slice(device, node):  # rule 1: inside its Concat's one kernel
            out.append((node, key, 0.0))
            continue
        copied = tvm_im2col_copy_bytes(device, node)
        if copied:  # rule 1: one copy kernel at the copy bandwidth
            out.append((node, key, copied / device.memory_bandwidth + device.launch_overhead_s))
            continue
        cls = node_class(device, node, key is not None and key not in ("loss", "optimizer"))
        if _tvm_runs_as_conv(device, node):  # rule 1: the multiply-adds of the form TVM runs
            c = replace(c, flops=c.flops * tvm_conv_flops_ratio(node))
        c = replace(c, columns=tvm_batch_columns(device, node, cls, c.columns))
        on = train_gemm_device(device, node, cls)
        out.append((node, key, op_time(c, on, "float32", cls, node in fused, working_set=True)))
    return out


#: rule 1: a step's forward products whose weight operand is a graph input (the step's state) at
#: the calibrated ``gemm_train`` / ``gemm_large_train`` pair when measured (off: at the ``gemm`` /
#: ``gemm_large`` probes', whose weights are constant)
TRAIN_GEMM_PROBES = True


def train_gemm_device(device: Any, node: Any, cls: str) -> Any:
    """Rule 1: the device a step's ``gemm``-class forward product is priced on: for a product
    whose second operand is a graph input (the step's weights are: its state), ``device`` with
    the ``gemm_train`` / ``gemm_large_train`` probes' values (the calibration's MatMuls with the
    weight as an input: ``calibrate.backward_kernels``) in place of ``gemm`` / ``gemm_large``,
    so roofline rule 5 interpolates between those; else ``device``. Why: ONNX Runtime prepacks a
    constant MatMul weight once, at session creation, and packs an input one on every call.
    Measured (ORT, one thread, thread CPU, 9 interleaved rounds, load 6.4-7.1): input over
    constant weight 1.13x at 128x256x256, 1.12x at 256x1024x1024, 1.05-1.18x at the zoo bert's
    2048-row and the mlp's 1024-row products; the ``gemm`` probes' constant weights had priced
    every forward product of a training step at the prepacked rate."""
    table = getattr(device, "efficiency_by_class", {})
    if not TRAIN_GEMM_PROBES or cls != "gemm" or "gemm_train" not in table or "gemm_large_train" not in table:
        return device
    w = node.inputs[1] if len(node.inputs) > 1 else None
    if w is None or not w.is_graph_input():
        return device
    return replace(device, efficiency_by_class={**table, "gemm": table["gemm_train"],
                                                "gemm_large": table["gemm_large_train"]})


def step_times(step: Any, device: Any, names: list[str], forward: np.ndarray,
               backward: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Rule 1 from the step graph ``step`` (an onnx-ir graph): (forward, backward) seconds per
    forward node ``names``; a forward node the step graph does not name keeps ``forward`` /
    ``backward`` (the factor rule); step nodes of no known forward node are spread evenly."""
    nodes = list(step)
    index = {n: i for i, n in enumerate(names)}
    rewrite = {n.name: n.metadata_props.get(REWRITE_KEY) for n in nodes if n.metadata_props.get(REWRITE_KEY)}
    fwd, bwd = np.zeros(len(names)), np.zeros(len(names))
    seen_f, seen_b = np.zeros(len(names), bool), np.zeros(len(names), bool)
    other = loss = 0.0
    for node, key, t in priced_step_nodes(step, device):
        is_backward = key is not None and key not in ("loss", "optimizer")
        if key == "optimizer":
            continue  # rule 2 (the optimizer's own formula)
        if key == "loss":
            loss += t
            continue
        target = key if is_backward else node.name
        i = index.get(rewrite.get(target, target))
        if i is None:
            other += t
        elif is_backward:
            bwd[i] += t
            seen_b[i] = True
        else:
            fwd[i] += t
            seen_f[i] = True
    fwd = np.where(seen_f, fwd, forward)
    fwd[-1] += loss
    bwd = np.where(seen_b | seen_f, bwd, backward)
    return fwd, bwd + other / max(1, len(names))


#: rule 9: a pipeline plan whose last stage defers its weight gradients (pipeline rule 10) is
#: priced as it runs (off: every stage computes and accumulates its weight gradients per
#: micro-batch, as before rule 10)
PRICE_DEFERRED_WGRAD = True


def _is_backward(node: Any) -> bool:
    key = node.metadata_props.get(FORWARD_NODE_KEY)
    return key is not None and key not in ("loss", "optimizer")


def weight_gradient_only(step: Any) -> set[Any]:
    """Rule 9: the backward nodes of the step graph ``step`` that only compute weight gradients
    (deferred_wgrad rule 1's ``W``): no path from them reaches the loss or a backward node of
    another forward node (the gradient of a forward value, which earlier layers' backward
    reads), so they end in the weight gradients and the optimizer alone. A conv's im2col and
    weight-gradient product, a Gemm's ``dY^T X``, a bias's sum are; an input gradient, a
    ReLU gradient's Where, a BatchNormalization's shared backward are not."""
    per_micro_batch: dict[Any, bool] = {}
    for node in reversed(list(step)):
        if not _is_backward(node):
            continue
        key = node.metadata_props.get(FORWARD_NODE_KEY)
        per_micro_batch[node] = any(
            c.metadata_props.get(FORWARD_NODE_KEY) == "loss"
            or (_is_backward(c) and (c.metadata_props.get(FORWARD_NODE_KEY) != key or per_micro_batch.get(c, False)))
            for o in node.outputs for c, _ in o.uses())
    return {n for n, needed in per_micro_batch.items() if not needed}


def weight_gradient_times(step: Any, device: Any, names: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """Rule 9: per forward node ``names``, the seconds and the node count of its weight-gradient-only
    backward nodes (:func:`weight_gradient_only`) in the step graph ``step``, priced as rule 1."""
    index = {n: i for i, n in enumerate(names)}
    only = weight_gradient_only(step)
    rewrite = {n.name: n.metadata_props.get(REWRITE_KEY) for n in step if n.metadata_props.get(REWRITE_KEY)}
    seconds, count = np.zeros(len(names)), np.zeros(len(names))
    for node, key, t in priced_step_nodes(step, device):
        i = index.get(rewrite.get(key, key)) if node in only else None
        if i is not None:
            seconds[i] += t
            count[i] += 1
    return seconds, count


def _state_arrays(tensors: float, copies: int) -> float:
    """Rule 7: the state arrays a step takes and returns (weights and their optimizer copies)."""
    return 2 * tensors * (1 + copies)


def _whole_step_fixed(p: _Profile, copies: int, comm_ops: int) -> float:
    """Rule 7 for one step program (``single``/``data``/``tensor``): its calls, nodes, arrays and
    returned state; 0 without overheads."""
    if p.overheads is None:
        return 0.0
    nodes = float(p.step_nodes.sum() if p.step_nodes is not None else len(p.names)) + p.loss_nodes + p.optimizer_nodes
    arrays = _state_arrays(float(p.weight_tensors.sum()), copies) + 3 + 2 * comm_ops
    out_bytes = float(p.weight.sum()) * (1 + copies)
    return p.overheads.per_step_s + p.fixed(1 + comm_ops, nodes, arrays, out_bytes)


def resident_bytes(weight_bytes: float, copies: int, activations: float, extra_gradients: int = 0) -> float:
    """Rule 3: ``3 S + G (1 + extra_gradients) + activations``."""
    state = weight_bytes * (1 + copies)
    return 3 * state + weight_bytes * (1 + extra_gradients) + activations


def _optimizer_time(weight_bytes: float, copies: int, device: Any, p: _Profile | None = None) -> float:
    """Rule 2 for ``weight_bytes`` of the weights: their share of the step's optimizer nodes'
    time (``p.optimizer_s``, ONNX Runtime), else a pass reading W, g and the state and writing W
    and the state."""
    if p is not None and p.optimizer_s is not None:
        return p.optimizer_s * weight_bytes / max(float(p.weight.sum()), 1.0)
    moved = weight_bytes * (2 + 1 + 2 * copies)
    return moved / (device.memory_bandwidth * optimizer_stream_efficiency(moved, device))


#: rule 2: the formula's pass over the weights at the roofline's working-set efficiency of an
#: elementwise op of its bytes (:func:`optimizer_stream_efficiency`); off: at the full DRAM
#: bandwidth (efficiency 1)
OPTIMIZER_WORKING_SET = True


def optimizer_stream_efficiency(moved_bytes: float, device: Any) -> float:
    """Rule 2's efficiency for a pass moving ``moved_bytes``: roofline rule 7's ``elementwise``
    efficiency at that working set when the calibration measured ``elementwise_large`` (the
    update of a zoo model's weights, tens of MiB, streams them from DRAM as the large probe's
    Add does), else 1. Measured (TVM, the zoo resnet's 1-rank SGD step, 45 MiB of weights, one
    thread, VM instrument, load 1-2): its ``reshape_multiply_subtract`` update kernels, the same
    at batch 16 and 8, 24-27 ms a step, against 4.9 ms for the pass at full bandwidth and 15 ms
    at the cached ``elementwise_large`` value (0.32)."""
    from partitioner.cost.ops import OpCost
    from partitioner.cost.roofline import memory_efficiency

    table = getattr(device, "efficiency_by_class", {})
    if not OPTIMIZER_WORKING_SET or "elementwise_large" not in table or moved_bytes <= 0:
        return 1.0
    cost = OpCost(0.0, moved_bytes * 2 / 3, moved_bytes / 3, 1.0)
    return memory_efficiency(cost, device, "float32", "elementwise", device.class_efficiency("elementwise"))


def single_or_data(p: _Profile, strategy: str, devices: int, batch: int, copies: int, cluster: Any,
                   device: Any, overlap: bool = True, list_buckets: bool = False,
                   sharded_update: bool = False) -> TrainingPrediction:
    """Rule 4 for ``single`` / ``data`` (``p`` profiled at the local batch); ``list_buckets``:
    the buckets are AllReduced as lists (rules 3 and 4); ``sharded_update``: the ranks shard the
    optimizer update (TVM data ranks, :mod:`partitioner.training.overlap` rule 11), so a rank
    pays ``1/devices`` of it where the last bucket takes the shared window (the path the
    sharded update needs; :func:`partitioner.cost.comm.shm_lent_saving` > 0)."""
    from partitioner.cost.comm import collective_time, shm_lent_saving

    w = float(p.weight.sum())
    comm = 0.0
    overlapped = None
    buckets = 0
    passes = 0.0
    if strategy == "data" and devices > 1:
        comm = collective_time("allreduce", w + 4, list(range(devices)), cluster).seconds \
            - shm_lent_saving(([0.0] + [b for _, b in gradient_buckets(p)])[-1], list(range(devices)), cluster)
        # (the runtime lends the last bucket: no copy out)
        overlapped = overlapped_backward(p, devices, cluster)
        buckets = len(gradient_buckets(p))
        passes = 0.0 if list_buckets else BUCKET_PASSES * 2 * w / device.memory_bandwidth
    shard = devices if strategy == "data" and devices > 1 and sharded_update and shm_lent_saving(
        ([0.0] + [b for _, b in gradient_buckets(p)])[-1], list(range(devices)), cluster) > 0 else 1
    parts = {"forward_s": float(p.forward.sum()), "backward_s": float(p.backward.sum()),
             "optimizer_s": _optimizer_time(w / shard, copies, device, p) + passes, "comm_s": comm,
             "fixed_s": _whole_step_fixed(p, copies, buckets)}
    step = sum(parts.values())
    if overlapped is not None:
        parts["step_without_overlap_s"] = step
        parts["step_with_overlap_s"] = parts["forward_s"] + overlapped + parts["optimizer_s"] + parts["fixed_s"]
        step = parts["step_with_overlap_s"] if overlap else step
    live = p.step_live if STEP_LIVE_ACTIVATIONS and p.step_live is not None else float(p.activation.sum())
    mem = resident_bytes(w, copies, live)
    if strategy == "data" and devices > 1:
        mem += (LIST_BUCKET_COPIES if list_buckets else BUCKET_COPIES) * w
    return TrainingPrediction(strategy, devices, batch, step, batch / step, [mem] * devices, parts)


def gradient_buckets(p: _Profile) -> list[tuple[int, float]]:
    """Rule 5's buckets: (index of the node whose backward completes the bucket, bytes), in
    backward order."""
    buckets: list[tuple[int, float]] = []
    size, last = 0.0, -1
    for i in range(len(p.weight) - 1, -1, -1):
        b = float(p.weight[i])
        if b <= 0:
            continue
        if size and size + b > BUCKET_BYTES:
            buckets.append((last, size))
            size = 0.0
        size, last = size + b, i
    if size:
        buckets.append((last, size))
    return buckets


def overlapped_backward(p: _Profile, devices: int, cluster: Any) -> float:
    """Rule 5: the time from the backward's start to the end of both the backward and the last
    bucket's AllReduce, each AllReduce started once its bucket exists (the last one without its
    copy out where the runtime lends it, :func:`partitioner.cost.comm.shm_lent_saving`)."""
    from partitioner.cost.comm import collective_time, shm_lent_saving

    done = np.cumsum(p.backward[::-1])[::-1]  # done[i]: backward time once node i's backward ran
    end = 0.0
    buckets = gradient_buckets(p)
    for k, (node, size) in enumerate(buckets):
        t = collective_time("allreduce", size, list(range(devices)), cluster).seconds
        if k == len(buckets) - 1:  # the runtime lends the last bucket: no copy out
            t -= shm_lent_saving(size, list(range(devices)), cluster)
        end = max(float(done[node]), end) + t
    return max(float(p.backward.sum()), end)


def stashed_micro_batches(schedule: str, stages: int, m: int, extra_warmup: int = 0) -> list[int]:
    """Rule 3's in-flight counts per stage: GPipe ``M``; 1F1B ``min(S - s + e, M)``, ``e`` the
    extra warm-up on the stages before the last (pipeline rule 5; its runner's order keeps
    exactly these many stashes at its peak)."""
    return [m if schedule == "gpipe" else min(stages - s + (extra_warmup if s < stages - 1 else 0), m)
            for s in range(stages)]


def pipeline(p: _Profile, ends: list[int], batch: int, copies: int, schedule: str, m: int, cluster: Any,
             device: Any, recompute: bool = False, extra_warmup: int = 0,
             stage_memory: list[float] | None = None, last_stage_live: float | None = None) -> TrainingPrediction:
    """Rule 4 for ``pipeline`` (``p`` profiled at the micro-batch; ``ends``: each stage's last
    node); rule 6 with ``recompute``; rule 3's 1F1B stash counts with the plan's ``extra_warmup``
    (pipeline rule 5: :func:`partitioner.training.pipeline.extra_warmup` for the backend).
    ``stage_memory``: each stage's peak priced from its own programs (rule 3's TVM stages,
    :func:`partitioner.cost.memory.tvm_stage_memory`), in place of rule 3's sum.
    ``last_stage_live``: rule 3's activations on the last stage from its programs (ONNX Runtime,
    :func:`partitioner.cost.memory.ort_last_stage_activations`), in place of its stash."""
    from partitioner.cost.comm import collective_time
    from partitioner.cost.ops import nbytes
    from partitioner.cost.pipeline import pipeline_step_time

    stages = len(ends)
    starts = [0] + [e + 1 for e in ends[:-1]]
    spans = [slice(a, b + 1) for a, b in zip(starts, ends)]
    again = [recompute and i < stages - 1 for i in range(stages)]  # rule 6: one more forward
    stage_t = [float(p.forward[s].sum() * (2 if again[i] else 1) + p.backward[s].sum()) for i, s in enumerate(spans)]
    sends = [2 * collective_time("send", cut_bytes(p.graph, ends[k]), [k, k + 1], cluster).seconds
             for k in range(stages - 1)]  # activations forward and their gradients back
    ws = [float(p.weight[s].sum()) for s in spans]
    stage_t, accumulated, tail = _deferred_last_stage(p, spans, stage_t, ws)
    stage_t, head, lifted = _step_constant_stages(p, spans, stage_t)
    # rule 8: every micro-batch but the first adds its gradients into the accumulator
    stage_t = [t + 3 * w * (m - 1) / m / device.memory_bandwidth for t, w in zip(stage_t, accumulated)]
    mb_fixed, upd_fixed = _pipeline_fixed(p, spans, copies)
    stage_t = [t + f for t, f in zip(stage_t, mb_fixed)]
    opt = [_optimizer_time(w, copies, device, p) + f for w, f in zip(ws, upd_fixed)]
    per_step = p.overheads.per_step_s if p.overheads is not None else 0.0
    step = pipeline_step_time(stage_t, sends, m) + tail + head + max(opt) + per_step
    inflight = stashed_micro_batches(schedule, stages, m, extra_warmup)
    inputs = [float(sum(nbytes(v) for v in p.graph.inputs))] + [cut_bytes(p.graph, e) for e in ends[:-1]]
    held = [float(p.activation[s].sum()) + inputs[i] * inflight[i] if again[i]
            else float(p.activation[s].sum()) * inflight[i] for i, s in enumerate(spans)]
    if last_stage_live is not None:  # the last stage never recomputes (rule 6)
        held[-1] = last_stage_live
    mem = [resident_bytes(float(p.weight[s].sum()), copies, held[i], PIPELINE_GRADIENT_COPIES) + lifted[i]
           for i, s in enumerate(spans)] if stage_memory is None else list(stage_memory)
    parts = {"forward_s": float(p.forward.sum()) * m, "backward_s": float(p.backward.sum()) * m,
             "optimizer_s": max(opt), "comm_s": sum(sends) * m, "bottleneck_stage_s": max(stage_t),
             "fixed_s": per_step + max(f * m for f in mb_fixed) + max(upd_fixed), "deferred_tail_s": tail,
             "step_constants_head_s": head}
    return TrainingPrediction("pipeline", stages, batch, step, batch / step, mem, parts, schedule, m,
                              [float(p.weight[s].sum()) for s in spans], recompute)


def _deferred_last_stage(p: _Profile, spans: list[slice], stage_t: list[float],
                         ws: list[float]) -> tuple[list[float], list[float], float]:
    """Rule 9: (per-micro-batch stage times, the weight bytes each stage accumulates (rule 8),
    the step's tail) with the last stage's weight gradients deferred when ``p.deferred`` is set:
    its micro-batches run without their weight-gradient-only nodes and accumulate nothing, and
    its whole-batch weight-gradient program runs once after its last micro-batch, while the
    earlier stages run their last backwards (one backward per earlier stage: the drain); the
    step is longer by what that program takes beyond them."""
    d = p.deferred if PRICE_DEFERRED_WGRAD else None
    if d is None or len(spans) < 2:
        return stage_t, ws, 0.0
    last = spans[-1]
    drain = sum(float(p.backward[s].sum()) for s in spans[:-1])
    stage_t = [*stage_t[:-1], stage_t[-1] - float(d.micro[last].sum())]
    return stage_t, [*ws[:-1], 0.0], max(0.0, float(d.whole[last].sum()) - drain)


def _pipeline_fixed(p: _Profile, spans: list[slice], copies: int) -> tuple[list[float], list[float]]:
    """Rule 7 per stage: the fixed cost of one micro-batch (``F`` + ``B`` calls, the last stage's
    one fused call with the loss) and of the update call; zeros without overheads."""
    if p.overheads is None:
        return [0.0] * len(spans), [0.0] * len(spans)
    nodes = p.step_nodes if p.step_nodes is not None else np.ones(len(p.names))
    total_w = max(float(p.weight.sum()), 1.0)
    mb, upd = [], []
    d = p.deferred if PRICE_DEFERRED_WGRAD and len(spans) > 1 else None
    for i, s in enumerate(spans):
        last = i == len(spans) - 1
        tensors, w = float(p.weight_tensors[s].sum()), float(p.weight[s].sum())
        n = float(nodes[s].sum()) + (p.loss_nodes if last else 0)
        deferred = float(d.nodes[s].sum()) if d is not None and last else None
        # F: data or received values + weights in, sends + stash out; B: stash + weights +
        # output gradients in, weight and input gradients out (the fused call: both in one);
        # rule 9: a deferring stage's micro-batches return no weight gradients, and its
        # weight-gradient program is one more call per step, returning them
        mb.append(p.fixed(1 if last else 2, n - (deferred or 0.0), (3 if last else 4) * tensors + 6,
                          0.0 if deferred is not None else w) + p.overheads.per_micro_batch_s)
        upd.append(p.fixed(1, p.optimizer_nodes * w / total_w, _state_arrays(tensors, copies) + tensors + 1,
                           w * (1 + copies))
                   + (p.fixed(1, deferred, 2 * tensors, w) if deferred is not None else 0.0))
    return mb, upd


def cut_bytes(graph: Any, end: int) -> float:
    """Bytes of the values produced at or before node ``end`` and read after it (the data
    inputs are not sent: every stage rank holds the batch)."""
    from partitioner.cost.ops import nbytes

    nodes = list(graph)
    after = {id(n) for n in nodes[end + 1:]}
    return float(sum(nbytes(o) for n in nodes[:end + 1] for o in n.outputs
                     if any(id(u) in after for u, _ in o.uses())))


def tensor(p: _Profile, world: int, batch: int, copies: int, split: set[str], allreduce_bytes: list[float],
           cluster: Any, device: Any) -> TrainingPrediction:
    """Rule 4 for ``tensor``: ``split`` names the pairs' nodes; ``allreduce_bytes`` the f and g
    AllReduces' sizes."""
    from partitioner.cost.comm import collective_time

    share = np.array([1.0 / world if name in split else 1.0 for name in p.names])
    comm = sum(collective_time("allreduce", b, list(range(world)), cluster).seconds for b in allreduce_bytes)
    w = float((p.weight * share).sum())
    parts = {"forward_s": float((p.forward * share).sum()), "backward_s": float((p.backward * share).sum()),
             "optimizer_s": _optimizer_time(w, copies, device, p), "comm_s": comm,
             "fixed_s": _whole_step_fixed(p, copies, len(allreduce_bytes))}
    step = sum(parts.values())
    # the comm ops' inputs and outputs stay in the rank's value table for the whole step (the
    # program runs as segments between them), and the deterministic reduction gathers every
    # rank's copy of the largest (rule 3)
    held = 2 * sum(allreduce_bytes) + world * max(allreduce_bytes, default=0.0)
    mem = resident_bytes(w, copies, float((p.activation * share).sum()) + held)
    return TrainingPrediction("tensor", world, batch, step, batch / step, [mem] * world, parts)


#: rule 10: a TVM pipeline plan whose stages hoist and lift their weight-only work (hoist rules 5 and
#: 7: the HWIO weight transposes and the conv schedule's weight packing) is priced as it runs: its
#: convs over a stage weight without that work per micro-batch, the work once per step, its buffers
#: in the stage's memory (off: every micro-batch's convs pay it, as before those rules)
PRICE_STEP_CONSTANTS = True


def _conv_over_weight(device: Any, node: Any) -> bool:
    """Rule 10's nodes: a forward Conv whose filter is a graph input (a stage weight), or a
    ConvTranspose TVM runs as a Conv of a weight (:func:`_tvm_runs_as_conv`: the input gradient)."""
    if node.op_type == "Conv":
        w = node.inputs[1] if len(node.inputs) > 1 else None
        return w is not None and w.is_graph_input()
    return _tvm_runs_as_conv(device, node)


def step_constant_prices(step: Any, device: Any, names: list[str], lift_min_bytes: float) -> StepConstants:
    """Rule 10 on the step graph ``step`` built at the micro-batch: per forward node ``names``,
    the weight-only work of its convs over a weight (:func:`_conv_over_weight`) and the buffers
    it leaves (see :data:`PRICE_STEP_CONSTANTS` and the module's rule 10)."""
    from partitioner.cost.ops import nbytes
    from partitioner.cost.roofline import fused_nodes, op_time
    from partitioner.cost.workdepth import constant_values, node_costs

    index = {n: i for i, n in enumerate(names)}
    rewrite = {n.name: n.metadata_props.get(REWRITE_KEY) for n in step if n.metadata_props.get(REWRITE_KEY)}
    priced = {id(node): t for node, _key, t in priced_step_nodes(step, device)}
    fused = fused_nodes(step)
    work, held = np.zeros(len(names)), np.zeros(len(names))
    for node, c in zip(list(step), node_costs(step, constant_values(step))):
        if not _conv_over_weight(device, node):
            continue
        key = node.metadata_props.get(FORWARD_NODE_KEY) or node.name
        i = index.get(rewrite.get(key, key))
        if i is None:
            continue
        ratio = tvm_conv_flops_ratio(node) if node.op_type == "ConvTranspose" else 1.0
        constant = op_time(replace(c, flops=c.flops * ratio), device, "float32", "conv", node in fused, working_set=True)
        work[i] += max(0.0, priced[id(node)] - constant)
        w = nbytes(node.inputs[1]) * ratio  # the filter the conv runs with (the phase form's: ratio x)
        held[i] += w * (2 if nbytes(node.inputs[1]) >= lift_min_bytes else 1)
    return StepConstants(work, held)


def _step_constant_stages(p: _Profile, spans: list[slice], stage_t: list[float]) -> tuple[list[float], float, list[float]]:
    """Rule 10 per stage: (per-micro-batch times without the weight-only work, the step's head:
    how long the slowest stage's once-per-step work delays its first micro-batch beyond the fill
    that reaches it, the bytes held); unchanged, 0 and zeros without ``p.constants``."""
    c = p.constants if PRICE_STEP_CONSTANTS else None
    if c is None:
        return stage_t, 0.0, [0.0] * len(spans)
    once = [float(c.work[s].sum()) for s in spans]
    fill = np.concatenate([[0.0], np.cumsum([float(p.forward[s].sum()) for s in spans[:-1]])])
    head = max(0.0, *(o - float(f) for o, f in zip(once, fill)))
    return [t - o for t, o in zip(stage_t, once)], head, [float(c.held[s].sum()) for s in spans]
