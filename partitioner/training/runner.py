"""Run training steps with the weights and optimizer state resident in the process.

A :class:`StepRunner` builds the step program once (ONNX Runtime session, or a TVM library),
keeps the state (weights, BN statistics, optimizer moments) as arrays between steps, and after
each step swaps every ``S`` for the step's ``S.next`` output: nothing is reloaded or
re-serialised per step. The same runner executes a data-parallel rank: the step program then
holds ``partitioner.comm.AllReduce`` nodes, run through the project's comm ops on ``comm``
(an in-process :class:`~partitioner.runtime.comm_local.LocalWorld` communicator or MPI).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir

from partitioner.core.errors import UsageError
from partitioner.training import buckets as _buckets
from partitioner.training.step import TrainingSignature, initial_state, signature, step_program

BACKENDS = ("onnxruntime", "tvm")
#: set to 0 to run data-parallel ONNX Runtime ranks with blocking AllReduce (docs/training.md)
OVERLAP_ENV = "PARTITIONER_TRAIN_OVERLAP"
#: ONNX Runtime ranks: every segment's session (and a pipeline stage's programs, and a 1-rank
#: step's one session) take their buffers from one process-wide arena instead of one arena each
#: (docs/training.md, memory; its config: ``backends.onnxruntime.ARENA_MAX_DEAD_BYTES``)
SHARED_ARENA = os.environ.get("PARTITIONER_TRAIN_SHARED_ARENA", "1") != "0"
#: ONNX Runtime 1-rank and data ranks: the sessions' memory pattern
#: (``SessionOptions.enable_mem_pattern``), off by default. With it on, ONNX Runtime traces the
#: first run's allocations and from the second run on takes one block sized to that trace, while
#: the arena keeps the first run's chunks: the step's live activations are held about twice from
#: step 2 on. Measured (session 30, one session, 1 thread, zoo sizes of ``benchmarks/train_step.py``,
#: peak RSS above the loaded process at step 3, on / off): resnet batch 64 515 / 389 MiB, batch 32
#: 298 / 249, bert 249 / 138, mlp 71 / 59; step time off / on 0.99, 0.98, 0.99 (12 interleaved
#: steps each). Cost rule 3 prices these ranks' activations from the step graph
#: (``cost.training.STEP_LIVE_ACTIVATIONS``). Tensor ranks (``tensor.TensorRunner``) and pipeline
#: stages keep the pattern on: their rule 3 terms were measured with it, and off their peaks fell
#: below the predictions (the mlp 2048's 1F1B x8 SGD stages 170 / 90 MiB against 224 / 113, bert's
#: tensor ranks 157 against 204); turning it off there waits for that refit.
#: ``PARTITIONER_TRAIN_MEMORY_PATTERN=1`` turns it back on everywhere.
MEMORY_PATTERN = os.environ.get("PARTITIONER_TRAIN_MEMORY_PATTERN", "0") == "1"
#: ONNX Runtime 1-rank and data ranks: the planner's buffer reuse (``SessionOptions.
#: enable_mem_reuse``), off by default. With it on, a value may take over a freed buffer the
#: planner chose, and on conv nets the step's peak rose far above the graph's live bytes (the
#: "conv-net factor" of session 30): the unet of ``benchmarks/heldout_models.py`` at batch 8, no
#: arena and every buffer mmap'd (strace): 158 MiB at the step's peak with reuse, 101 without, the
#: step graph's own peak live bytes 103. With the arena, peak RSS above the loaded process at step
#: 3 (session 31, pattern off, 1 thread, on / off): heldout_unet b8 191 / 138 MiB, resnet b64 390 /
#: 331, bert b32 142 / 141, mlp b64 41 / 41; step time off / on 0.97, 0.99, 0.99, 1.01 (10
#: interleaved steps each). Tensor ranks and pipeline stages keep it on with the memory pattern
#: (their rule 3 terms were measured so). ``PARTITIONER_TRAIN_MEMORY_REUSE=1`` turns it back on.
MEMORY_REUSE = os.environ.get("PARTITIONER_TRAIN_MEMORY_REUSE", "0") == "1"
#: TVM steps (1 rank, data ranks): a stride-1 ``ConvTranspose`` of a weight (a conv's input
#: gradient) runs as ``Conv(dY, flip(W^T))``, a strided one in its phase form (hoist rule 4) (:func:`partitioner.training.hoist.
#: conv_transpose_as_conv`, hoist rule 4; pipeline stages already do it). TVM's conv2d_transpose
#: transforms the weight on every call and runs far below its conv2d (layer4's 3x3 512-channel
#: input gradients 10-15 ms a call against ~0.5 ms for the forward conv, docs/training.md); a
#: 1-rank step calls it once per step, so the weight's transpose and flip stay in the step.
TVM_CONV_TRANSPOSE_AS_CONV = True


def _overlap_flat() -> bool:
    """Whether overlap rule 9 (``FLAT_ELEMENTWISE``) is on, read at build time (tests switch it)."""
    from partitioner.training import overlap

    return overlap.FLAT_ELEMENTWISE


def tvm_cut(program: onnx.ModelProto, weights: set[str]) -> tuple[onnx.ModelProto, Any]:
    """How a TVM rank runs its step ``program`` (hoist rule 4 applied to it in place first, with
    :data:`TVM_CONV_TRANSPOSE_AS_CONV`): the program its libraries come from and the cut. The cut
    is ``None`` for a data rank (the buckets unbucketed, one library per segment between the
    AllReduces: overlap rule 7), ``update_kind`` for a 1-rank step (overlap rule 9: the forward
    and backward's library and the update's), False for one library of the whole program."""
    if TVM_CONV_TRANSPOSE_AS_CONV:
        from partitioner.training.hoist import conv_transpose_as_conv

        conv_transpose_as_conv(program, weights)
    buckets = sum(1 for n in program.graph.node if n.op_type == "AllReduce")
    if buckets and _buckets.LIST_ALLREDUCE:
        return _buckets.unbucket(program), None
    if not buckets and _overlap_flat():
        from partitioner.training.overlap import update_kind

        return program, update_kind
    return program, False


def tvm_rank_programs(step: ir.Model | onnx.ModelProto) -> list[onnx.ModelProto]:
    """The compute programs a TVM :class:`StepRunner` of ``step`` builds a library of, in order
    (graphs only, nothing compiled: what the cost model prices)."""
    program, cut = tvm_cut(step_program(step), set(signature(step).weights))
    if cut is False:
        return [program]
    from partitioner.training.overlap import segment_programs

    return segment_programs(program, cut)


class _NoComm:
    """The communicator of a 1-rank step (its program has no comm op)."""

    rank = 0
    world_size = 1


class StepRunner:
    """One rank's training step on ``backend`` with resident state (see the module docstring)."""

    #: ONNX Runtime's memory pattern for this runner's sessions; None: :data:`MEMORY_PATTERN`
    memory_pattern: bool | None = None
    #: ONNX Runtime's buffer reuse for this runner's sessions; None: :data:`MEMORY_REUSE`
    memory_reuse: bool | None = None

    def __init__(self, step: ir.Model | onnx.ModelProto, *, backend: str = "onnxruntime", comm: Any = None,
                 workdir: str | os.PathLike[str] | None = None, threads: int = 1,
                 state: Mapping[str, np.ndarray] | None = None) -> None:
        if backend not in BACKENDS:
            raise UsageError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
        self.signature: TrainingSignature = signature(step)
        self.state: dict[str, np.ndarray] = dict(state) if state is not None else initial_state(step)
        self.program = step_program(step)
        self.comm = comm if comm is not None else _NoComm()
        self.backend = backend
        self.steps = 0
        buckets = sum(1 for n in self.program.graph.node if n.op_type == "AllReduce")
        overlap = os.environ.get(OVERLAP_ENV, "1") != "0"  # 0: blocking AllReduce (to measure the gain)
        if backend == "onnxruntime" and buckets and (overlap and buckets > 1 or _buckets.LIST_ALLREDUCE):
            from partitioner.training.overlap import OverlappedExecutable  # AllReduce beside the backward

            program = _buckets.unbucket(self.program) if _buckets.LIST_ALLREDUCE else self.program  # buckets rule 1
            # one bucket: nothing to overlap, no thread hop (overlap rule 3)
            self._exe = OverlappedExecutable(program, threads=threads, shared_arena=SHARED_ARENA,
                                             overlap=overlap and buckets > 1, **self._session_memory())
        elif backend == "onnxruntime":
            from backends.onnxruntime import RankExecutable

            # one session or several segments: the process arena (its config: backends.onnxruntime.
            # ARENA_MAX_DEAD_BYTES; a session's own arena cannot be configured from Python)
            self._exe = RankExecutable(self.program, threads=threads, shared_arena=SHARED_ARENA,
                                       **self._session_memory())
        else:
            folder = Path(workdir) if workdir is not None else Path(tempfile.mkdtemp(prefix="partitioner-train-"))
            program, cut = tvm_cut(self.program, set(self.signature.weights))
            if cut is not False:  # one library per segment (in-place list AllReduce; or the update apart)
                from partitioner.training.overlap import TvmBucketedExecutable

                self._exe = TvmBucketedExecutable(program, folder, threads=threads,
                                                  overlap=overlap and buckets > 1, kind_of=cut)
            else:
                from partitioner.training.pipeline_runner import executable

                self._exe = executable(program, "tvm", folder, threads)
            from partitioner.training.overlap import TvmBucketedExecutable, vm_aligned

            if isinstance(self._exe, TvmBucketedExecutable):  # they take aligned state as it lies (rule 8)
                self.state = {k: vm_aligned(v) for k, v in self.state.items()}

    def _session_memory(self) -> dict[str, bool]:
        """ONNX Runtime's memory pattern and buffer reuse for this runner's sessions."""
        return {"memory_pattern": MEMORY_PATTERN if self.memory_pattern is None else self.memory_pattern,
                "memory_reuse": MEMORY_REUSE if self.memory_reuse is None else self.memory_reuse}

    def step(self, data: Mapping[str, np.ndarray], labels: np.ndarray) -> float:
        """One step on a batch; returns the loss (the global mean with data parallelism)."""
        feeds = {**data, self.signature.labels: labels, **{a: self.state[a] for a, _ in self.signature.state}}
        out = self._exe.run(feeds, self.comm)
        for a, b in self.signature.state:
            self.state[a] = out[b]
        self.steps += 1
        return float(out[self.signature.loss])

    def weights(self) -> dict[str, np.ndarray]:
        """The trainable weights and BN statistics now (the checkpoint's initializers)."""
        names = set(self.signature.weights) | {a for a, _ in self.signature.state
                                               if not a.endswith((".m", ".v", ".velocity")) and a != "optimizer.step"}
        return {n: self.state[n] for n in names}
