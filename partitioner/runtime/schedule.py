"""The per-rank loop over micro-batches (fill-drain pipelining).

Rule: each rank runs its program once per micro-batch, in micro-batch order, and completes its
outstanding sends only at the end of the step. Because ``Send`` is non-blocking, a pipeline stage
starts micro-batch k+1 while micro-batch k is still travelling to the next stage; stage s is busy
from "fill" (its first input arrives) to "drain" (its last output leaves). Every rank runs the
same number of micro-batches, so matched Send/Recv and collectives line up in order (MPI keeps
messages with the same source, tag and communicator in order).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Mapping, Protocol, Sequence

import numpy as np


class RankExecutable(Protocol):
    def run(self, feeds: dict[str, np.ndarray], comm: Any) -> dict[str, np.ndarray]: ...


def run_step(exe: RankExecutable, feeds: Sequence[Mapping[str, np.ndarray]], comm: Any) -> list[dict[str, np.ndarray]]:
    """Run one step (all micro-batches) on this rank; returns outputs per micro-batch."""
    outs = [dict(exe.run(dict(f), comm)) for f in feeds]
    flush = getattr(comm, "flush", None)
    if flush is not None:
        flush()
    return outs


@dataclass(frozen=True)
class StepTimes:
    """Wall times (seconds) of the timed steps, after ``warmup`` untimed ones."""

    warmup: int
    times: tuple[float, ...]

    @property
    def median(self) -> float:
        return float(np.median(self.times)) if self.times else float("nan")

    def to_json(self) -> dict[str, Any]:
        return {"warmup": self.warmup, "times_s": list(self.times), "median_s": self.median}


def timed_steps(exe: RankExecutable, feeds: Sequence[Mapping[str, np.ndarray]], comm: Any, *, warmup: int,
                repeat: int, barrier: Any = None) -> tuple[list[dict[str, np.ndarray]], StepTimes]:
    """Run ``warmup`` + ``repeat`` steps; each timed step starts after ``barrier()`` (all ranks
    aligned) and ends when this rank's step is done. Returns the last outputs and the times."""
    outs: list[dict[str, np.ndarray]] = []
    times = []
    for i in range(warmup + repeat):
        if barrier is not None:
            barrier()
        t0 = time.perf_counter()
        outs = run_step(exe, feeds, comm)
        if barrier is not None:
            barrier()  # the step ends when the slowest rank ends
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return outs, StepTimes(warmup, tuple(times))
