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
3. Used for programs with more than one bucket (:class:`~partitioner.training.runner.StepRunner`):
   a single bucket's AllReduce follows the whole backward, so there is nothing to overlap and a
   thread hand-off would only add latency.
4. The AllReduces run one at a time, in program order, on that one thread: every rank issues
   them in the same order (MPI's collective ordering), and the communicator is used by one
   thread at a time (the step has no other comm op).
5. ``timeline`` records, for the last step, each segment's and AllReduce's (kind, index,
   start, end) on the ``time.perf_counter`` clock, and each AllReduce's hand-off (``submit``):
   the tests check that bucket 0 is handed off before the backward's last segment starts. How
   much of the reduction really runs beside the backward depends on the cores free for the comm
   thread; measure it with ``train --bench`` on a quiet machine.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from backends.onnxruntime import RankExecutable
from partitioner.core import comm_ops
from partitioner.core.segments import CommStep


class OverlappedExecutable(RankExecutable):
    """:class:`~backends.onnxruntime.RankExecutable` with rule 2's asynchronous AllReduce (the
    AllReduce ops of one program only: the steps' other comm ops run inline)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="allreduce")
        self.timeline: list[tuple[str, int, float, float]] = []

    def _comm(self, step: CommStep, inputs: list[np.ndarray | None], comm: Any) -> list[np.ndarray]:
        t0 = time.perf_counter()
        out = comm_ops.execute(step.op, inputs, comm)
        self.timeline.append(("allreduce", step.index, t0, time.perf_counter()))
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
            for step, run in self.steps:
                if isinstance(step, CommStep):
                    need(step.inputs)
                    if step.op.op_type == "AllReduce":
                        now = time.perf_counter()
                        self.timeline.append(("submit", step.index, now, now))
                        fut = self._pool.submit(self._comm, step, [env.get(i) for i in step.op.inputs], comm)
                        pending.update({o: (fut, k) for k, o in enumerate(step.outputs)})
                        continue
                    env.update(zip(step.outputs, comm_ops.execute(step.op, [env.get(i) for i in step.op.inputs],
                                                                  comm)))
                    continue
                need(step.inputs)
                env.update(zip(step.outputs, self._segment(step, run, env)))
            need(list(pending))
        finally:
            for fut, _ in pending.values():
                fut.cancel()
        return {n: env[n] for n in self.outputs}

    def _segment(self, step: Any, run: Any, env: Mapping[str, np.ndarray]) -> list[np.ndarray]:
        t0 = time.perf_counter()
        res = super()._segment(step, run, env)
        self.timeline.append(("segment", step.index, t0, time.perf_counter()))
        return res
