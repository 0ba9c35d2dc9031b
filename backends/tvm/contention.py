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

Signal. The calling thread's involuntary context switches during one run against its CPU time
in that run (both from one ``getrusage(RUSAGE_THREAD)``: ``ru_nivcsw`` counts a ``sched_yield``
that switched and a preemption; blocking waits are voluntary and not counted). The guard fires on
:data:`CONTENTION_SWITCHES` (4) or more switches that are also at least one per
:data:`CONTENTION_CPU_MS_PER_SWITCH` (0.25 ms) of the thread's CPU time. Measured at load 3-4
(per run, 10th-90th percentile of switches per CPU-ms): the pool taking turns, one switch per
parallel kernel, 15-33 (gpt b1 15 switches in 0.48 ms of CPU, heldout_unet b1 24 in 1.5 ms,
mobilenet b1 36 in 1.5 ms); plain preemption by other processes 0.3-1.8 (resnet18 b8 on 1
thread: 67 in 78 ms; resnet18 b1 and b8 on 2 threads 0.7-1.2). CPU time and not wall time: when
the yields hand the core to other processes the wall grows by their slices (gpt b1: 59 ms a run
pinned to a busy core) while the thread's CPU time does not, so the rate stays high exactly in the
worst case. A 2-thread run with both cores to itself has 0-1 switches.

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

Grace after a wake (session 21; off: :data:`CONTENTION_GRACE_S` = 0). A run that starts more
than :data:`CONTENTION_WAKE_S` (5 ms, the pool's bounded idle spin, ``threads.POOL_SPIN_COUNT``)
after the pool's last multi-thread run ended wakes sleeping workers; with a grace, runs that start
within :data:`CONTENTION_GRACE_S` of such a wake run with the requested count and are not judged.
What it was for, measured on the 2-core Zen 4 machine (guard off, mobilenet b1, 4-6 runs back to
back after each pause of 50 or 200 ms): in some processes the woken worker was placed on the
calling thread's core after most pauses (38 switches a run, one per parallel kernel, 2.1-3.3 ms
against 1.1 ms back to back) and stayed there for 2-6 runs (5-17 ms) until the load balancer
moved it (one process 50 of 50 pauses, three others 23-53 of 80 runs; four other processes 2 of 60
pauses). With the guard, the first such run drops to 1 thread and each probe after a hold wakes a
sleeping worker again, onto the same core: mobilenet b1 stayed on 1 thread throughout (6 drops in
6 judged runs). Why it is off: paired in one process (``benchmarks/idle_wake.py --burst 4
--graces 0.03,0``, 50 ms pauses) the grace removed the drops but not the turn-taking (84 of 120
runs taking turns), so the median did not move (mobilenet b1 2.29 against 2.28 ms; gpt b1 1.01
against 0.96 ms); in a full ``per_device.py`` run with the grace against without
(``--runtime-baseline``, session 21) the guard did not fire in either. Pinning the worker away
from the calling thread's core (a prototype, not in the code) removed the turn-taking too (0 of 80
runs in each of 12 processes) but not all of the slowness after a pause (medians 1.2-2.4 ms a run,
against 1.8-2.8 ms unpinned in the same minutes and 1.1-1.2 ms back to back). Each drop is recorded in :attr:`ContentionGuard.events` (switches, CPU, the idle gap
before the run, the hold), the last :data:`EVENTS_KEPT`.

Not covered: a worker whose core is busy while the calling thread's core is free (the calling
thread then spins on its own core without switching: slow, but not seen by this signal).
:data:`CONTENTION_SWITCHES` = 0 turns the guard off.
"""

from __future__ import annotations

import resource
import time
from typing import Callable

CONTENTION_SWITCHES = 4
CONTENTION_CPU_MS_PER_SWITCH = 0.25
CONTENTION_HOLD_S = 0.05
CONTENTION_MAX_HOLD_S = 1.0
CONTENTION_WAKE_S = 0.005
CONTENTION_GRACE_S = 0.0
EVENTS_KEPT = 64

_HAVE_THREAD_USAGE = hasattr(resource, "RUSAGE_THREAD")


def thread_usage() -> tuple[int, float]:
    """The calling thread's involuntary context switches and CPU seconds so far ((-1, 0.0) where
    the OS cannot say)."""
    if not _HAVE_THREAD_USAGE:
        return -1, 0.0
    r = resource.getrusage(resource.RUSAGE_THREAD)
    return r.ru_nivcsw, r.ru_utime + r.ru_stime


class ContentionGuard:
    """The rule of the module docstring for one calling thread; ``set_threads(n)`` sets the
    number of threads that thread's pool uses."""

    def __init__(self, set_threads: Callable[[int], None]) -> None:
        self._set_threads = set_threads
        self.single = False  # the pool was dropped to 1 thread
        self.until = 0.0  # time.monotonic() at which the next probe runs
        self.hold = CONTENTION_HOLD_S
        self.dropped = 0  # how often it dropped (a diagnostic)
        self.last_end = -1e9  # time.monotonic() at the end of the last multi-thread run
        self.grace_until = 0.0  # runs starting before this are not judged (a wake's grace)
        self.events: list[dict[str, float]] = []  # the last EVENTS_KEPT drops (a diagnostic)

    def before(self, requested: int) -> tuple[int, float, float, bool] | None:
        """Call before a run with the thread count asked for; returns what :meth:`after` takes
        (None: a 1-thread run, not watched)."""
        if CONTENTION_SWITCHES <= 0 or requested <= 1 or not _HAVE_THREAD_USAGE:
            if self.single and requested > 1:  # the guard was turned off while dropped
                self._set_threads(requested)
            self.single = False
            return None
        now = time.monotonic()
        if self.single:
            if now < self.until:
                return None
            self._set_threads(requested)  # the probe run
            self.single = False
        idle = now - self.last_end
        if idle > CONTENTION_WAKE_S:  # the workers are asleep: this run wakes them
            self.grace_until = now + CONTENTION_GRACE_S
        switches, cpu_s = thread_usage()
        return switches, cpu_s, idle, now >= self.grace_until

    def after(self, start: tuple[int, float, float, bool] | None) -> None:
        """Call after a run with what :meth:`before` returned."""
        if start is None:
            return
        switches, cpu_s = thread_usage()
        self.last_end = time.monotonic()
        if not start[3]:
            return  # in a wake's grace
        n, cpu_ms = switches - start[0], 1e3 * (cpu_s - start[1])
        if n >= CONTENTION_SWITCHES and n * CONTENTION_CPU_MS_PER_SWITCH >= cpu_ms:
            self._set_threads(1)
            self.single, self.until = True, self.last_end + self.hold
            event = {"switches": n, "cpu_ms": round(cpu_ms, 3),
                     "idle_before_ms": round(1e3 * min(start[2], 1e6), 3), "hold_s": self.hold}
            self.events = self.events[-(EVENTS_KEPT - 1):] + [event]
            self.hold = min(2 * self.hold, CONTENTION_MAX_HOLD_S)
            self.dropped += 1
        else:
            self.hold = CONTENTION_HOLD_S
