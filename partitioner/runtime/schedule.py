"""The per-rank loop over micro-batches (fill-drain pipelining).

Rule: each rank runs its program once per micro-batch, in micro-batch order, and completes its
outstanding sends only at the end of the step. Because ``Send`` is non-blocking (``Isend``, its
request kept in the communicator's pending list), a pipeline stage starts micro-batch k+1 while
micro-batch k is still travelling to the next stage; stage s is busy from "fill" (its first input
arrives) to "drain" (its last output leaves). Every rank runs the same number of micro-batches, so
matched Send/Recv and collectives line up in order (MPI keeps messages with the same source, tag
and communicator in order).

Profiling (``profile=True``): per timed step, this rank's wall time and where it went:
``run_s`` (inside the executable, all micro-batches), of which ``comm_s`` (inside comm ops:
posting sends, waiting for receives and collectives) and ``vm_s`` (inside the backend's compiled
call, when the backend reports it); ``flush_s`` (completing the sends at the end of the step);
``idle_s`` = step - run - flush (the barriers: waiting for the slowest rank). The derived
``compute_s`` = vm - comm (kernels only) when the backend reports ``vm_s``, else run - comm.
A profiled step's time is its ``step_s`` (the span the plain path times: runs, flush, closing
barrier), so the profile's own bookkeeping is not in the step times ``bench`` reports.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Mapping, Protocol, Sequence

import numpy as np


class RankExecutable(Protocol):
    def run(self, feeds: dict[str, np.ndarray], comm: Any) -> dict[str, np.ndarray]: ...


def run_step(exe: RankExecutable, feeds: Sequence[Mapping[str, np.ndarray]], comm: Any) -> list[dict[str, np.ndarray]]:
    """Run one step (all micro-batches) on this rank; returns outputs per micro-batch."""
    run = exe.run
    outs = [run(f if isinstance(f, dict) else dict(f), comm) for f in feeds]
    flush = getattr(comm, "flush", None)
    if flush is not None:
        flush()
    return outs


@dataclass(frozen=True)
class StepProfile:
    """Where one rank's timed step went (seconds; see the module docstring)."""

    step_s: float
    run_s: float
    comm_s: float
    flush_s: float
    vm_s: float | None
    microbatches: int

    @property
    def compute_s(self) -> float:
        return max(0.0, (self.vm_s if self.vm_s is not None else self.run_s) - self.comm_s)

    @property
    def idle_s(self) -> float:
        return max(0.0, self.step_s - self.run_s - self.flush_s)

    def to_json(self) -> dict[str, Any]:
        return {"step_s": self.step_s, "run_s": self.run_s, "comm_s": self.comm_s, "flush_s": self.flush_s,
                "vm_s": self.vm_s, "compute_s": self.compute_s, "idle_s": self.idle_s,
                "wrapper_s": (self.run_s - self.vm_s) if self.vm_s is not None else None,
                "microbatches": self.microbatches}


@dataclass(frozen=True)
class StepTimes:
    """Wall times (seconds) of the timed steps, after ``warmup`` untimed ones."""

    warmup: int
    times: tuple[float, ...]
    profile: tuple[StepProfile, ...] = field(default=())

    @property
    def median(self) -> float:
        return float(np.median(self.times)) if self.times else float("nan")

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"warmup": self.warmup, "times_s": list(self.times), "median_s": self.median}
        if self.profile:
            doc["profile"] = [p.to_json() for p in self.profile]
        return doc


def _profiled_step(exe: RankExecutable, feeds: Sequence[Mapping[str, np.ndarray]], comm: Any,
                   barrier: Any) -> tuple[list[dict[str, np.ndarray]], StepProfile]:
    clock = time.perf_counter
    comm_before = getattr(comm, "comm_s", 0.0)
    vm_before = getattr(exe, "vm_s", None)
    t0 = clock()
    run = exe.run
    outs = [run(f if isinstance(f, dict) else dict(f), comm) for f in feeds]
    t1 = clock()
    flush = getattr(comm, "flush", None)
    if flush is not None:
        flush()
    t2 = clock()
    if barrier is not None:
        barrier()
    t3 = clock()
    vm_after = getattr(exe, "vm_s", None)
    comm_s = getattr(comm, "comm_s", 0.0) - comm_before
    vm_s = vm_after - vm_before if vm_before is not None and vm_after is not None else None
    return outs, StepProfile(t3 - t0, t1 - t0, comm_s, t2 - t1, vm_s, len(feeds))


def timed_steps(exe: RankExecutable, feeds: Sequence[Mapping[str, np.ndarray]], comm: Any, *, warmup: int,
                repeat: int, barrier: Any = None, profile: bool = False) -> tuple[list[dict[str, np.ndarray]], StepTimes]:
    """Run ``warmup`` + ``repeat`` steps; each timed step starts after ``barrier()`` (all ranks
    aligned) and ends when the slowest rank's step is done. Returns the last outputs and the times
    (with ``profile``, also each timed step's :class:`StepProfile`)."""
    outs: list[dict[str, np.ndarray]] = []
    feeds = [f if isinstance(f, dict) else dict(f) for f in feeds]
    times = []
    profiles = []
    for i in range(warmup + repeat):
        if barrier is not None:
            barrier()
        if profile:
            outs, prof = _profiled_step(exe, feeds, comm, barrier)
            if i >= warmup:
                profiles.append(prof)
                # the same span as below (runs, flush, closing barrier), without the profile's own
                # bookkeeping (reading the counters, building the record: ~2 us a step, which the
                # ONNX Runtime side of ``bench`` does not pay)
                times.append(prof.step_s)
            continue
        t0 = time.perf_counter()
        outs = run_step(exe, feeds, comm)
        if barrier is not None:
            barrier()  # the step ends when the slowest rank ends
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return outs, StepTimes(warmup, tuple(times), tuple(profiles))
