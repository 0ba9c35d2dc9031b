"""Run per-rank executables as threads of this process over the in-process communicator.

The mechanism under the reference backend (:func:`backends.onnxruntime.run_reference`) and the
conformance backend: inputs are scattered by the bindings, each rank loops over its
micro-batches, outputs are gathered. A failure on any rank aborts the world (every waiting rank
wakes at once) and is raised as one :class:`RunFailed` naming the rank that failed on its own.
"""

from __future__ import annotations

import threading
from typing import Any, Mapping, Sequence

import numpy as np

from partitioner.bindings import Bindings, gather_outputs, scatter_inputs
from partitioner.errors import PartitionerError, RunFailed
from partitioner.runtime.comm_local import LocalWorld


def _first_line(exc: BaseException) -> str:
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


def run_in_threads(executables: Sequence[Any], bindings: Bindings, feeds: Mapping[str, np.ndarray], *,
                   timeout_s: float = 120.0) -> dict[str, np.ndarray]:
    """``executables[r].run(feeds, comm)`` for every rank r and micro-batch; the global outputs."""
    per_rank_in = scatter_inputs(bindings, feeds)
    world = LocalWorld(bindings.world_size, timeout_s=timeout_s)
    results: list[list[dict[str, np.ndarray]]] = [[] for _ in executables]
    errors: dict[int, BaseException] = {}

    def work(r: int) -> None:
        comm = world.communicator(r)
        try:
            for k in range(bindings.microbatches):
                results[r].append(executables[r].run(per_rank_in[r][k], comm))
        except BaseException as exc:  # any failure must wake the other ranks
            errors[r] = exc
            world.abort(f"rank {r} failed: {_first_line(exc)}")

    threads = [threading.Thread(target=work, args=(r,), name=f"rank{r}", daemon=True) for r in range(len(executables))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s + 5)
    if any(t.is_alive() for t in threads):
        world.abort("in-process run timed out")
        raise RunFailed(f"rank(s) {[i for i, t in enumerate(threads) if t.is_alive()]} did not finish "
                        f"within {timeout_s:.0f} s")
    if errors:
        # report the first rank that failed on its own (the others were woken by the abort)
        first = min(errors, key=lambda r: (isinstance(errors[r], RunFailed) and "aborted" in str(errors[r]), r))
        exc = errors[first]
        msg = _first_line(exc)
        if isinstance(exc, PartitionerError) and not isinstance(exc, RunFailed):
            raise RunFailed(f"rank {first}: {msg}") from exc
        raise RunFailed(msg if msg.startswith(f"rank {first}") else f"rank {first}: {msg}") from exc
    return gather_outputs(bindings, results)
