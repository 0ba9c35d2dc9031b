"""Per-device memory estimate (COST_MODEL.md, "Strategies": memory per device).

    total = weight shard bytes + activation bytes × micro-batches in flight + comm buffer bytes

- Weights: the parameter bytes a device holds (all of them for data/spatial parallelism, 1/t for
  tensor parallelism, its stage's for a pipeline).
- Activations: the peak live activation bytes of the device's program for one micro-batch
  (:func:`partitioner.cost.workdepth.peak_activation_bytes`), times the micro-batches in flight
  (:func:`activation_copies`: min(m, stages) for a pipeline, the one rule of the cost model).
- Comm buffers: receive/staging buffers of the communication ops.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # annotations only: cluster.py builds on cost/, not the reverse
    from partitioner.cluster import Device


@dataclass(frozen=True)
class MemoryEstimate:
    weights: float
    activations: float
    comm_buffers: float

    @property
    def total(self) -> float:
        return self.weights + self.activations + self.comm_buffers

    def fits(self, device: Device) -> bool:
        return self.total <= device.memory_bytes

    def to_json(self) -> dict[str, Any]:
        return {"weights": self.weights, "activations": self.activations,
                "comm_buffers": self.comm_buffers, "total": self.total}


def activation_copies(microbatches: int, num_stages: int, training: bool = False) -> int:
    """Micro-batches whose activations a pipeline stage holds at once: with fill-drain
    scheduling a stage has received at most ``num_stages`` micro-batches before the first leaves
    the last stage, and never more than the ``microbatches`` that exist; a training (GPipe) stage
    keeps all of them for the backward pass; 1 without a pipeline. The rule
    :func:`partitioner.strategies.costing.estimate` charges."""
    if num_stages <= 1 or microbatches <= 1:
        return 1
    return microbatches if training else min(microbatches, num_stages)


def device_memory(weight_bytes: float, activation_bytes: float, microbatches: int = 1,
                  comm_buffer_bytes: float = 0.0) -> MemoryEstimate:
    """Memory of one device: weights + activations × micro-batches in flight + comm buffers."""
    return MemoryEstimate(float(weight_bytes), float(activation_bytes) * max(1, microbatches),
                          float(comm_buffer_bytes))


def training_memory_bytes(params: float, shards: int = 1, k: float = 12.0, zero_stage: int = 0) -> float:
    """ZeRO accounting, Ψ parameters, mixed precision Adam (K = 12): (2 + 2 + K)Ψ per device.

    zero_stage 1 shards the optimiser state, 2 also the gradients, 3 also the parameters."""
    n = max(1, shards)
    p_bytes, g_bytes, o_bytes = 2 * params, 2 * params, k * params
    if zero_stage >= 1:
        o_bytes /= n
    if zero_stage >= 2:
        g_bytes /= n
    if zero_stage >= 3:
        p_bytes /= n
    return p_bytes + g_bytes + o_bytes
