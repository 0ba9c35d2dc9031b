"""Roofline time of one operator on one device (COST_MODEL.md).

    t = max(FLOPs / (F_peak(dtype) · eff), bytes / (B_mem · eff)) + launch overhead

Ops that do nothing (zero FLOPs and zero bytes: views, shape ops, comm placeholders) cost no
launch overhead either, since runtimes do not launch a kernel for them.
"""

from __future__ import annotations

from partitioner.cluster import Device
from partitioner.cost.ops import OpCost


def op_time(cost: OpCost, device: Device, dtype: str = "float32") -> float:
    """Seconds for one execution of an op of ``cost`` on ``device`` (rule in the module docstring)."""
    if cost.flops <= 0 and cost.bytes <= 0:
        return 0.0
    eff = device.efficiency
    compute = cost.flops / (device.peak(dtype) * eff)
    memory = cost.bytes / (device.memory_bandwidth * eff)
    return max(compute, memory) + device.launch_overhead_s


def is_compute_bound(cost: OpCost, device: Device, dtype: str = "float32") -> bool:
    """True when the op's arithmetic intensity is above the device's ridge point."""
    return cost.flops / device.peak(dtype) >= cost.bytes / device.memory_bandwidth
