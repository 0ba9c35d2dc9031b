"""Fault injection for tests (a TEST HOOK: never set it in production).

``PARTITIONER_FAULT="rank:1,at:recv,kind:raise"`` makes rank 1 fail when it reaches a ``recv``.

Fields (comma-separated ``key:value``):
- ``rank``: the global rank that fails.
- ``at``: where: a comm op (``send``, ``recv``, ``allreduce``, ``allgather``, ``reduce_scatter``,
  ``alltoall``, ``broadcast``), ``any`` (the first comm op), ``start`` (after the artifact is
  verified, before the first micro-batch) or ``built`` (a training rank under MPI, after it
  built its programs, before :mod:`partitioner.training.loop` rule 7's barrier).
- ``kind``: ``raise`` (a :class:`RunFailed`, handled like any error: one line, then Abort),
  ``exit`` (``os._exit(3)``: the process vanishes without MPI_Finalize), ``kill`` (SIGKILL to
  itself, as if the OOM killer struck) or ``slow`` (not a failure: the rank sleeps ``seconds``
  and goes on, as a rank whose build takes longer on a loaded machine).
- ``after`` (optional, default 0): skip this many matching calls first.
- ``seconds`` (``kind:slow`` only, default 5): how long the rank sleeps.

The worker and the MPI communicator call :func:`maybe_fail` at each of those points.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from dataclasses import dataclass

from partitioner.core.errors import RunFailed, UsageError

ENV = "PARTITIONER_FAULT"
KINDS = ("raise", "exit", "kill", "slow")


@dataclass(frozen=True)
class Fault:
    rank: int
    at: str
    kind: str
    after: int = 0
    seconds: float = 5.0

    @classmethod
    def parse(cls, text: str) -> Fault:
        try:
            fields = dict(item.split(":", 1) for item in text.split(",") if item.strip())
            fault = cls(int(fields["rank"]), fields.get("at", "any"), fields.get("kind", "raise"),
                        int(fields.get("after", 0)), float(fields.get("seconds", 5.0)))
        except (KeyError, ValueError):
            raise UsageError(f"{ENV}={text!r}: expected e.g. rank:1,at:recv,kind:raise") from None
        if fault.kind not in KINDS:
            raise UsageError(f"{ENV}: kind must be one of {', '.join(KINDS)}")
        return fault


class FaultHook:
    """Counts matching points and triggers the fault once its turn comes."""

    def __init__(self, fault: Fault | None, rank: int) -> None:
        self.fault = fault if fault is not None and fault.rank == rank else None
        self.seen = 0

    def maybe_fail(self, at: str) -> None:
        f = self.fault
        if f is None or (f.at != at and not (f.at == "any" and at != "start")):
            return
        self.seen += 1
        if self.seen <= f.after:
            return
        if f.kind == "slow":
            time.sleep(f.seconds)
            return
        if f.kind == "raise":
            raise RunFailed(f"injected fault ({ENV}) at {at}")
        sys.stderr.flush()
        if f.kind == "exit":
            os._exit(3)
        os.kill(os.getpid(), signal.SIGKILL)


def from_env(rank: int) -> FaultHook:
    text = os.environ.get(ENV, "").strip()
    return FaultHook(Fault.parse(text) if text else None, rank)
