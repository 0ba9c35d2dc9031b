"""The contention guard: a multi-thread run whose calling thread keeps yielding its core drops to
one thread for a while.

Why. TVM's pool splits a parallel loop statically (chunk i to worker i) and the calling thread,
once its own chunk is done, waits for the others by calling ``sched_yield`` in a loop
(``ParallelLauncher::WaitForJobs``). When a worker is not running, each of those yields gives the
core away: to the worker itself when the scheduler put both threads on one core (they take turns:
the kernel takes its 1-thread time plus two switches), or to another process for a whole time
slice when one is runnable there (EEVDF puts a yielding task behind the others). Measured on the
2-core development machine at load ~8 (other processes running): gpt at batch 1 took 0.87-1.16 ms
on 1 thread and 3.7-68 ms on 2 (15 involuntary switches of the calling thread per run, one per
parallel kernel), while ONNX Runtime took 1.1 ms (its calling thread runs the work items no worker
has claimed). Pinned with its worker to one core, the same run took 59 ms.

Signal. The calling thread's involuntary context switches during one run (``getrusage
(RUSAGE_THREAD).ru_nivcsw``: a ``sched_yield`` that switched, or a preemption; blocking waits are
voluntary and not counted). A 2-thread run with both cores to itself has 0-1. The guard fires
on :data:`CONTENTION_SWITCHES` (4) or more that are also at least one per
:data:`CONTENTION_MS_PER_SWITCH` (2 ms) of the run: the pool taking turns switches once per
parallel kernel (measured at load ~7: gpt b1 15 in 7.7 ms, mobilenet b1 36 in 8 ms), while plain
preemption of a 1-thread run by other processes came to 0.26 per ms at the same load (resnet18
b8, 19 in 75 ms), and a long run on a quiet machine sees far fewer.

Rule. Then the calling thread's pool uses 1 thread (``runtime.config_threadpool(1, 1)``, ~0.5 us:
no thread is restarted) for ``hold`` seconds, after which one probe run uses the requested count
again; ``hold`` starts at :data:`CONTENTION_HOLD_S` (50 ms), doubles after each probe that is
still contended (up to :data:`CONTENTION_MAX_HOLD_S`, 1 s) and resets after a run without
contention. Seconds, not runs: a model of 200 ms a run must not stay on 1 thread for minutes after
the contention is gone.
Cost when nothing is contended: two ``getrusage`` calls per run (~1-2 us).

For: CPU programs without comm ops and without ONNX Runtime fallback segments (a ``Recv``, an MPI
progress loop or ORT's own pool switch the thread for reasons unrelated to TVM's pool), run with
2 or more threads. One guard per calling thread: TVM's pool is per calling thread.

Not covered: a worker whose core is busy while the calling thread's core is free (the calling
thread then spins on its own core without switching: slow, but not seen by this signal).
:data:`CONTENTION_SWITCHES` = 0 turns the guard off.
"""

from __future__ import annotations

import resource
import time
from typing import Callable

CONTENTION_SWITCHES = 4
CONTENTION_MS_PER_SWITCH = 2.0
CONTENTION_HOLD_S = 0.05
CONTENTION_MAX_HOLD_S = 1.0

_HAVE_THREAD_USAGE = hasattr(resource, "RUSAGE_THREAD")


def involuntary_switches() -> int:
    """The calling thread's involuntary context switches so far (-1 where the OS cannot say)."""
    if not _HAVE_THREAD_USAGE:
        return -1
    return resource.getrusage(resource.RUSAGE_THREAD).ru_nivcsw


class ContentionGuard:
    """The rule of the module docstring for one calling thread; ``set_threads(n)`` sets the
    number of threads that thread's pool uses."""

    def __init__(self, set_threads: Callable[[int], None]) -> None:
        self._set_threads = set_threads
        self.single = False  # the pool was dropped to 1 thread
        self.until = 0.0  # time.monotonic() at which the next probe runs
        self.hold = CONTENTION_HOLD_S
        self.dropped = 0  # how often it dropped (a diagnostic)

    def before(self, requested: int) -> int | None:
        """Call before a run with the thread count asked for; returns what :meth:`after` takes
        (None: the run is not watched)."""
        if CONTENTION_SWITCHES <= 0 or requested <= 1 or not _HAVE_THREAD_USAGE:
            if self.single and requested > 1:  # the guard was turned off while dropped
                self._set_threads(requested)
            self.single = False
            return None
        if self.single:
            if time.monotonic() < self.until:
                return None
            self._set_threads(requested)  # the probe run
            self.single = False
        return involuntary_switches()

    def after(self, start: int | None, seconds: float) -> None:
        """Call after a run of ``seconds`` with what :meth:`before` returned."""
        if start is None:
            return
        n = involuntary_switches() - start
        if n >= CONTENTION_SWITCHES and n * CONTENTION_MS_PER_SWITCH >= 1e3 * seconds:
            self._set_threads(1)
            self.single, self.until = True, time.monotonic() + self.hold
            self.hold = min(2 * self.hold, CONTENTION_MAX_HOLD_S)
            self.dropped += 1
        else:
            self.hold = CONTENTION_HOLD_S
