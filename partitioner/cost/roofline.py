"""Roofline time of one operator on one device (COST_MODEL.md), with per-class efficiency and
kernel fusion.

    t = max(FLOPs / (F_peak(dtype) · eff), bytes / (B_mem · eff)) + launch overhead

Rules:

1. ``eff`` is the device's efficiency for the op's class (``Device.efficiency_by_class``, classes
   from :func:`partitioner.cost.ops.op_class`), falling back to ``Device.efficiency`` when the
   class is not given or not listed.
2. Ops that do nothing (zero FLOPs and zero bytes: views, shape ops, comm placeholders) cost no
   launch overhead either, since runtimes do not launch a kernel for them.
3. Fusion (``fused=True``): an op that a backend fuses into the kernel of its producer starts no
   kernel, so it pays no launch overhead. A fused *elementwise* op (bias add, ReLU, Clip,
   BatchNorm after folding, ...) runs as the producer's epilogue on values still in registers,
   so it pays only its compute roof, not its memory roof.
4. Which ops are fused (:func:`fused_nodes`): when the graph carries fusion groups
   (``passes/fusion_groups.py``), every member of a group except its first (in graph order).
   Otherwise the simple rule: an elementwise op whose only non-constant input is produced by a
   compute op (class gemm, conv, depthwise_conv, elementwise, norm or pool) and read by nothing
   else (not a graph output either). This follows what the TVM backend's FuseOps and ONNX
   Runtime's Conv/Gemm+activation fusions do; it is a model, not a copy of either.
5. GEMM efficiency by working set (:func:`op_efficiency`; when the calibration measured the
   ``gemm_large`` probe): a contraction's efficiency depends on whether its operands stay in
   cache. The ``gemm`` class value is measured on in-cache probes (``GEMM_PROBE``, 128x256x256,
   and a 1x256x512 GEMV: 512 KiB of operands each, in L2; the GEMV runs from cache at several
   times the DRAM roof), ``gemm_large`` on ``GEMM_LARGE_PROBE`` (256x1024x1024, 6 MiB: out of
   L2). A compute-bound ``gemm`` op whose bytes (A, B and C) are ``ws`` runs at the log-linear
   interpolation of the two in ``log ws`` (the class value at ``GEMM_PROBE``'s bytes), clamped
   to the nearer end outside their range; a memory-bound one (below the ridge point) at the
   class value. Measured on the 2-core EPYC with ONNX Runtime: the zoo mlp's 1024-wide layers at
   batch 1024 (12 MiB) ran at 0.88 of the 1024^3 numpy rate where the class value priced them at
   1.33; the out-of-cache probe measured 0.67-0.99 over five loaded calibrations. A backward
   contraction (``gemm_backward``, whose probes are ``GEMM_PROBE``-sized, in cache) interpolates
   the same way from its own class value to ``gemm_large``: out of cache, the operands' traffic
   sets the rate whichever operand is transposed. Without ``gemm_large`` (an older calibration)
   the class value is used as is. Inference ops of the zoo models (at most
   512 KiB) keep the class value: the inference cost table is unchanged by this rule.
6. Convolutions by output pixels per image (:func:`op_efficiency`, ``CONV_COLUMNS`` on; when the
   calibration measured the small-map probes): a CPU backend runs a conv as one GEMM per image
   whose column count is the image's output pixels (``OpCost.columns``; a ConvTranspose's, its
   input's), and a GEMM of a few columns wastes most of each vector strip and re-streams the
   weights per image. Measured (ONNX Runtime, the zoo resnet-18 at 64x64, batch 16): layer4's
   3x3 convs (2x2 maps) at 14 GFLOP/s and their ConvTransposes at 8, against 85-87 for layer2-3's
   convs, where the class value priced them all alike (stage 1 of the pipeline, layer3-4, then
   measured 2.1-2.4x stage 0, priced near equal). Calibration times the training step's forms
   of a 3x3 conv (its ConvTranspose; the forward conv with its weights as an input) on a 4x4 map
   (classes ``<c>_px16``) and on a 2x2 map (``<c>_px4``) beside the class's own probes, whose
   smallest map is 7x7 (``CONV_REF_COLUMNS`` = 49). A ``conv_backward`` or ``conv_train`` op of
   ``P`` columns runs at the piecewise log-linear interpolation in
   ``log P`` over the points (4, ``<c>_px4``), (16, ``<c>_px16``), (49, the class value), clamped
   to the end points outside them; from 49 columns up (every probe of the class) the class value
   (``conv_train``: a training step's forward convs, :mod:`partitioner.cost.training` rule 1).
   Inference convs (constant weights) have no small-map term: the same convs with constant
   weights ran at the ``conv`` class value on the small maps (0.90-1.12 of the GEMM rate).
7. Elementwise and data-movement ops by working set (``working_set=True``: the training cost
   model's step nodes, :mod:`partitioner.cost.training` rule 1; when the calibration measured
   ``elementwise_large`` / ``data_movement_large``; ``MEMORY_WORKING_SET`` on): the classes'
   own probes run on maps of at most 800 KiB, which stay in L2 (ONNX Runtime's elementwise class
   came out at 2.8x the DRAM copy bandwidth), where a training step at batch 16 streams maps of
   4-18 MiB (the zoo resnet's stem and layer1 BatchNormalization backward, the conv weight
   gradient's im2col): measured there at 0.3-0.4 of their price. Calibration times an Add and a
   Transpose of 16 MiB maps (``LARGE_MAP``, beyond L2 and this machine's 32 MiB L3 for the
   Add's 48 MiB); a memory-bound op of those classes whose bytes exceed its class probe's
   (``MEMORY_PROBE_BYTES``: the in-cache probe's Add of two 64x56x56 maps, a Transpose and a
   Concat of 64x28x28 maps) runs at the log-linear interpolation in ``log bytes`` from the class
   value to the large probe's, clamped beyond it. Inference keeps the class value (its batch-1
   maps are mostly in cache, and its cost table is checked without this rule).
8. Co-run bandwidth by working set (:func:`co_run_gain`; a device that
   :func:`partitioner.cost.training.co_located` marked ``co_running``, whose calibration measured
   the in-cache co-run copy): the memory roof of a rank that runs beside others on its node is
   ``memory_bandwidth`` (already at the out-of-cache share, training rule 11) x the gain of the
   op's bytes: the share at :data:`CO_RUN_CACHED_BYTES` (``co_run_cached_bandwidth``) over the
   out-of-cache share at or below those bytes, 1 at or beyond :data:`CO_RUN_DRAM_BYTES`, the share
   interpolated linearly in ``log bytes`` between. Why: the caches are the core's own, the DRAM
   path is shared. Measured on Zen 5 (session 27, both cores copying against one): 0.93-0.97 of
   the lone rate for copies of 2-8 MiB moved, 0.56 at 16 MiB, 0.42-0.53 at 32-128 MiB
   (``benchmarks/co_run.py --sweep``, ``session27_zen5/co_run_sweep.json``; the drop comes
   between 8 and 16 MiB, which the log-linear rule spreads over 2-64 MiB); with every
   memory-bound node of the zoo resnet's step at the out-of-cache share, its 2-rank TVM steps
   were predicted at +19% (data, batch 32 per rank) and +42% (1F1B, micro-batch 8), whose maps
   are mostly 0.5-8 MiB. An input read long after it was last touched (``OpCost.reuse``: a
   training step's stashed activations read by the backward, weights read again; training rule
   12) is not in cache whatever the op's size: such a read takes the share of its reuse distance
   (the bytes the rank touched in between) instead of the op's bytes (:func:`co_run_bytes`).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from collections.abc import Sequence

import onnx_ir as ir

if TYPE_CHECKING:  # annotations only: cluster.py builds on cost/, not the reverse
    from partitioner.cluster import Device
from partitioner.cost.ops import OpCost, op_class
from partitioner.cost.workdepth import constant_values, node_costs

FUSING_PRODUCERS = frozenset({"gemm", "conv", "depthwise_conv", "elementwise", "norm", "pool"})
#: rule 5's probes (M, K, N) and their operand bytes (float32 A, B and C, as ``OpCost.bytes``)
GEMM_PROBE = (128, 256, 256)
GEMM_LARGE_PROBE = (256, 1024, 1024)
#: rule 5 on (off: every gemm op at its class value, as before the working-set probes)
GEMM_WORKING_SET = True
#: rule 6: the columns of the small-map conv probes (4x4 and 2x2 maps) by class suffix, and of
#: the smallest map among the classes' own probes (7x7)
CONV_SMALL_PROBES = {"px16": 16, "px4": 4}
CONV_REF_COLUMNS = 49
#: rule 6 on (off: every conv at its class value)
CONV_COLUMNS = True
#: rule 7: the large probes' map (16 MiB of float32) and, per class, the operand bytes at which
#: the class value was measured (elementwise: an Add of two 1x64x56x56 maps, 3 maps of bytes;
#: data movement: a Transpose (2 maps) and a Concat (4 maps) of 1x64x28x28, 3 maps on average)
LARGE_MAP = (16, 64, 64, 64)
MEMORY_PROBE_BYTES = {"elementwise": 3 * 4.0 * 64 * 56 * 56, "data_movement": 3 * 4.0 * 64 * 28 * 28}
#: rule 7's large probes' operand bytes: the Add reads two maps and writes one, the Transpose one each
MEMORY_LARGE_BYTES = {"elementwise": 3 * 4.0 * math.prod(LARGE_MAP), "data_movement": 2 * 4.0 * math.prod(LARGE_MAP)}
#: rule 7 on (off: training's elementwise and data-movement ops at their class value)
MEMORY_WORKING_SET = True
#: rule 8: the bytes one copy of calibration probe 7 moves (read + write): the in-cache copy's
#: (1 MiB arrays; ``partitioner.calibrate`` takes it from here) and the quick out-of-cache one's
CO_RUN_CACHED_BYTES = 2 * 2 ** 20
CO_RUN_DRAM_BYTES = 64 * 2 ** 20
#: rule 8 on (off: every memory-bound op of a co-running rank at the out-of-cache share)
CO_RUN_BY_WORKING_SET = True


def co_run_gain(device: Device, nbytes: float) -> float:
    """Rule 8: the factor on a co-running rank's ``memory_bandwidth`` for an op moving ``nbytes``."""
    cached, dram = getattr(device, "co_run_cached_bandwidth", 0.0), getattr(device, "co_run_bandwidth", 1.0)
    if not CO_RUN_BY_WORKING_SET or not getattr(device, "co_running", False) or cached <= 0 or dram <= 0:
        return 1.0
    where = (math.log(max(nbytes, 1.0)) - math.log(CO_RUN_CACHED_BYTES)) / \
        (math.log(CO_RUN_DRAM_BYTES) - math.log(CO_RUN_CACHED_BYTES))
    share = cached + min(1.0, max(0.0, where)) * (dram - cached)
    return max(1.0, share / dram)


def co_run_bytes(device: Device, cost: OpCost) -> float:
    """Rule 8: ``cost.bytes`` over the co-run gain of their working sets, i.e. the bytes the op
    moves at ``memory_bandwidth``: the op's own bytes at the gain of ``cost.bytes``, each read in
    ``cost.reuse`` at the gain of its reuse distance (those reads scaled down to ``cost.bytes``
    when they add up to more)."""
    gain = co_run_gain(device, cost.bytes)
    far = sum(b for b, _ in cost.reuse)
    if gain <= 1.0 or far <= 0:
        return cost.bytes / gain
    scale = min(1.0, cost.bytes / far)
    return (cost.bytes - far * scale) / gain + scale * sum(b / co_run_gain(device, max(d, cost.bytes))
                                                          for b, d in cost.reuse)


def gemm_probe_bytes(mkn: tuple[int, int, int]) -> float:
    """Operand bytes (A, B and C in float32) of an ``M x K x N`` product: rule 5's working set."""
    m, k, n = mkn
    return 4.0 * (m * k + k * n + m * n)


_GROUP_KEY = "partitioner.fusion_group"  # passes/fusion_groups.FUSION_GROUP_KEY (no import: layering)


def op_time(cost: OpCost, device: Device, dtype: str = "float32", op_class: str | None = None,
            fused: bool = False, working_set: bool = False) -> float:
    """Seconds for one execution of an op of ``cost`` on ``device`` (rules 1–3 above;
    ``working_set``: rule 7 too)."""
    if cost.flops <= 0 and cost.bytes <= 0:
        return 0.0
    eff = op_efficiency(cost, device, dtype, op_class)
    if working_set and not fused:
        eff = memory_efficiency(cost, device, dtype, op_class, eff)
    compute = cost.flops / (device.peak(dtype) * eff)
    if fused and op_class == "elementwise":
        return compute
    memory = co_run_bytes(device, cost) / (device.memory_bandwidth * eff)
    return max(compute, memory) + (0.0 if fused else device.launch_overhead_s)


def op_efficiency(cost: OpCost, device: Device, dtype: str = "float32", op_class: str | None = None) -> float:
    """The efficiency an op of ``cost`` and ``op_class`` runs at on ``device`` (rules 1 and 5)."""
    eff = device.class_efficiency(op_class)
    table = device.efficiency_by_class
    if op_class in ("conv_backward", "conv_train"):
        return _conv_efficiency(cost, table, op_class, eff)
    if not GEMM_WORKING_SET or op_class not in ("gemm", "gemm_backward") or "gemm_large" not in table \
            or not is_compute_bound(cost, device, dtype):
        return eff
    lo, hi = math.log(gemm_probe_bytes(GEMM_PROBE)), math.log(gemm_probe_bytes(GEMM_LARGE_PROBE))
    t = min(max((math.log(max(cost.bytes, 1.0)) - lo) / (hi - lo), 0.0), 1.0)
    return math.exp((1 - t) * math.log(eff) + t * math.log(table["gemm_large"]))


def memory_efficiency(cost: OpCost, device: Device, dtype: str, op_class: str | None, eff: float) -> float:
    """Rule 7: ``eff`` (the class value) for a memory-bound elementwise or data-movement op of
    ``cost.bytes`` operand bytes, interpolated toward the class's out-of-cache probe."""
    large = device.efficiency_by_class.get(f"{op_class}_large")
    if not MEMORY_WORKING_SET or op_class not in MEMORY_PROBE_BYTES or large is None \
            or is_compute_bound(cost, device, dtype) or cost.bytes <= MEMORY_PROBE_BYTES[op_class]:
        return eff
    lo, hi = math.log(MEMORY_PROBE_BYTES[op_class]), math.log(MEMORY_LARGE_BYTES[op_class])
    t = min((math.log(cost.bytes) - lo) / (hi - lo), 1.0)
    return math.exp((1 - t) * math.log(eff) + t * math.log(large))


def _conv_efficiency(cost: OpCost, table: dict[str, float], op_class: str, eff: float) -> float:
    """Rule 6: ``eff`` (the class value) at ``cost.columns`` output pixels per image."""
    points = sorted((cols, table[f"{op_class}_{suffix}"]) for suffix, cols in CONV_SMALL_PROBES.items()
                    if f"{op_class}_{suffix}" in table)
    if not CONV_COLUMNS or not points or cost.columns <= 0 or cost.columns >= CONV_REF_COLUMNS:
        return eff
    points.append((CONV_REF_COLUMNS, eff))
    if cost.columns <= points[0][0]:
        return points[0][1]
    for (c0, e0), (c1, e1) in zip(points, points[1:]):
        if cost.columns <= c1:
            t = math.log(cost.columns / c0) / math.log(c1 / c0)
            return math.exp((1 - t) * math.log(e0) + t * math.log(e1))
    return eff


def is_compute_bound(cost: OpCost, device: Device, dtype: str = "float32") -> bool:
    """True when the op's arithmetic intensity is above the device's ridge point."""
    return cost.flops / device.peak(dtype) >= cost.bytes / device.memory_bandwidth


def fused_nodes(graph: ir.Graph) -> set[ir.Node]:
    """The nodes of ``graph`` that start no kernel of their own (rule 4 above)."""
    nodes = list(graph)
    if any(n.metadata_props.get(_GROUP_KEY) for n in nodes):
        seen: set[str] = set()
        fused = set()
        for n in nodes:
            gid = n.metadata_props.get(_GROUP_KEY)
            if gid:
                if gid in seen:
                    fused.add(n)
                seen.add(gid)
        return fused
    const = constant_values(graph)
    graph_outputs = set(graph.outputs)
    fused = set()
    for n in nodes:
        if op_class(n) != "elementwise":
            continue
        data = [v for v in n.inputs if v is not None and v not in const]
        if len(data) != 1:
            continue
        x = data[0]
        producer = x.producer()
        if producer is None or x in graph_outputs or op_class(producer) not in FUSING_PRODUCERS:
            continue
        if len({id(u) for u, _ in x.uses()}) == 1:
            fused.add(n)
    return fused


def graph_op_times(graph: ir.Graph, device: Device, costs: Sequence[OpCost] | None = None,
                   dtypes: Sequence[str] | None = None) -> list[float]:
    """Seconds of each node of ``graph`` (graph order) on ``device``, with op classes and fusion.

    ``costs`` defaults to :func:`partitioner.cost.workdepth.node_costs`; ``dtypes`` to float32."""
    if costs is None:
        costs = node_costs(graph, constant_values(graph))
    fused = fused_nodes(graph)
    out = []
    for i, (node, cost) in enumerate(zip(graph, costs)):
        dtype = dtypes[i] if dtypes is not None else "float32"
        out.append(op_time(cost, device, dtype, op_class(node), node in fused))
    return out
