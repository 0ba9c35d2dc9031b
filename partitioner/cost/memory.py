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


# ---- the measured peak of one rank (what ``bench`` reports), per runtime -------------------------

MiB = float(2**20)


@dataclass(frozen=True)
class RuntimeMemory:
    """How a backend's runtime holds one rank's memory; the figures of :func:`rank_peak`.

    - ``runtime_bytes``: what the worker adds after its baseline whatever the program: the rank
      library's code pages, the VM or session objects, the runtime modules imported after the
      baseline (input scattering, the step loop). Measured: a 2-layer MLP of 16 features, 2.9 to
      4.0 MiB per rank from run to run (TVM, ``runtime_overhead.json`` and four reruns): the
      rule takes the middle, 3.5 MiB (within 20% of either end).
    - ``load_weight_copies``: the weights embedded in the library (constants) are held this many
      times at the load's high-water mark. TVM: the library's mapped blob, the bytes read out of
      it, the deserialised executable's constants and the VM's device copy of them: 4
      (ResNet-18: 179.2 MiB above the baseline for 44.5 MiB of constants, 171.6 for 42.5).
    - ``run_weight_copies``: the copies that stay while the steps run. TVM: 2 (the library's
      mapped pages and the VM's constants; 90.4 MiB after loading 44.5 MiB).
    - ``activation_factor``: the runtime's activation storage over the peak live activation
      bytes of the program (:func:`~partitioner.cost.workdepth.peak_activation_bytes`). TVM's
      static memory plan reuses a storage block only for tensors of similar size and keeps the
      conv layout transforms' buffers: 1.28 (ResNet-18, batch 8 and batch 4: 62.7 and 31.3 MiB
      against 49.0 and 24.5 MiB live).
    - ``worker_buffers``: the MPI worker's own buffers count (``runtime/worker.py``,
      ``runtime/schedule.py``): every rank reads the whole input file before keeping its slices,
      the step loop keeps the outputs of every micro-batch, and a Send's copy lives until the
      step's flush (:func:`rank_peak`).

    Weights built as parameters mapped from ``rank<i>.data`` (``backends/tvm/weight_params.py``,
    a model with external data) are held once, as the mapped pages the kernels touch, and are not
    part of the load's high-water mark.
    """

    runtime_bytes: float = 0.0
    load_weight_copies: float = 1.0
    run_weight_copies: float = 1.0
    activation_factor: float = 1.0
    worker_buffers: bool = False


#: ``Device.runtime`` -> its rule. "" (a nominal or hand-written device) is the plain sum:
#: weights once + live activations, nothing of a particular runtime.
RUNTIME_MEMORY: dict[str, RuntimeMemory] = {
    "": RuntimeMemory(),
    "tvm": RuntimeMemory(runtime_bytes=3.5 * MiB, load_weight_copies=4.0, run_weight_copies=2.0,
                         activation_factor=1.28, worker_buffers=True),
    # ONNX Runtime holds the model bytes, the session's initializers and its prepacked GEMM/conv
    # weights; how many stay depends on the ops: measured (MiB above the baseline, less 3 for
    # the runtime, over the weights) 3.6 copies at load and 3.3 after it for ResNet-18 (convs,
    # 44.5 MiB), 1.9 for an MLP data x2 rank (MatMuls, 12.6 MiB), 2.3 and 3.3 for its pipeline
    # stages. The rule takes 2 (within about 35% of those); its arena holds about 1.3x the live
    # activations (ResNet-18, batch 8). The runtime table is TVM's; this rule is approximate.
    "onnxruntime": RuntimeMemory(runtime_bytes=3.5 * MiB, load_weight_copies=2.0, run_weight_copies=2.0,
                                 activation_factor=1.3, worker_buffers=True),
}


def runtime_memory(runtime: str | None) -> RuntimeMemory:
    """The rule of ``runtime`` (a backend name); the plain sum for an unknown one."""
    return RUNTIME_MEMORY.get(runtime or "", RUNTIME_MEMORY[""])


@dataclass(frozen=True)
class RankMemory:
    """The terms of one rank's predicted peak (bytes), :func:`rank_peak`."""

    runtime: float
    weights: float
    activations: float
    inputs: float
    outputs: float
    sends: float
    receives: float
    load_peak: float

    @property
    def steady(self) -> float:
        """Resident while the steps run."""
        return (self.runtime + self.weights + self.activations + self.inputs + self.outputs + self.sends
                + self.receives)

    @property
    def total(self) -> float:
        """The high-water mark: the larger of loading and running."""
        return max(self.load_peak, self.steady)

    def to_json(self) -> dict[str, float]:
        return {"runtime_bytes": self.runtime, "weight_bytes": self.weights, "activation_bytes": self.activations,
                "input_bytes": self.inputs, "output_bytes": self.outputs, "send_bytes": self.sends,
                "receive_bytes": self.receives, "load_peak_bytes": self.load_peak, "peak_bytes": self.total}


def rank_peak(rule: RuntimeMemory, *, embedded_weight_bytes: float, mapped_weight_bytes: float = 0.0,
              activation_bytes: float, microbatches: int = 1, local_input_bytes: float = 0.0,
              global_input_bytes: float = 0.0, output_bytes: float = 0.0, send_bytes: float = 0.0,
              receive_bytes: float = 0.0) -> RankMemory:
    """One rank's peak resident bytes above the process baseline (the figure ``bench`` measures:
    VmHWM minus the RSS just before the program loads). The one memory rule the simulator and
    the search's estimate charge.

        load  = runtime + load_copies x embedded weights
        steady = runtime + run_copies x embedded weights + mapped weights
                 + activation_factor x peak live activations of one micro-batch
                 + inputs: the whole input file on every rank (the rank's own micro-batches
                   when the global figure is not given); one micro-batch's input buffer is
                   already inside the live activations
                 + outputs: every micro-batch's outputs of this step and of the previous one
                   (the step loop keeps them until the next step's list replaces them), less the
                   one micro-batch already inside the live activations
                 + sends: a Send copies its tensor and the copy lives until the step's flush, so
                   every micro-batch's sent bytes
                 + receives: messages received before the program consumes them
        peak  = max(load, steady)

    Inputs are per step (all micro-batches); ``activation_bytes``, ``output_bytes`` and
    ``send_bytes`` per micro-batch. Without ``worker_buffers`` (a nominal device) the inputs,
    outputs and sends terms are 0: the plain sum of weights, activations and receives."""
    m = max(1, microbatches)
    runtime = rule.runtime_bytes
    wb = rule.worker_buffers
    inputs = (global_input_bytes or m * local_input_bytes) if wb else 0.0
    return RankMemory(
        runtime=runtime,
        weights=rule.run_weight_copies * embedded_weight_bytes + mapped_weight_bytes,
        activations=rule.activation_factor * activation_bytes,
        inputs=inputs,
        outputs=(2 * m - 1) * output_bytes if wb else 0.0,
        sends=m * send_bytes if wb else 0.0,
        receives=receive_bytes,
        load_peak=runtime + rule.load_weight_copies * embedded_weight_bytes,
    )
