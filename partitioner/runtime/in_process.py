"""The one in-process rank runner: every rank a thread of this process, over the in-process
communicator (:class:`partitioner.runtime.comm_local.LocalWorld`), no MPI.

Users: :func:`run_reference` (the ONNX Runtime oracle that proves a lowered plan right),
:func:`run_in_threads` (any per-rank executables, e.g. the conformance backend) and
:func:`partitioner.runtime.launch.run_in_process` (``partitioner run --in-process``).

Rules:
1. :func:`run_ranks` is the mechanism: ``step(rank, comm)`` runs on its own thread per rank; a
   failure on any rank aborts the world (every waiting rank wakes at once), so no thread waits
   forever. It returns the per-rank results and the per-rank exceptions in the order they
   happened; each caller reports them in its own words.
2. :func:`run_in_threads` raises one :class:`RunFailed` naming the rank that failed on its own
   (the others were woken by the abort).
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from partitioner.core.bindings import Bindings, gather_outputs, scatter_inputs
from partitioner.core.errors import PartitionerError, RunFailed
from partitioner.runtime.comm_local import LocalWorld


def _first_line(exc: BaseException) -> str:
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


def run_ranks(world: LocalWorld, step: Callable[[int, Any], Any], *,
              join_timeout_s: float | None = None) -> tuple[list[Any], dict[int, BaseException], list[int]]:
    """Rule 1: run ``step(rank, world.communicator(rank))`` for every rank on its own thread.
    Returns (results per rank, exceptions by rank in the order they happened, ranks still running
    after ``join_timeout_s``)."""
    n = world.world_size
    results: list[Any] = [None] * n
    errors: dict[int, BaseException] = {}

    def work(r: int) -> None:
        try:
            results[r] = step(r, world.communicator(r))
        except BaseException as exc:  # any failure must wake the other ranks
            errors[r] = exc
            world.abort(f"rank {r} failed: {_first_line(exc)}")

    threads = [threading.Thread(target=work, args=(r,), name=f"rank{r}", daemon=True) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(join_timeout_s)
    return results, errors, [i for i, t in enumerate(threads) if t.is_alive()]


def run_in_threads(executables: Sequence[Any], bindings: Bindings, feeds: Mapping[str, np.ndarray], *,
                   timeout_s: float = 120.0) -> dict[str, np.ndarray]:
    """``executables[r].run(feeds, comm)`` for every rank r and micro-batch; the global outputs."""
    per_rank_in = scatter_inputs(bindings, feeds)
    world = LocalWorld(bindings.world_size, timeout_s=timeout_s)

    def step(r: int, comm: Any) -> list[dict[str, np.ndarray]]:
        return [executables[r].run(per_rank_in[r][k], comm) for k in range(bindings.microbatches)]

    results, errors, alive = run_ranks(world, step, join_timeout_s=timeout_s + 5)
    if alive:
        world.abort("in-process run timed out")
        raise RunFailed(f"rank(s) {alive} did not finish within {timeout_s:.0f} s")
    if errors:
        # report the first rank that failed on its own (the others were woken by the abort)
        first = min(errors, key=lambda r: (isinstance(errors[r], RunFailed) and "aborted" in str(errors[r]), r))
        exc = errors[first]
        msg = _first_line(exc)
        if isinstance(exc, PartitionerError) and not isinstance(exc, RunFailed):
            raise RunFailed(f"rank {first}: {msg}") from exc
        raise RunFailed(msg if msg.startswith(f"rank {first}") else f"rank {first}: {msg}") from exc
    return gather_outputs(bindings, results)


def run_reference(programs: Sequence[Any], bindings: Bindings, feeds: Mapping[str, np.ndarray], *,
                  timeout_s: float = 120.0, threads: int = 1) -> dict[str, np.ndarray]:
    """Run every rank's program with the ONNX Runtime backend in this process and return the
    global outputs: the oracle that proves a plan right without MPI."""
    from backends.onnxruntime import load

    return run_in_threads([load(p, threads=threads) for p in programs], bindings, feeds, timeout_s=timeout_s)
