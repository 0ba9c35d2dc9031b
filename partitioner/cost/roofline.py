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
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from collections.abc import Sequence

import onnx_ir as ir

if TYPE_CHECKING:  # annotations only: cluster.py builds on cost/, not the reverse
    from partitioner.cluster import Device
from partitioner.cost.ops import OpCost, op_class
from partitioner.cost.workdepth import constant_values, node_costs

FUSING_PRODUCERS = frozenset({"gemm", "conv", "depthwise_conv", "elementwise", "norm", "pool"})
_GROUP_KEY = "partitioner.fusion_group"  # passes/fusion_groups.FUSION_GROUP_KEY (no import: layering)


def op_time(cost: OpCost, device: Device, dtype: str = "float32", op_class: str | None = None,
            fused: bool = False) -> float:
    """Seconds for one execution of an op of ``cost`` on ``device`` (rules 1–3 above)."""
    if cost.flops <= 0 and cost.bytes <= 0:
        return 0.0
    eff = device.class_efficiency(op_class)
    compute = cost.flops / (device.peak(dtype) * eff)
    if fused and op_class == "elementwise":
        return compute
    memory = cost.bytes / (device.memory_bandwidth * eff)
    return max(compute, memory) + (0.0 if fused else device.launch_overhead_s)


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
