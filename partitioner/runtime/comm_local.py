"""In-process communicator: one thread per rank, numpy queues and rendezvous collectives.

This is the oracle the reference backend and the in-process TVM runner use to prove a plan
right without MPI. Every wait has a timeout, and a failure on any rank (``LocalWorld.abort``)
wakes every other rank at once, so nothing hangs.
"""

from __future__ import annotations

import threading
from collections import defaultdict, deque
from typing import Any, Sequence

import numpy as np

from partitioner.core.comm_ops import reduce_arrays
from partitioner.core.errors import RunFailed

DEFAULT_TIMEOUT_S = 120.0


class LocalWorld:
    """Shared state of ``world_size`` in-process ranks."""

    def __init__(self, world_size: int, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self.world_size = world_size
        self.timeout_s = timeout_s
        self._cv = threading.Condition()
        self._mail: dict[tuple[int, int, int], deque[np.ndarray]] = defaultdict(deque)
        # (group, tag, call index) -> {rank: contribution}
        self._slots: dict[tuple[tuple[int, ...], int, int], dict[int, Any]] = {}
        self._taken: dict[tuple[tuple[int, ...], int, int], int] = defaultdict(int)
        self._calls: dict[tuple[int, tuple[int, ...], int], int] = defaultdict(int)
        self._error: str | None = None
        self.bytes_sent = 0

    def communicator(self, rank: int) -> LocalCommunicator:
        return LocalCommunicator(self, rank)

    def abort(self, message: str) -> None:
        with self._cv:
            if self._error is None:
                self._error = message
            self._cv.notify_all()

    def _wait(self, ready, what: str, rank: int) -> None:
        if not self._cv.wait_for(lambda: self._error is not None or ready(), timeout=self.timeout_s):
            self._error = self._error or f"rank {rank}: timed out after {self.timeout_s:.0f} s waiting for {what}"
            self._cv.notify_all()
        if self._error is not None:
            raise RunFailed(f"rank {rank}: aborted while waiting for {what} ({self._error})")

    # point-to-point ---------------------------------------------------------------------------
    def send(self, src: int, dst: int, tag: int, x: np.ndarray) -> None:
        with self._cv:
            self._mail[(src, dst, tag)].append(np.array(x, copy=True))
            self.bytes_sent += x.nbytes
            self._cv.notify_all()

    def recv(self, src: int, dst: int, tag: int) -> np.ndarray:
        key = (src, dst, tag)
        with self._cv:
            self._wait(lambda: bool(self._mail[key]), f"Recv from rank {src} tag {tag}", dst)
            return self._mail[key].popleft()

    # collectives: every member deposits, waits for all, reads all contributions ---------------
    def exchange(self, rank: int, group: Sequence[int], tag: int, value: Any) -> list[Any]:
        g = tuple(int(r) for r in group)
        if rank not in g:
            raise RunFailed(f"rank {rank}: not a member of collective group {list(g)} (tag {tag})")
        with self._cv:
            idx = self._calls[(rank, g, tag)]
            self._calls[(rank, g, tag)] += 1
            key = (g, tag, idx)
            slot = self._slots.setdefault(key, {})
            slot[rank] = value
            self._cv.notify_all()
            self._wait(lambda: len(slot) == len(g), f"collective on group {list(g)} tag {tag}", rank)
            values = [slot[r] for r in g]
            self._taken[key] += 1
            if self._taken[key] == len(g):
                del self._slots[key], self._taken[key]
            return values


class LocalCommunicator:
    """The :class:`partitioner.core.comm_ops.Communicator` of one in-process rank."""

    def __init__(self, world: LocalWorld, rank: int) -> None:
        self.world = world
        self.rank = rank
        self.world_size = world.world_size

    def send(self, x: np.ndarray, peer: int, tag: int) -> None:
        self.world.send(self.rank, peer, tag, x)

    def recv(self, peer: int, tag: int, shape: Sequence[int], dtype: np.dtype) -> np.ndarray:
        y = self.world.recv(peer, self.rank, tag)
        if tuple(y.shape) != tuple(shape) or y.dtype != np.dtype(dtype):
            raise RunFailed(
                f"rank {self.rank}: Recv from rank {peer} tag {tag} expected {np.dtype(dtype)}{list(shape)}, "
                f"got {y.dtype}{list(y.shape)}"
            )
        return y

    def allreduce(self, x: np.ndarray, group: Sequence[int], reduction: str, tag: int) -> np.ndarray:
        return reduce_arrays(self.world.exchange(self.rank, group, tag, x), reduction)

    def allgather(self, x: np.ndarray, group: Sequence[int], axis: int, tag: int) -> np.ndarray:
        return np.concatenate(self.world.exchange(self.rank, group, tag, x), axis=axis)

    def reduce_scatter(self, x: np.ndarray, group: Sequence[int], axis: int, reduction: str, tag: int) -> np.ndarray:
        total = reduce_arrays(self.world.exchange(self.rank, group, tag, x), reduction)
        chunks = np.split(total, len(group), axis=axis)
        return np.asarray(chunks[list(group).index(self.rank)], order="C")

    def alltoall(self, x: np.ndarray, group: Sequence[int], split_axis: int, concat_axis: int, tag: int) -> np.ndarray:
        parts = self.world.exchange(self.rank, group, tag, np.split(x, len(group), axis=split_axis))
        me = list(group).index(self.rank)
        return np.asarray(np.concatenate([p[me] for p in parts], axis=concat_axis), order="C")

    def broadcast(self, x: np.ndarray | None, group: Sequence[int], root: int, tag: int) -> np.ndarray:
        values = self.world.exchange(self.rank, group, tag, x if self.rank == root else None)
        return np.array(values[list(group).index(root)], copy=True)
