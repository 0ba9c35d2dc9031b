"""Per-device memory estimate (COST_MODEL.md, "Strategies": memory per device).

    total = weight shard bytes + activation bytes × micro-batches in flight + comm buffer bytes

- Weights: the parameter bytes a device holds (all of them for data/spatial parallelism, 1/t for
  tensor parallelism, its stage's for a pipeline).
- Activations: the peak live activation bytes of the device's program for one micro-batch
  (:func:`partitioner.cost.workdepth.peak_activation_bytes`), times the micro-batches in flight
  (:func:`activation_copies`: min(m, stages) for a pipeline, the one rule of the cost model).
- Comm buffers: receive/staging buffers of the communication ops.

:func:`rank_peak` is one rank's measured peak per runtime (inference ranks); :func:`tvm_stage_memory`
a TVM training pipeline stage's, from the stage's own programs (training rule 3 for TVM stages).
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
      times at the load's high-water mark. TVM: 4, all inside ``tvm.runtime.load_module`` (the
      library's mapped blob, two transient copies while it is read and deserialised, and the
      executable's constants; creating the VM adds nothing: session 15, ResNet-18 with 150.9 MiB
      of constants, 603.3 MiB high-water mark after ``load_module``, the same after the VM)
      (ResNet-18: 179.2 MiB above the baseline for 44.5 MiB of constants, 171.6 for 42.5).
      "Embedded" means the library's constants as built (:func:`with_library_constants`): a
      Winograd conv's are 4x its weights.
    - ``run_weight_copies``: the copies that stay while the steps run. TVM: 2 (the library's
      mapped file pages and the executable's constants: 151.3 MiB file-backed and 150.5 MiB
      anonymous for 150.9 MiB of constants; 90.4 MiB after loading 44.5 MiB).
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
    embedded: float = 0.0  # the weight bytes priced as the library's constants (before the copies)
    mapped: float = 0.0  # the weight bytes priced as mapped pages (held once)

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
                "receive_bytes": self.receives, "load_peak_bytes": self.load_peak, "peak_bytes": self.total,
                "embedded_weight_bytes": self.embedded, "mapped_weight_bytes": self.mapped}


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
        embedded=float(embedded_weight_bytes),
        mapped=float(mapped_weight_bytes),
    )


#: price a built rank with its library's constants (:func:`with_library_constants`); off: the
#: plan's figure, the program's initializers as the embedded weights, whatever the build made of them
PRICE_LIBRARY_CONSTANTS = True


def with_library_constants(terms: dict[str, float], rule: RuntimeMemory, constant_bytes: float) -> RankMemory | None:
    """A built rank's peak (:func:`rank_peak`) with the library's constants as its embedded weights.

    For: a rank whose build turned its weights into constants of another size than the program's
    initializers. The plan prices the initializers (``embedded_weight_bytes``), but the plan is made
    before the build chooses. Cases: Winograd F(4x4, 3x3) (``backends/tvm/conv_algorithms.py``,
    chosen by the default ``--conv-algorithm auto``) holds each 3x3 conv's weights transformed,
    ``(4+2)^2 / 3^2`` = 4x their bytes, and the original is not kept beside them; packing pads a
    GEMM's or conv's weight panels; batch-norm folding and constant folding add or remove a few
    constants. Measured (zoo ResNet-18 batch 8, data x2, one TVM rank loaded alone, session 15):
    the library held 44.6 MiB of constants with ``direct`` convs and 150.9 with ``auto`` (9 of 20
    convs Winograd), 152.6 with ``winograd``; the rank's high-water mark was 177.2, 602.6 and
    609.1 MiB above its baseline, the load's 4 copies of exactly those constants (plan: 182.0 for
    all three). Every other term (runtime, mapped weights, activations, worker buffers) is the
    plan's: ``terms`` is a rank's ``to_json()``, and one without ``embedded_weight_bytes`` (written
    before that term existed) gives None, as does :data:`PRICE_LIBRARY_CONSTANTS` off."""
    if not PRICE_LIBRARY_CONSTANTS or "embedded_weight_bytes" not in terms:
        return None
    c = float(constant_bytes)
    mapped = float(terms.get("mapped_weight_bytes", 0.0))
    return RankMemory(
        runtime=float(terms["runtime_bytes"]), weights=rule.run_weight_copies * c + mapped,
        activations=float(terms["activation_bytes"]), inputs=float(terms["input_bytes"]),
        outputs=float(terms["output_bytes"]), sends=float(terms["send_bytes"]),
        receives=float(terms["receive_bytes"]),
        load_peak=float(terms["runtime_bytes"]) + rule.load_weight_copies * c, embedded=c, mapped=mapped)


# ---- a TVM pipeline stage's peak, from its programs (issue 16) -----------------------------------

#: price a TVM pipeline stage's peak from the stage's own programs (:func:`tvm_stage_memory`);
#: off: training rule 3's ``3 S + 4 G`` + stash + rule 10's filters, as for ONNX Runtime stages.
#: Measured (session 14, 2 MPI ranks, 1F1B x8, ``benchmarks/train_step.py`` sizes, load 1.3-5.8): the
#: zoo mlp 4x1024's stages 99.6 / 149.0 MiB, predicted 61.1 / 58.8 off and 84.0 / 130.1 on; bert's
#: 63.6 / 87.0, predicted 56.4 / 34.9 off and 58.5 / 84.3 on (docs/training.md, "TVM pipeline stages")
TVM_STAGE_MEMORY = True

#: a TVM stage's pool term from each program's Relax memory plan (:func:`pool_bytes`, ``planned``:
#: ``backends.tvm.planned_memory.planned_bytes``, storage and outputs) where the program lowers on TVM
#: alone; off: the program graph's peak live bytes, as before session 24. Why: the lowered program
#: holds more than its graph's values (each GEMM of a weight input packs the weight per call; the
#: planner shares a block only at a fitting size), the cause session 23 found for 1-rank and data
#: ranks (:data:`TVM_PLANNED_MEMORY`). Measured (session 24, the zoo resnet at batch 64, 1F1B x8,
#: micro-batches of 8 images): stage 0's programs F / B / U / P peak 11.1 / 12.9 / 3.2 / 5.6 MiB in
#: their graphs and plan 22.2 / 16.9 / 2.6 / 6.3 MiB; the stage's predicted peak 75 -> 90 MiB
#: against 108 measured (stage 1: 340 -> 360 against 335).
TVM_STAGE_PLANNED_POOL = True

#: a stage's programs as the pipeline runner names them (``pipeline_runner.PipelineRunner._exe``)
PROGRAM_KINDS = (("F", "forward"), ("B", "backward"), ("FB", "fused"), ("U", "update"), ("P", "prepare"),
                 ("W", "weight_grad"), ("FBt", "fused_tail"))


@dataclass(frozen=True)
class TvmStageMemory:
    """The terms of a TVM pipeline stage's predicted peak (bytes), :func:`tvm_stage_memory`."""

    state: float
    input_buffers: float
    step_constants: float
    pool: float
    stash: float
    gradients: float
    weight_grad_stash: float
    sends: float

    @property
    def total(self) -> float:
        return (self.state + self.input_buffers + self.step_constants + self.pool + self.stash + self.gradients
                + self.weight_grad_stash + self.sends)

    def to_json(self) -> dict[str, float]:
        return {**{k: float(v) for k, v in self.__dict__.items()}, "total": self.total}


# ---- a TVM 1-rank or data-parallel training rank's peak, from its libraries' plans (issue 16) ----

#: price a TVM ``single`` / ``data`` / ``tensor`` training rank from the memory its libraries' Relax modules
#: plan (:func:`tvm_rank_memory`); off: training rule 3's ``3 S + G`` + stash (+ 3 G for data),
#: made for ONNX Runtime's arena. Measured (session 22, ``benchmarks/train_step.py`` sizes, 2 MPI
#: ranks): rule 3 priced bert's TVM 1-rank step at 250 MiB against 167 measured (+50%), its data
#: ranks at 160 against 115 (+39%); this rule at 146 (-13%) and 101 (-12%) (docs/training.md)
TVM_PLANNED_MEMORY = True


@dataclass(frozen=True)
class TvmRankMemory:
    """The terms of a TVM ``single`` / ``data`` / ``tensor`` training rank's predicted peak (bytes)."""

    state: float
    libraries: float
    input_buffers: float
    window: float

    @property
    def total(self) -> float:
        return self.state + self.libraries + self.input_buffers + self.window

    def to_json(self) -> dict[str, float]:
        return {**{k: float(v) for k, v in self.__dict__.items()}, "total": self.total}


def tvm_rank_memory(*, state_bytes: float, planned: list[Any], input_bytes: float,
                    window_bytes: float) -> TvmRankMemory:
    """A TVM ``single`` / ``data`` / ``tensor`` training rank's peak above its baseline (what
    ``train --bench`` measures, :mod:`partitioner.training.memory_window`), the runner's
    libraries (``runner.tvm_rank_programs``) priced by their own plans:

    - ``state``: 2 x the state ``S`` (weights, optimizer slots, BN statistics). The runner holds
      the state and each step returns the next one as new tensors (the update library's outputs,
      counted in ``libraries``); the state the step replaced is freed after the swap, but the
      first step's is the runner's numpy state, which the allocator keeps (the heap does not
      shrink under it): three copies at the peak, as rule 3 has for ONNX Runtime;
    - ``libraries``: each library's planned storage and output tensors
      (:func:`backends.tvm.planned_memory.planned_bytes`, ``planned``), summed over the
      libraries: TVM's pooled allocator keeps every block it gave out and shares a block between
      libraries only at equal sizes (the same reason as :func:`pool_bytes`);
    - ``input_buffers``: the batch's data and labels, which every library that reads them copies
      into a buffer it keeps (``overlap`` rule 8: the other inputs are taken as they lie);
    - ``window``: a data rank's shared-memory AllReduce window (``comm_mpi`` rule 7), one slot
      per rank of the largest bucket reduced through it; every rank touches every slot, so each
      rank's resident memory counts them all (0 without a data-parallel AllReduce).

    Measured (session 22 runs re-predicted, the zoo's ``train_step.py`` sizes, SGD): mlp 1 rank
    108 MiB priced against 110 measured, data 128 / 127; bert 146 / 167, 101 / 115; resnet
    228 / 232, 293 / 297."""
    return TvmRankMemory(state=2.0 * float(state_bytes), libraries=float(sum(p.total for p in planned)),
                         input_buffers=float(input_bytes), window=float(window_bytes))


def value_bytes(info: Any) -> float:
    """Bytes of an ONNX ``ValueInfoProto`` with static dims (0 for a dim without a value)."""
    import onnx

    t = info.type.tensor_type
    n = 1
    for d in t.shape.dim:
        n *= d.dim_value
    return float(n * onnx.helper.tensor_dtype_to_np_dtype(t.elem_type).itemsize)


def stage_programs(stage: Any) -> dict[str, Any]:
    """The stage's programs that exist, by the runner's kind names (:data:`PROGRAM_KINDS`)."""
    return {kind: getattr(stage, attr) for kind, attr in PROGRAM_KINDS if getattr(stage, attr, None) is not None}


def tensor_fed(stage: Any) -> set[str]:
    """Inputs a TVM stage program reads as the TVM tensors that made them, from step 2 on: the
    weights and the rest of the state (the update program's outputs, ``pipeline_runner.WEIGHT_TENSORS``)
    and the prepared values (the prepare program's outputs). With
    ``executable.RELEASE_PASSED_BUFFERS`` their persistent input buffers are freed after step 1."""
    prepared = {o.name for o in stage.prepare.graph.output} if getattr(stage, "prepare", None) is not None else set()
    return set(stage.weights) | {a for a, _ in stage.update_pairs} | prepared


def array_input_bytes(stage: Any, programs: dict[str, Any]) -> float:
    """Persistent input buffers that stay (``executable`` rule 5: one TVM tensor per input, filled
    from the array each call): every program input not read as a tensor (:func:`tensor_fed`; ``B``'s
    stash is ``F``'s tensors, ``pipeline_runner.STASH_TENSORS``): the micro-batch's data and labels,
    the received activations and output gradients, the BN statistics, ``U``'s gradient inputs (the
    accumulated numpy arrays: a stage's weights' bytes again) and ``W``'s concatenated stash."""
    tensors = tensor_fed(stage)
    stash = set(stage.stash)
    return sum(value_bytes(v) for kind, p in programs.items() for v in p.graph.input
               if v.name not in tensors and not (kind == "B" and v.name in stash))


def step_constant_bytes(programs: dict[str, Any], constant_inputs: Any) -> float:
    """What the prepared values and the lifted step constants hold: the prepare program's outputs
    (the weights' transposes, alive through the micro-batches) plus every program's lifted
    transforms (``executable`` rule 8: one transformed copy per step-constant input, named by
    ``constant_inputs(program)``). Summed over the programs, not the largest one's though
    ``pipeline_runner.RELEASE_STEP_CONSTANTS`` drops a program's after its last call of the step:
    the released blocks are not what the next program's transform gets (the zoo mlp 4x1024's last
    stage, ``benchmarks/pipeline_stage_memory.py``: the RSS grows by ``FBt``'s 16 MiB at its first
    call of step 2, after ``FB``'s 16 MiB were released)."""
    prepared = sum(value_bytes(o) for o in programs["P"].graph.output) if "P" in programs else 0.0
    lifted = 0.0
    for p in programs.values():
        names = set(constant_inputs(p))
        lifted += sum(value_bytes(v) for v in p.graph.input if v.name in names)
    return prepared + lifted


def pool_bytes(stage: Any, programs: dict[str, Any], planned: Any = None) -> float:
    """TVM's storage across the stage's programs: the sum over programs of each one's peak live
    bytes over its graph (:func:`~partitioner.cost.workdepth.peak_activation_bytes`: its
    intermediates and outputs, and the inputs it takes as arrays while it reads them). The VM
    allocates storage from TVM's pooled allocator, which keeps every freed block, by exact size,
    for a later allocation of that size and gives none back; one program's blocks serve another
    only at equal sizes, so the rule shares none between programs. An input read as a tensor
    (:func:`tensor_fed`, and ``B``'s stash) is another program's output, counted where it is held
    (the state, :func:`step_constant_bytes`, :func:`stash_bytes`); an input given as an array is
    the runner's array (a received message, the accumulated gradients, the concatenated stash),
    alive while the call copies it into its buffer (:func:`array_input_bytes`: the copy).

    With ``planned`` (a program -> its memory plan, an object with ``total`` bytes, or None) and
    :data:`TVM_STAGE_PLANNED_POOL` on, a program that has a plan counts its plan (the storage
    blocks and output tensors its VM allocates per call) in place of its graph's peak."""
    import onnx_ir as ir

    from partitioner.cost.workdepth import constant_values, peak_activation_bytes

    tensors, stash = tensor_fed(stage), set(stage.stash)
    total = 0.0
    for kind, p in programs.items():
        plan = planned(p) if planned is not None and TVM_STAGE_PLANNED_POOL else None
        if plan is not None:
            total += float(plan.total)
            continue
        g = ir.serde.deserialize_model(p).graph
        held = {v for v in g.inputs if v.name in tensors or (kind == "B" and v.name in stash)}
        total += peak_activation_bytes(g, constant_values(g) | held)
    return total


def stash_bytes(stage: Any, programs: dict[str, Any], in_flight: int) -> float:
    """The forward's stashed values of the micro-batches in flight (training rule 3's counts), held
    by the runner from ``F`` to ``B`` (``F``'s output tensors, or its inputs for a recomputing stage)."""
    if "F" not in programs:
        return 0.0
    specs = {v.name: value_bytes(v) for v in list(programs["F"].graph.input) + list(programs["F"].graph.output)}
    return in_flight * sum(specs.get(v, 0.0) for v in stage.stash)


def held_gradient_bytes(stage: Any, programs: dict[str, Any]) -> float:
    """The weight gradients the runner holds beside a backward call: the accumulator (the first
    micro-batch's gradient arrays, a stage's weights' bytes) and the previous backward call's
    outputs (alive until the next call returns: ``out`` in the runner's loop)."""
    grad = programs.get("B") or programs.get("FB")
    weights = {w: 0.0 for w in stage.weights}
    for p in programs.values():
        for v in p.graph.input:
            if v.name in weights:
                weights[v.name] = value_bytes(v)
    outputs = sum(value_bytes(o) for o in grad.graph.output) if grad is not None else 0.0
    return sum(weights.values()) + outputs


def weight_grad_stash_bytes(stage: Any, programs: dict[str, Any]) -> float:
    """Training pipeline rule 10: the arrays the runner keeps from each covered micro-batch for the
    deferred weight-gradient program (``W``'s non-tensor inputs, before they are concatenated)."""
    if "W" not in programs:
        return 0.0
    tensors = tensor_fed(stage)
    return sum(value_bytes(v) for v in programs["W"].graph.input if v.name not in tensors)


def send_bytes(stage: Any, programs: dict[str, Any], micro_batches: int) -> float:
    """:func:`rank_peak`'s sends: a Send copies its tensor and the copy lives until the step's
    flush, so every micro-batch's sent activations and input gradients."""
    specs = {v.name: value_bytes(v) for p in programs.values() for v in list(p.graph.input) + list(p.graph.output)}
    per = sum(specs.get(v, 0.0) for _, v in stage.send)
    per += sum(specs.get(f"{v}.grad_in", 0.0) for _, v in stage.recv if v in stage.grad_in)
    return micro_batches * per


#: ONNX Runtime plans: training cost rule 3's activations on the last pipeline stage from its own
#: programs (:func:`ort_last_stage_activations`) instead of its forward's stash; off: the stash
ORT_LAST_STAGE_LIVE = True


def _viewed(values: set[Any]) -> set[Any]:
    """``values`` and what each one views, back through the view nodes that made it (a weight
    gradient output is often an ``Identity`` of the product that computed it)."""
    from partitioner.cost.workdepth import _VIEW_OPS

    out, todo = set(), list(values)
    while todo:
        v = todo.pop()
        if v is None or v in out:
            continue
        out.add(v)
        node = v.producer()
        if node is not None and node.op_type in _VIEW_OPS and node.domain == "" and node.inputs:
            todo.append(node.inputs[0])
    return out


def ort_last_stage_activations(stage: Any) -> float:
    """Training cost rule 3's activations on an ONNX Runtime plan's last pipeline stage. That stage
    runs each micro-batch's forward, loss and backward in one call (``FB``, ``FBt``), so at its
    peak it holds the backward's temporaries beside the forward's values, and pipeline rule 10
    keeps the arrays its deferred ``W`` reads across the micro-batches; the forward's stash (the
    rule for the other stages, one micro-batch in flight here) counts neither. Priced as the
    largest peak live bytes of ``FB``, ``FBt`` and ``W`` (:func:`~partitioner.cost.workdepth.
    peak_activation_bytes`; the state and the weight gradients, with the values they view, left
    out: rule 3's ``3 S`` and ``G`` terms price them) plus the arrays kept for ``W``
    (:func:`weight_grad_stash_bytes`). Measured with the stash rule (session 31, 2 MPI ranks, 1F1B
    x8): bert's last stage 53-55 MiB against 35 predicted (-34% to -37%)."""
    import onnx_ir as ir

    from partitioner.cost.workdepth import constant_values, peak_activation_bytes

    programs = stage_programs(stage)
    state = set(stage.weights) | {a for a, _ in stage.update_pairs} | {a for a, _ in stage.bn_state}
    grads = {f"{w}.grad" for w in stage.weights}
    peak = 0.0
    for kind in ("FB", "FBt", "W"):
        if kind in programs:
            g = ir.serde.deserialize_model(programs[kind]).graph
            left_out = {v for v in g.inputs if v.name in state} | _viewed({v for v in g.outputs if v.name in grads})
            peak = max(peak, peak_activation_bytes(g, constant_values(g) | left_out))
    return peak + weight_grad_stash_bytes(stage, programs)


def tvm_stage_memory(stage: Any, *, micro_batches: int, in_flight: int, constant_inputs: Any,
                     planned: Any = None) -> TvmStageMemory:
    """A TVM pipeline stage's peak above its baseline (what ``train --bench`` measures), from the
    stage's programs (``pipeline.Stage``): its state (weights, optimizer slots, BN statistics) and
    the terms of the functions above. ``constant_inputs(program)``: the program's lifted
    step-constant inputs (``backends.tvm.lift_step_constants.step_constant_inputs``). Prices the
    runner's defaults (``WEIGHT_TENSORS``, ``STASH_TENSORS``, ``RELEASE_PASSED_BUFFERS``,
    ``RELEASE_STEP_CONSTANTS`` on). ``planned(program)``: a program's memory plan or None
    (:func:`pool_bytes`)."""
    programs = stage_programs(stage)
    return TvmStageMemory(
        state=float(sum(stage.initial[n].nbytes for n in dict.fromkeys(
            [a for a, _ in stage.update_pairs] + [a for a, _ in stage.bn_state]) if n in stage.initial)),
        input_buffers=array_input_bytes(stage, programs),
        step_constants=step_constant_bytes(programs, constant_inputs),
        pool=pool_bytes(stage, programs, planned),
        stash=stash_bytes(stage, programs, in_flight),
        gradients=held_gradient_bytes(stage, programs),
        weight_grad_stash=weight_grad_stash_bytes(stage, programs),
        sends=send_bytes(stage, programs, micro_batches),
    )
