"""Fixed runtime costs of a step beside its kernels and its transfers: the one rule that the
simulator (:mod:`partitioner.cost.simulate`), the search estimate
(:func:`partitioner.strategies.costing.estimate`) and the training-step prediction read.

Rules (every figure comes from this machine's calibration, ``partitioner calibrate``; nominal
devices have 0 for the per-call terms):

1. Per kernel: ``Device.launch_overhead_s`` (probe 3: a chain of tiny kernels), inside the
   roofline time of each op that starts a kernel (:func:`partitioner.cost.roofline.op_time`).
2. Per run of a rank's program, i.e. once per micro-batch: ``Device.call_overhead_s`` (probe 3b:
   argument and result handling in the runtime's ``run``, the VM entry).
3. Per communication op a rank runs, once per micro-batch: ``Device.comm_op_overhead_s`` (probe
   3c: the compiled program's call out to the comm handler and back, the tensors' views, the
   next segment's entry), beside the op's own transfer time (:mod:`partitioner.cost.comm`).
   Measured on the quiet overhead row (``runtime_overhead.json``, a 64-micro-batch pipeline of
   a tiny MLP): the receiving rank spent 6.0 us per micro-batch inside the VM where its kernels
   take under 1 us, and 4.7 us outside it; rules 2 and 3 are that difference, from calibration.
4. Per step: the barrier that ends it (the worker times a step from one barrier to the next,
   :mod:`partitioner.runtime.schedule`): a 0-byte allreduce over the step's ranks on the
   calibrated link (α only); nothing on one rank.

Rules 2–4 are not sped up by threads (they run on the calling thread). Training steps are one
run of the training-step program per micro-batch, so the same :func:`rank_overhead` and
:func:`step_sync` apply to them (:class:`StepOverheads` gathers them for one device).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from partitioner.cost.comm import collective_time

if TYPE_CHECKING:  # annotations only: cluster.py builds on cost/, not the reverse
    from partitioner.cluster import Cluster, Device


@dataclass(frozen=True)
class StepOverheads:
    """The fixed costs of rules 1–4 on one device of a plan of ``world_size`` ranks (seconds)."""

    launch_s: float
    call_s: float
    comm_op_s: float
    step_sync_s: float

    def to_json(self) -> dict[str, float]:
        return {"launch_s": self.launch_s, "call_s": self.call_s, "comm_op_s": self.comm_op_s,
                "step_sync_s": self.step_sync_s}


def call_seconds(device: Device) -> float:
    """Rule 2: seconds per run of a program on ``device``."""
    return float(getattr(device, "call_overhead_s", 0.0) or 0.0)


def comm_op_seconds(device: Device) -> float:
    """Rule 3: seconds per communication op on ``device``, beside the transfer."""
    return float(getattr(device, "comm_op_overhead_s", 0.0) or 0.0)


def rank_overhead(device: Device, microbatches: int, comm_ops_per_run: float) -> float:
    """Rules 2–3: one rank's fixed seconds per step, ``comm_ops_per_run`` comm ops per run."""
    return microbatches * (call_seconds(device) + comm_ops_per_run * comm_op_seconds(device))


def step_sync(cluster: Cluster, world_size: int) -> float:
    """Rule 4: seconds of the barrier that ends a step of ``world_size`` ranks (0 for one)."""
    if world_size <= 1:
        return 0.0
    return collective_time("allreduce", 0.0, tuple(range(world_size)), cluster).seconds


def step_overheads(cluster: Cluster, world_size: int, rank: int = 0) -> StepOverheads:
    """Rules 1–4 for ``rank`` of a ``world_size``-rank plan on ``cluster`` (what a training-step
    or inference prediction adds beside kernels and transfers)."""
    dev: Any = cluster.devices[rank]
    return StepOverheads(float(getattr(dev, "launch_overhead_s", 0.0)), call_seconds(dev), comm_op_seconds(dev),
                         step_sync(cluster, world_size))
