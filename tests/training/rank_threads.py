"""The ranks of an in-process world (:class:`partitioner.runtime.comm_local.LocalWorld`) stepping
together: one thread per runner, as the training loop runs them without MPI."""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np


def step_ranks(runners: Sequence[Any], feeds: Callable[[int], tuple[Mapping[str, np.ndarray], np.ndarray]],
               timeout: float = 60) -> list[float]:
    """Every runner's ``step(*feeds(rank))`` on its own thread; each rank's loss. Fails when a
    rank did not return within ``timeout`` seconds (an exception in a rank's thread leaves its
    loss unset, so it fails here too)."""
    out: list[float | None] = [None] * len(runners)

    def work(r: int) -> None:
        out[r] = runners[r].step(*feeds(r))

    threads = [threading.Thread(target=work, args=(r,)) for r in range(len(runners))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=timeout)
    assert all(o is not None for o in out), f"ranks without a loss: {[r for r, o in enumerate(out) if o is None]}"
    return out  # type: ignore[return-value]
