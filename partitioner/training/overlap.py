"""A data-parallel rank's step with the gradient AllReduce overlapping the rest of the backward.

Rules:

1. The step program places each gradient bucket's AllReduce right after the node that finishes
   the bucket's last gradient (:mod:`partitioner.training.step` rule 5), so the program cut at its
   comm ops reads: forward + the backward up to bucket 0, AllReduce 0, the backward up to bucket
   1, AllReduce 1, ..., then the mean, split and optimizer.
2. :class:`OverlappedExecutable` runs the ONNX Runtime segments in program order on the calling
   thread and hands every AllReduce to one communication thread as soon as its input exists; a
   segment waits only for the AllReduce outputs it reads. ONNX Runtime and the communicators'
   blocking calls (mpi4py, the in-process queues) release the GIL, so the reduction of bucket b
   runs while the backward computes the next buckets' gradients.
3. Overlap is on for programs with more than one bucket (:class:`~partitioner.training.runner.StepRunner`):
   a single bucket's AllReduce follows the whole backward, so there is nothing to overlap and a
   thread hand-off would only add latency (``overlap=False``: every AllReduce runs inline).
4. The AllReduces run one at a time, in program order, on that one thread: every rank issues
   them in the same order (MPI's collective ordering), and the communicator is used by one
   thread at a time (the step has no other comm op).
5. ``timeline`` records, for the last step, each segment's and AllReduce's (kind, index,
   start, end) on the ``time.perf_counter`` clock, and each AllReduce's hand-off (``submit``):
   the tests check that bucket 0 is handed off before the backward's last segment starts. How
   much of the reduction really runs beside the backward depends on the cores free for the comm
   thread; measure it with ``train --bench`` on a quiet machine.
6. A run of consecutive AllReduce steps with one tag (a bucket rewritten by
   :func:`partitioner.training.buckets.unbucket`) is one collective over the list of its inputs
   (``comm.allreduce_list``, :mod:`partitioner.runtime.comm_mpi` rule 8; a communicator without
   it gets the concatenation AllReduced and split here).
7. TVM ranks (:class:`TvmBucketedExecutable`, for data-parallel ranks with
   :data:`partitioner.training.buckets.LIST_ALLREDUCE`): the TVM VM calls a comm op with one
   tensor, so a bucket run inside one library needs the concatenation and split. Instead the
   unbucketed program is cut at its comm ops (:func:`partitioner.core.segments.split_program`)
   and every compute segment is a library of its own: the backward's segments return the
   gradients, rule 6's list AllReduce reduces them *in place* (into the arrays the segment
   returned, fresh VM tensors: no allocation, no concatenation, no split, no copy into a comm
   op's output tensor; only when nothing else reads them or shares their memory,
   :meth:`TvmBucketedExecutable._writable`) and the next segment (the update) takes them as
   inputs. Rules 2-4 apply unchanged: with more than one bucket the AllReduce runs on the comm
   thread beside the next backward segment (the TVM VM call releases the GIL).
8. Cutting the step into libraries turns values that stayed inside one VM call into arrays
   between calls: the gradients, the forward activations a later backward segment reads (the
   zoo resnet at local batch 8: 24 MiB) and the weights every segment reads. A TVM library
   copies each input into a persistent buffer of its own (:mod:`backends.tvm.executable` rule
   5, for arrays of any alignment), so each segment's library (:func:`_segment_library`)
   passes every input that is already a writable, C-contiguous array on a
   :data:`VM_ALIGNMENT`-byte boundary (an earlier segment's outputs, the state the update
   returned: VM tensors) to the VM as it lies, through DLPack; only the others (the batch)
   are copied.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from backends.onnxruntime import RankExecutable
from partitioner.core import comm_ops
from partitioner.core.segments import CommStep, Segment, split_program
from partitioner.training.buckets import bucket_runs


#: rule 8: TVM's kernels take their arguments on this alignment (the VM allocates so)
VM_ALIGNMENT = 64


class _BucketedSteps:
    """Rules 2-6 over ``self.steps`` (``(step, run)`` pairs: a segment and what runs it, or a
    comm step and None), ``self.outputs`` and ``self._segment``, for either backend."""

    steps: list[tuple[Any, Any]]
    outputs: Any

    def _bucketed(self, overlap: bool) -> None:
        self.overlap = overlap
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="allreduce") if overlap else None
        self.timeline: list[tuple[str, int, float, float]] = []
        tags = [s.op.tag if isinstance(s, CommStep) and s.op.op_type == "AllReduce" else None for s, _ in self.steps]
        self.runs = bucket_runs(tags)

    def _writable(self, run: int, env: Mapping[str, np.ndarray], names: list[str]) -> bool:
        """Whether AllReduce run ``run`` may write its results into its inputs (rule 7: TVM ranks;
        ONNX Runtime ranks keep rule 6's new arrays, in place is not tried there)."""
        return False

    def _comm(self, steps: list[CommStep], inputs: list[np.ndarray], comm: Any,
              in_place: bool = False) -> list[np.ndarray]:
        t0 = time.perf_counter()
        op = steps[0].op
        if len(steps) == 1 and not in_place:
            out = comm_ops.execute(op, inputs, comm)
        elif hasattr(comm, "allreduce_list"):
            out = comm.allreduce_list(inputs, op.group, op.attrs["reduction"], op.tag,
                                      out=inputs if in_place else None)
        else:  # rule 6 without a list collective: one AllReduce of the concatenation
            flat = comm.allreduce(np.concatenate([np.reshape(x, -1) for x in inputs]), op.group,
                                  op.attrs["reduction"], op.tag)
            ends = np.cumsum([np.size(x) for x in inputs])[:-1]
            out = [p.reshape(np.shape(x)) for p, x in zip(np.split(flat, ends), inputs)]
        self.timeline.append(("allreduce", steps[0].index, t0, time.perf_counter()))
        return out

    def run(self, feeds: Mapping[str, np.ndarray], comm: comm_ops.Communicator) -> dict[str, np.ndarray]:
        env: dict[str, np.ndarray] = dict(feeds)
        pending: dict[str, tuple[Future, int]] = {}
        self.timeline = []

        def need(names: Any) -> None:
            for n in names:
                if n in pending:
                    fut, k = pending.pop(n)
                    env[n] = fut.result()[k]  # re-raises the comm thread's error here

        try:
            for a, b in self.runs:
                step, run = self.steps[a]
                if not isinstance(step, CommStep):
                    need(step.inputs)
                    t0 = time.perf_counter()
                    env.update(zip(step.outputs, self._segment(step, run, env)))
                    self.timeline.append(("segment", step.index, t0, time.perf_counter()))
                    continue
                steps = [s for s, _ in self.steps[a:b]]
                names = [n for s in steps for n in s.inputs]
                need(names)
                outputs = [o for s in steps for o in s.outputs]
                if step.op.op_type == "AllReduce":
                    args = (steps, [env[i] for i in names], comm, self._writable(a, env, names))
                if step.op.op_type == "AllReduce" and self._pool is not None:
                    now = time.perf_counter()
                    self.timeline.append(("submit", step.index, now, now))
                    fut = self._pool.submit(self._comm, *args)
                    pending.update({o: (fut, k) for k, o in enumerate(outputs)})
                elif step.op.op_type == "AllReduce":
                    env.update(zip(outputs, self._comm(*args)))
                else:
                    env.update(zip(step.outputs, comm_ops.execute(step.op, [env.get(i) for i in step.op.inputs],
                                                                  comm)))
            need(list(pending))
        finally:
            for fut, _ in pending.values():
                fut.cancel()
        return {n: env[n] for n in self.outputs}


class OverlappedExecutable(_BucketedSteps, RankExecutable):
    """:class:`~backends.onnxruntime.RankExecutable` with rule 2's asynchronous AllReduce (the
    AllReduce ops of one program only: the steps' other comm ops run inline) and rule 6's bucket
    runs; ``overlap=False`` runs every AllReduce inline (rule 3)."""

    def __init__(self, *args: Any, overlap: bool = True, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._bucketed(overlap)


class TvmBucketedExecutable(_BucketedSteps):
    """Rule 7: a data-parallel TVM rank's program (its buckets unbucketed) as one TVM library per
    compute segment, the gradients AllReduced in place between them."""

    def __init__(self, program: onnx.ModelProto, workdir: Path | None, *, threads: int = 1,
                 overlap: bool = True) -> None:
        self.outputs = tuple(o.name for o in program.graph.output)
        self.steps = [(s, _build_segment(s.model, workdir, threads) if isinstance(s, Segment) else None)
                      for s in split_program(program) if not isinstance(s, Segment) or s.outputs]
        self._bucketed(overlap)
        self._in_place: dict[int, bool] = {}

    def _writable(self, run: int, env: Mapping[str, np.ndarray], names: list[str]) -> bool:
        """Rule 7's guard, decided at the first step (the program and the VM's views are the
        same every step): in place only when no later step nor the step's outputs read an
        input of the run, no input is named twice, and no input shares memory with another
        value of the step (a TVM reshape may return a view of a tensor it returns too)."""
        if run not in self._in_place:
            end = next(b for a, b in self.runs if a == run)
            later = set(self.outputs).union(*(s.inputs for s, _ in self.steps[end:]))
            mine = [env[n] for n in names]
            others = [v for k, v in env.items() if k not in names and isinstance(v, np.ndarray)]
            self._in_place[run] = (len(set(names)) == len(names) and not later & set(names)
                                   and all(isinstance(x, np.ndarray) and x.flags.writeable for x in mine)
                                   and not any(np.may_share_memory(x, o) for x in mine for o in others))
        return self._in_place[run]

    def _segment(self, step: Any, run: Any, env: Mapping[str, np.ndarray]) -> list[np.ndarray]:
        out = run.run({n: env[n] for n in step.inputs}, None)  # a segment holds no comm op
        return [out[n] for n in step.outputs]


@functools.cache
def _segment_library() -> type:
    """Rule 8's library class (made on first use: importing the TVM backend loads TVM)."""
    from backends.tvm.executable import TvmRankExecutable

    class SegmentLibrary(TvmRankExecutable):
        """A segment's TVM library that takes VM-aligned arrays as they lie (rule 8)."""

        def _input_buffers(self, feeds: dict[str, np.ndarray]) -> list[Any]:
            import tvm

            args = []
            for i, name in enumerate(self.inputs):
                x = feeds[name]
                if (isinstance(x, np.ndarray) and x.size and x.flags.c_contiguous and x.flags.writeable
                        and x.dtype.kind in "fiub" and x.ctypes.data % VM_ALIGNMENT == 0):
                    args.append(tvm.runtime.from_dlpack(x))
                    continue
                buf = self._in_bufs[i]  # the others: a persistent buffer each (executable rule 5)
                if buf is None or buf[1].shape != x.shape or buf[1].dtype != x.dtype:
                    t = tvm.runtime.empty(x.shape, str(x.dtype), self.device)
                    buf = self._in_bufs[i] = (t, np.from_dlpack(t))
                np.copyto(buf[1], x)
                args.append(buf[0])
            return args

    return SegmentLibrary


def _build_segment(model: onnx.ModelProto, workdir: Path | None, threads: int) -> Any:
    """One segment's rule 8 library, built into ``workdir``."""
    import tempfile

    from backends.tvm.build import build_one
    from backends.tvm.target import target_dict

    folder = Path(workdir) if workdir is not None else Path(tempfile.mkdtemp(prefix="partitioner-train-"))
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{model.graph.name}.so"
    build_one(model, path, target_dict(None), {"threads": threads})  # 1: no parallel loops (threads.py)
    return _segment_library()(model, path, threads=threads)
