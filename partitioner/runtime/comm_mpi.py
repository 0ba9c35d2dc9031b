"""The MPI communicator (mpi4py): the :class:`partitioner.core.comm_ops.Communicator` of one MPI rank.

Rules:
1. Sub-communicators are created once, at start-up, for every group in the artifact's
   ``comm_groups`` (sorted), with ``COMM_WORLD.Split`` called by every rank in the same order, so
   creation can never deadlock. Within a group communicator, member ``group[i]`` has rank ``i``.
2. ``send`` is non-blocking (``Isend``); the request and its buffer stay alive until
   :meth:`MPICommunicator.flush` (end of a step) completes them, so a pipeline stage starts its
   next micro-batch while the previous one is in flight.
3. Every wait has a deadline (``timeout_s``, default 30 s or ``$PARTITIONER_COMM_TIMEOUT``):
   receives and collectives are non-blocking requests polled with ``Test``. A peer that died
   makes the wait fail with :class:`RunFailed` naming this rank, the peer or group, and the tag.
4. With ``deterministic=True`` (the default) reductions gather every member's contribution and
   reduce with :func:`reduce_arrays` in group order, so repeated runs are bit-identical and agree
   with the in-process communicator. ``deterministic=False`` uses MPI's own reductions.
5. Arrays are passed through the buffer protocol: contiguous inputs are sent without copies and
   results are received straight into freshly allocated numpy arrays, or, with
   :meth:`MPICommunicator.recv_into`, into the caller's buffer (the TVM backend passes its output
   tensor). No pickle: ``Broadcast`` sends a small int64 header (ndim, shape, dtype) before the data.
6. ``comm_s`` accumulates the seconds spent inside the comm ops (posting sends, waiting for
   receives and collectives; not ``flush``), for the worker's ``--profile``.
7. A deterministic AllReduce of at least ``SHM_MIN_BYTES`` over a group whose ranks all share one
   node goes through an MPI-3 shared-memory window (:class:`_ShmReducer`) instead of rule 4's
   gather: each rank copies its array into its slot, reduces its ``1/R`` of the elements over
   every slot in group order (the same additions as :func:`reduce_arrays`, so the result is
   bit-identical) and copies the reduced parts out; three barriers (with rule 3's deadline)
   separate the phases. For the gradient buckets of a training step (16-25 MiB) that is about
   half the time and CPU of the gather (the gather's transport copies every byte twice and the
   reduction copies and adds again; measured on 2 ranks of 2 cores: 16 MiB 16.5 -> 7.5 ms).
   Smaller arrays keep the gather (three barriers cost more than a small message). The window
   holds the largest array reduced so far (one slot per rank), kept for the communicator's
   life; ``$PARTITIONER_SHM_ALLREDUCE=0`` turns the path off.
8. :meth:`MPICommunicator.allreduce_list` reduces several arrays of one dtype (a data-parallel
   training step's gradient bucket, :mod:`partitioner.training.buckets`) as one collective: on
   rule 7's path each array is copied into the slot at its offset and its reduced elements are
   copied out into an array of its own shape, so the bucket is never concatenated or split (two
   weight-sized passes fewer per step; the same additions, so bit-identical to rule 7 on the
   concatenation); otherwise the arrays are concatenated and reduced as one (rule 4). With
   ``out`` the results are written into the caller's arrays (``out=xs``: in place, as TVM data
   ranks do, :mod:`partitioner.training.overlap` rule 7): on rule 7's path no array is
   allocated per call.
9. Waiting (:meth:`MPICommunicator._wait`): spin 100 us, yield the core until 10 ms, then sleep
   0.5 ms between polls, on every thread. With :data:`BACKGROUND_SLEEP_WAIT` (off by default;
   ``$PARTITIONER_COMM_BACKGROUND_SLEEP=1`` on) a background thread (a data rank's AllReduce
   thread, :mod:`partitioner.training.overlap` rule 4) spins ``BACKGROUND_SPIN_S`` only, then
   sleeps ``BACKGROUND_NAP_S`` between polls and never calls ``sched_yield``. It was meant to
   stop the waiting thread from taking the core from the backward computing beside it, but the
   yield loop does not: measured (session 12, 2 ranks data, resnet, load 5 on 2 cores) the comm
   thread's CPU while waiting is 6-11% of its wait time with either policy (ONNX Runtime, and
   TVM with two buckets), and two threads pinned to one core show the yielder using 0.7 ms of
   CPU over 32 ms of waits against 1.6-2.9 ms for the 100 us sleep-poll (a wake-up per nap).
   The knob stays, off, to measure it again on a quiet machine (docs/training.md).
10. Rule 7's own part: rank ``r`` alone reduces elements ``[lo, hi)`` (its ``1/R``), so it reads
    them from its input arrays instead of copying them into its slot first; only the other
    ``(R-1)/R`` of its input is copied in (for the members that reduce those parts), and the
    reduction writes ``[lo, hi)`` of its slot, from which every member copies it out as before.
    The additions and their order are unchanged (bit-identical); a rank's traffic per call goes
    from ``(5 + 1/R) n`` to ``(5 - 1/R) n`` bytes (copy in ``(R-1)/R n``: read and write;
    reduce ``n/R``: ``R`` reads and a write; copy out ``n``: read and write), i.e. a 45 MiB
    gradient bucket on 2 ranks copies 22.5 MiB in instead of 45 (the zoo resnet's TVM data
    rank, issue 16). For inputs of mixed dtypes (a cast on the way in) the whole input is
    copied in. :data:`SHM_OWN_PART_FROM_INPUT` (default on; ``$PARTITIONER_SHM_OWN_PART=0`` off).
11. Lent results (``allreduce_list(..., lend=True)``, :data:`SHM_LEND_RESULTS`): the reduced
    arrays are returned as views of the window's slots, not copied out, and the call's closing
    barrier moves to the start of the reducer's next call (every member has then finished
    reading the views). It is for the last gradient bucket of a data-parallel step, whose
    results the optimizer update reads once and drops before the next step
    (:mod:`partitioner.training.overlap` rule 10): the copy out (read ``n``, write ``n``) is
    gone, a rank's traffic per call becomes ``(3 - 1/R) n`` bytes with rule 10. For that the
    arrays start on :data:`SHM_ALIGN_BYTES` boundaries in the slot (TVM's kernels take aligned
    arguments as they lie, overlap rule 8) and the members' parts end on array boundaries (the
    nearest to ``k n / R``: a member may reduce up to one array more than its ``1/R``), so each
    result lies whole in one slot. A caller must not write a lent view nor keep it past its
    next call on the same group (ranks must all lend alike: every member barriers at that
    call's start). Default on; ``$PARTITIONER_SHM_LEND=0`` copies out as before.
12. Shared state (:meth:`MPICommunicator.shared_arrays`, for a data-parallel rank's sharded
    update, :mod:`partitioner.training.overlap` rule 11): a second window per group and key, held
    whole by the group's first member, in which every member sees the same arrays (each on a
    :data:`SHM_ALIGN_BYTES` boundary), allocated collectively at the first call with the same
    shapes on every member. :meth:`MPICommunicator.lent_owner` says which member reduced a lent
    result (whose slot it lies in), :meth:`MPICommunicator.node_barrier` is the group's window
    barrier (rule 3's deadline). The caller orders the writes: a member writes only the arrays
    it owns and barriers before anyone reads them.
"""

from __future__ import annotations

import functools
import os
import threading
import time
from typing import Any, Callable, Sequence, TypeVar

import numpy as np

from partitioner.core.comm_ops import reduce_arrays
from partitioner.core.errors import RunFailed
from partitioner.runtime.fault import FaultHook

TIMEOUT_ENV = "PARTITIONER_COMM_TIMEOUT"
DEFAULT_TIMEOUT_S = 30.0
_HEADER = 16  # int64 slots: [ndim, dtype code, dims...]
_MPI_OPS = ("sum", "max", "min", "prod")
SHM_ENV = "PARTITIONER_SHM_ALLREDUCE"
#: rule 7: arrays from this size reduce through shared memory (below it the gather is faster)
SHM_MIN_BYTES = 1 << 20
#: rule 10: a rank reduces its own part of the shared-memory AllReduce from its input instead of
#: copying it into its slot first (``$PARTITIONER_SHM_OWN_PART=0``: the whole input copied in)
SHM_OWN_PART_FROM_INPUT = os.environ.get("PARTITIONER_SHM_OWN_PART", "1") != "0"
#: rule 11: ``allreduce_list(..., lend=True)`` returns views of the window instead of copies
#: (``$PARTITIONER_SHM_LEND=0``: copied out as before)
SHM_LEND_RESULTS = os.environ.get("PARTITIONER_SHM_LEND", "1") != "0"
#: rule 11: where a lent result starts in its slot (TVM takes its arguments on 64-byte boundaries)
SHM_ALIGN_BYTES = 64
BACKGROUND_SLEEP_ENV = "PARTITIONER_COMM_BACKGROUND_SLEEP"
#: rule 9: a background thread's waits sleep-poll instead of yielding (off: measured no better;
#: 1 in the env: on)
BACKGROUND_SLEEP_WAIT = os.environ.get(BACKGROUND_SLEEP_ENV, "0") == "1"
#: rule 9: a background thread's spin before it sleeps, and its sleep between polls (seconds)
BACKGROUND_SPIN_S = 1e-5
BACKGROUND_NAP_S = 1e-4


def default_timeout() -> float:
    try:
        return float(os.environ.get(TIMEOUT_ENV, DEFAULT_TIMEOUT_S))
    except ValueError:
        return DEFAULT_TIMEOUT_S


_F = TypeVar("_F", bound=Callable[..., Any])


def _timed(fn: _F) -> _F:
    """Add the call's duration to ``self.comm_s``."""
    clock = time.perf_counter

    @functools.wraps(fn)
    def wrapper(self: MPICommunicator, *args: Any, **kw: Any) -> Any:
        t0 = clock()
        try:
            return fn(self, *args, **kw)
        finally:
            self.comm_s += clock() - t0

    return wrapper  # type: ignore[return-value]


def _dtype_code(dtype: np.dtype) -> int:
    return int.from_bytes(np.dtype(dtype).str.encode().ljust(8, b" "), "little")


def _code_dtype(code: int) -> np.dtype:
    return np.dtype(int(code).to_bytes(8, "little").decode().strip())


def _wait_policy() -> tuple[float, float, float]:
    """Rule 9, for the calling thread: seconds to spin, to yield the core until, and to sleep
    between polls after that. Spinning 100 us is as MPICH's blocking waits spin (a pipeline's
    next message is usually that close); yielding until 10 ms is fair when ranks oversubscribe
    cores. A background thread with :data:`BACKGROUND_SLEEP_WAIT` on never yields."""
    if BACKGROUND_SLEEP_WAIT and threading.current_thread() is not threading.main_thread():
        return BACKGROUND_SPIN_S, BACKGROUND_SPIN_S, BACKGROUND_NAP_S
    return 1e-4, 1e-2, 5e-4



class _SharedState:
    """Rule 12's methods of :class:`MPICommunicator` (over its ``_shm`` reducers and its
    :attr:`shared_windows`)."""

    MPI: Any
    rank: int
    _shm: dict[tuple[int, ...], _ShmReducer | None]

    @property
    def shared_windows(self) -> dict[tuple[tuple[int, ...], str], tuple[Any, list[np.ndarray]]]:
        """Rule 12's windows: ``(group, key)`` -> (the window, its arrays)."""
        return self.__dict__.setdefault("_shared_windows", {})

    def lent_owner(self, group: Sequence[int], x: np.ndarray) -> int | None:
        """The member whose window slot holds ``x`` (a result rule 11 lent), None when ``x`` is
        not in the group's window (copied, or the gather path)."""
        shm = self._shm.get(tuple(int(r) for r in group))
        if shm is None or not isinstance(x, np.ndarray):
            return None
        return next((k for k, m in enumerate(shm.slots) if np.may_share_memory(x, np.frombuffer(m, np.uint8))), None)

    def shared_arrays(self, group: Sequence[int], key: str, like: Sequence[np.ndarray]) -> list[np.ndarray]:
        """Rule 12: arrays shaped like ``like`` that every member of ``group`` sees alike (the
        group's reducer must exist: call after a lent AllReduce); collective at the first call
        per ``(group, key)``, the same list afterwards."""
        g = tuple(int(r) for r in group)
        if (g, key) not in self.shared_windows:
            node = self._shm[g].node
            offsets, end = [], 0
            for x in like:
                offsets.append(end)
                end += -(-x.nbytes // SHM_ALIGN_BYTES) * SHM_ALIGN_BYTES
            win = self.MPI.Win.Allocate_shared(end + SHM_ALIGN_BYTES if node.Get_rank() == 0 else 0, 1, comm=node)
            raw = np.frombuffer(win.Shared_query(0)[0], np.uint8)
            base = -raw.ctypes.data % SHM_ALIGN_BYTES
            views = [raw[base + o:base + o + x.nbytes].view(x.dtype).reshape(x.shape) for o, x in zip(offsets, like)]
            self.shared_windows[(g, key)] = (win, views)
        return self.shared_windows[(g, key)][1]

    def node_barrier(self, group: Sequence[int], what: str = "shared-state barrier") -> None:
        """Rule 12: a barrier of ``group``'s window communicator."""
        self._shm[tuple(int(r) for r in group)]._barrier(what)


class MPICommunicator(_SharedState):
    """One rank's communicator over ``comm`` (default ``MPI.COMM_WORLD``)."""
    lends_results = True  # rule 11: ``allreduce_list`` takes ``lend=True``

    def __init__(self, groups: Sequence[Sequence[int]] = (), *, comm: Any = None, timeout_s: float | None = None,
                 deterministic: bool = True, fault: FaultHook | None = None) -> None:
        from mpi4py import MPI

        self.MPI = MPI
        self.world = comm if comm is not None else MPI.COMM_WORLD
        self.rank = self.world.Get_rank()
        self.world_size = self.world.Get_size()
        self.timeout_s = default_timeout() if timeout_s is None else float(timeout_s)
        self.deterministic = deterministic
        self.fault = fault or FaultHook(None, self.rank)
        self.current_op = "start-up"
        self._pending: list[tuple[Any, np.ndarray, str]] = []
        self._groups: dict[tuple[int, ...], Any] = {}
        self.bytes_sent = 0
        self.comm_s = 0.0
        self._shm: dict[tuple[int, ...], _ShmReducer | None] = {}  # rule 7, per group (None: not one node)
        self.use_shm = os.environ.get(SHM_ENV, "1") != "0"
        for g in groups:
            self._create_group(tuple(int(r) for r in g))
        # a private duplicate for the runtime's own traffic (outputs to rank 0), apart from program tags
        self.control = self.world.Dup()

    # set-up -------------------------------------------------------------------------------------
    def _create_group(self, group: tuple[int, ...]) -> None:
        if group in self._groups or any(not 0 <= r < self.world_size for r in group):
            if group not in self._groups:
                raise RunFailed(f"rank {self.rank}: comm group {list(group)} names ranks outside the "
                                f"world of {self.world_size}")
            return
        member = self.rank in group
        sub = self.world.Split(0 if member else self.MPI.UNDEFINED, group.index(self.rank) if member else 0)
        if member:
            self._groups[group] = sub

    def group_comm(self, group: Sequence[int], tag: int) -> Any:
        g = tuple(int(r) for r in group)
        sub = self._groups.get(g)
        if sub is None:
            if self.rank not in g:
                raise RunFailed(f"rank {self.rank}: not a member of collective group {list(g)} (tag {tag})")
            raise RunFailed(f"rank {self.rank}: collective group {list(g)} (tag {tag}) was not created at start-up; "
                            "the artifact's comm_groups is incomplete")
        return sub

    # waiting ------------------------------------------------------------------------------------
    def _wait(self, req: Any, what: str, status: Any = None, timeout_s: float | None = None) -> None:
        """Poll ``req`` until done or the deadline (``timeout_s``, default the communicator's), as
        :func:`_wait_policy` says (rule 9): spin, yield the core, then sleep between polls."""
        if req.Test(status):  # the common case on a busy pipeline: already there
            return
        spin, yield_until, nap = _wait_policy()
        clock = time.perf_counter
        start = clock()
        deadline = start + (limit := self.timeout_s if timeout_s is None else timeout_s)
        while not req.Test(status):
            now = clock()
            waited = now - start
            if waited < spin:
                continue
            if waited < yield_until:
                os.sched_yield()
                continue
            if now > deadline:
                try:
                    req.Cancel()
                except Exception:  # noqa: BLE001 - cancel is best effort; we are failing anyway
                    pass
                raise RunFailed(f"{what}: timed out after {limit:g} s (a peer failed or is stuck; "
                                f"raise ${TIMEOUT_ENV} for slow steps)")
            time.sleep(nap)

    def _enter(self, op: str, detail: str) -> str:
        self.current_op = f"{op} {detail}"
        self.fault.maybe_fail(op)
        return self.current_op

    # point-to-point -----------------------------------------------------------------------------
    @_timed
    def send(self, x: np.ndarray, peer: int, tag: int) -> None:
        what = self._enter("send", f"to rank {peer} tag {tag}")
        buf = np.asarray(x, order="C")
        self._pending.append((self.world.Isend(buf, dest=peer, tag=tag), buf, what))
        self.bytes_sent += buf.nbytes
        self._reap()  # also drives MPI progress on the earlier sends (a few Test calls, ~1 us)

    def recv(self, peer: int, tag: int, shape: Sequence[int], dtype: np.dtype) -> np.ndarray:
        out = np.empty(tuple(int(d) for d in shape), dtype=dtype)
        self.recv_into(peer, tag, out)
        return out

    @_timed
    def recv_into(self, peer: int, tag: int, out: np.ndarray) -> None:
        """Receive from ``peer`` straight into ``out`` (C-contiguous, the expected shape and dtype)."""
        what = self._enter("recv", f"from rank {peer} tag {tag}")
        status = self.MPI.Status()
        try:
            self._wait(self.world.Irecv(out, source=peer, tag=tag), what, status)
        except self.MPI.Exception as exc:  # e.g. MPI_ERR_TRUNCATE: the message is larger than expected
            raise RunFailed(f"{what}: expected {out.dtype}{list(out.shape)} ({out.nbytes} bytes): "
                            f"{str(exc).splitlines()[0]}") from None
        nbytes = status.Get_count(self.MPI.BYTE)
        if nbytes != out.nbytes:
            raise RunFailed(f"{what}: expected {out.dtype}{list(out.shape)} ({out.nbytes} bytes), got {nbytes} bytes")

    def _reap(self) -> None:
        self._pending = [p for p in self._pending if not p[0].Test()]

    def flush(self) -> None:
        """Complete every outstanding send (end of a step)."""
        for req, _buf, what in self._pending:
            self.current_op = what
            self._wait(req, what)
        self._pending.clear()

    # collectives --------------------------------------------------------------------------------
    def _gather_all(self, x: np.ndarray, sub: Any, what: str) -> np.ndarray:
        x = np.asarray(x, order="C")
        out = np.empty((sub.Get_size(),) + x.shape, dtype=x.dtype)
        self._wait(sub.Iallgather(x, out), what)
        return out

    @_timed
    def allreduce(self, x: np.ndarray, group: Sequence[int], reduction: str, tag: int) -> np.ndarray:
        what = self._enter("allreduce", f"on group {list(group)} tag {tag}")
        return self._allreduce(x, group, self.group_comm(group, tag), reduction, what)

    def _allreduce(self, x: np.ndarray, group: Sequence[int], sub: Any, reduction: str, what: str) -> np.ndarray:
        if self.deterministic:
            shm = self._shm_reducer(group, sub, x)
            if shm is not None:
                return shm.allreduce(np.asarray(x), reduction, what)
            return reduce_arrays(list(self._gather_all(x, sub, what)), reduction)
        x = np.asarray(x, order="C")
        out = np.empty_like(x)
        op = {"sum": self.MPI.SUM, "max": self.MPI.MAX, "min": self.MPI.MIN, "prod": self.MPI.PROD}[reduction]
        self._wait(sub.Iallreduce(x, out, op=op), what)
        return out

    @_timed
    def allreduce_list(self, xs: Sequence[np.ndarray], group: Sequence[int], reduction: str,
                       tag: int, out: Sequence[np.ndarray] | None = None, lend: bool = False) -> list[np.ndarray]:
        """Rule 8: several arrays of one dtype AllReduced as one collective, each result shaped
        like its input (in ``out[k]`` when given; ``out=xs`` reduces in place; ``lend``: rule 11)."""
        what = self._enter("allreduce", f"of {len(xs)} arrays on group {list(group)} tag {tag}")
        sub = self.group_comm(group, tag)
        xs = [np.asarray(x) for x in xs]
        shm = self._shm_reducer(group, sub, sum(x.nbytes for x in xs)) if self.deterministic else None
        if shm is not None and len({x.dtype for x in xs}) == 1:
            return shm.allreduce_list(xs, reduction, what, out, lend=lend and SHM_LEND_RESULTS)
        flat = self._allreduce(np.concatenate([np.reshape(x, -1) for x in xs]), group, sub, reduction, what)
        return _split_like(flat, xs, out)

    def _shm_reducer(self, group: Sequence[int], sub: Any, x: Any) -> _ShmReducer | None:
        """Rule 7's reducer of ``group`` when ``x`` (an array or a byte count) qualifies (every
        member decides alike: the same size on every rank, the same environment), else None."""
        nbytes = int(x) if isinstance(x, int) else int(getattr(x, "nbytes", 0))
        if not self.use_shm or nbytes < SHM_MIN_BYTES or sub.Get_size() < 2:
            return None
        key = tuple(int(r) for r in group)
        if key not in self._shm:  # collective over the group, at its first large AllReduce
            node = sub.Split_type(self.MPI.COMM_TYPE_SHARED)
            self._shm[key] = _ShmReducer(self, node) if node.Get_size() == sub.Get_size() else None
        return self._shm[key]

    @_timed
    def allgather(self, x: np.ndarray, group: Sequence[int], axis: int, tag: int) -> np.ndarray:
        what = self._enter("allgather", f"on group {list(group)} tag {tag}")
        stacked = self._gather_all(x, self.group_comm(group, tag), what)
        if axis == 0 or axis == -x.ndim:
            return stacked.reshape((-1,) + stacked.shape[2:])  # a view: no copy
        return np.concatenate(list(stacked), axis=axis)

    def _alltoall_chunks(self, x: np.ndarray, n: int, split_axis: int, sub: Any, what: str) -> np.ndarray:
        chunks = np.split(x, n, axis=split_axis)
        send = np.asarray(np.stack(chunks), order="C") if split_axis not in (0, -x.ndim) else \
            np.asarray(x, order="C").reshape((n,) + chunks[0].shape)
        recv = np.empty_like(send)
        self._wait(sub.Ialltoall(send, recv), what)
        return recv

    @_timed
    def reduce_scatter(self, x: np.ndarray, group: Sequence[int], axis: int, reduction: str, tag: int) -> np.ndarray:
        what = self._enter("reduce_scatter", f"on group {list(group)} tag {tag}")
        sub = self.group_comm(group, tag)
        n = len(group)
        if x.shape[axis] % n:
            raise RunFailed(f"{what}: axis {axis} of size {x.shape[axis]} does not split into {n} chunks")
        parts = self._alltoall_chunks(x, n, axis, sub, what)  # parts[j] = member j's chunk for me
        return reduce_arrays(list(parts), reduction)

    @_timed
    def alltoall(self, x: np.ndarray, group: Sequence[int], split_axis: int, concat_axis: int, tag: int) -> np.ndarray:
        what = self._enter("alltoall", f"on group {list(group)} tag {tag}")
        sub = self.group_comm(group, tag)
        n = len(group)
        if x.shape[split_axis] % n:
            raise RunFailed(f"{what}: axis {split_axis} of size {x.shape[split_axis]} does not split into {n} chunks")
        parts = self._alltoall_chunks(x, n, split_axis, sub, what)
        return np.asarray(np.concatenate(list(parts), axis=concat_axis), order="C")

    @_timed
    def broadcast(self, x: np.ndarray | None, group: Sequence[int], root: int, tag: int) -> np.ndarray:
        what = self._enter("broadcast", f"from rank {root} on group {list(group)} tag {tag}")
        sub = self.group_comm(group, tag)
        r = list(group).index(root)
        header = np.zeros(_HEADER, dtype=np.int64)
        if self.rank == root:
            if x is None:
                raise RunFailed(f"{what}: the root has no input to broadcast")
            x = np.asarray(x, order="C")
            if x.ndim > _HEADER - 2:
                raise RunFailed(f"{what}: {x.ndim}-d tensors are not supported (at most {_HEADER - 2})")
            header[0], header[1] = x.ndim, _dtype_code(x.dtype)
            header[2:2 + x.ndim] = x.shape
        self._wait(sub.Ibcast(header, root=r), what)
        if self.rank == root:
            out = np.array(x, copy=True)
        else:
            out = np.empty(tuple(int(d) for d in header[2:2 + int(header[0])]), dtype=_code_dtype(int(header[1])))
        self._wait(sub.Ibcast(out, root=r), what)
        return out

    # the runtime's own traffic: whole arrays of unknown shape to one rank ----------------------------
    def send_array(self, x: np.ndarray, dest: int, tag: int) -> None:
        x = np.asarray(x, order="C")
        header = np.zeros(_HEADER, dtype=np.int64)
        header[0], header[1] = x.ndim, _dtype_code(x.dtype)
        header[2:2 + x.ndim] = x.shape
        what = f"sending outputs to rank {dest}"
        self._wait(self.control.Isend(header, dest=dest, tag=tag), what)
        self._wait(self.control.Isend(x, dest=dest, tag=tag), what)

    def recv_array(self, source: int, tag: int) -> np.ndarray:
        header = np.zeros(_HEADER, dtype=np.int64)
        what = f"receiving outputs from rank {source}"
        self._wait(self.control.Irecv(header, source=source, tag=tag), what)
        out = np.empty(tuple(int(d) for d in header[2:2 + int(header[0])]), dtype=_code_dtype(int(header[1])))
        self._wait(self.control.Irecv(out, source=source, tag=tag), what)
        return out

    def barrier(self, timeout_s: float | None = None, what: str = "barrier") -> None:  # None: rule 3
        self._wait(self.control.Ibarrier(), what, timeout_s=timeout_s)

    def abort(self, code: int = 1) -> None:
        self.world.Abort(code)


def _split_like(flat: np.ndarray, xs: Sequence[np.ndarray], out: Sequence[np.ndarray] | None) -> list[np.ndarray]:
    """Rule 8 off the shared window: the reduced concatenation ``flat`` cut back into arrays
    shaped like ``xs``, copied into ``out[k]`` when given."""
    res = [p.reshape(np.shape(x)) for p, x in zip(np.split(flat, np.cumsum([np.size(x) for x in xs])[:-1]), xs)]
    if out is None:
        return res
    for o, r in zip(out, res):
        np.copyto(o, r)
    return list(out)


class _ShmReducer:
    """Rule 7: the AllReduce of one group whose ranks share a node, through a shared window."""

    def __init__(self, owner: MPICommunicator, node: Any) -> None:
        self.owner, self.node = owner, node
        self.rank, self.size = node.Get_rank(), node.Get_size()
        self.win: Any = None
        self.capacity = 0
        self.slots: list[memoryview] = []
        self.calls = 0  # AllReduces run through the window (the tests read it)
        self.lent = False  # rule 11: the last call's results are views of the slots, still read

    def _reserve(self, nbytes: int) -> None:
        """Grow the window to ``nbytes`` per slot (collective: every member reduces the same
        sizes in the same order); each slot starts on a :data:`SHM_ALIGN_BYTES` boundary."""
        if nbytes <= self.capacity:
            return
        if self.win is not None:
            self.win.Free()
        nbytes = -(-nbytes // 4096) * 4096
        self.win = self.owner.MPI.Win.Allocate_shared(nbytes, 1, comm=self.node)
        self.capacity = nbytes
        self.slots = [self.win.Shared_query(k)[0] for k in range(self.size)]

    def _barrier(self, what: str) -> None:
        self.owner._wait(self.node.Ibarrier(), what)

    def allreduce(self, x: np.ndarray, reduction: str, what: str) -> np.ndarray:
        return self.allreduce_list([x], reduction, what)[0]

    def _layout(self, xs: Sequence[np.ndarray], itemsize: int, lend: bool) -> tuple[list[int], list[int], int, list[int]]:
        """Each array's start and end in the slot, the slot's element count and the members'
        part bounds. Rule 11 (``lend``): every array starts on a :data:`SHM_ALIGN_BYTES` boundary
        and the parts end on array boundaries (the one nearest ``k n / R``), so each reduced
        array lies whole in one member's slot."""
        sizes = [int(np.size(x)) for x in xs]
        step = max(1, SHM_ALIGN_BYTES // itemsize) if lend else 1
        starts = [0]
        for size in sizes[:-1]:
            starts.append(starts[-1] + -(-size // step) * step)
        ends = [a + size for a, size in zip(starts, sizes)]
        n = ends[-1] if ends else 0
        if not lend:
            return starts, ends, n, [k * n // self.size for k in range(self.size + 1)]
        cuts = sorted(set(starts) | {n})
        bounds = [0] + [min(cuts, key=lambda c: abs(c - k * n / self.size)) for k in range(1, self.size)] + [n]
        return starts, ends, n, [max(bounds[:k + 1]) for k in range(self.size + 1)]

    def allreduce_list(self, xs: Sequence[np.ndarray], reduction: str, what: str,
                       out: Sequence[np.ndarray] | None = None, lend: bool = False) -> list[np.ndarray]:
        """Rule 7 over the arrays ``xs`` (one dtype) laid end to end in the slot (rule 8): each is
        copied in from where it lies and its reduced elements out into an array of its shape
        (``out[k]`` when given: every input is in the slot before anything is copied out, so
        ``out`` may be ``xs``). ``lend`` (rule 11): no copy out; the results are views of the
        slots, to be read (not written, not kept) until this reducer's next call."""
        if self.lent:  # rule 11: every member is done reading the views the previous call lent
            self._barrier(what)
            self.lent = False
        self.calls += 1
        dtype = np.result_type(*xs)
        starts, ends, n, bounds = self._layout(xs, dtype.itemsize, lend)
        self._reserve(n * dtype.itemsize)
        slots = [np.frombuffer(m, dtype=dtype, count=n) for m in self.slots]
        fn = {"sum": np.add, "max": np.maximum, "min": np.minimum, "prod": np.multiply}[reduction]
        mine = slots[self.rank]
        lo, hi = bounds[self.rank], bounds[self.rank + 1]
        flats = [np.reshape(x, -1) for x in xs]
        # rule 10: the part [lo, hi) only this rank reduces is read from the inputs, not copied in
        direct = SHM_OWN_PART_FROM_INPUT and hi > lo and all(f.dtype == dtype for f in flats)
        # the last barrier of the previous call guarantees no member still reads this slot
        for flat, a, b in zip(flats, starts, ends):
            for ka, kb in ((a, min(b, lo)), (max(a, hi), b)) if direct else ((a, b),):
                if ka < kb:
                    np.copyto(mine[ka:kb], flat[ka - a:kb - a])
        self._barrier(what)
        for flat, a, b in zip(flats, starts, ends):
            ka, kb = max(a, lo), min(b, hi)
            if ka < kb:  # reduce_arrays' order (slot 0, then + slot 1, ...): bit-identical to the gather
                src = [flat[ka - a:kb - a] if k == self.rank and direct else slots[k][ka:kb]
                       for k in range(self.size)]
                part = mine[ka:kb]  # only this rank reads [lo, hi) of its own slot: written in place
                fn(src[0], src[1], out=part)
                for k in range(2, self.size):
                    fn(part, src[k], out=part)
        self._barrier(what)
        if lend:
            self.lent = True
            owner = [next((k for k in range(self.size) if bounds[k] <= a < bounds[k + 1]), 0) for a in starts]
            return [slots[k][a:b].reshape(np.shape(x)) for x, k, a, b in zip(xs, owner, starts, ends)]
        outs = [np.empty(np.shape(x), dtype=dtype) for x in xs] if out is None else list(out)
        if any(not (o.flags.c_contiguous and o.flags.writeable) or o.size != x.size for o, x in zip(outs, xs)):
            raise RunFailed(f"{what}: every output array must be writable, C-contiguous and the size of its input")
        for o, a, b in zip(outs, starts, ends):
            flat = o.reshape(-1)  # a view: ``o`` is C-contiguous (fresh, or the caller's)
            for k in range(self.size):  # the reduced elements of [a, b) lie in the slots of their owners
                ka, kb = max(a, bounds[k]), min(b, bounds[k + 1])
                if ka < kb:
                    flat[ka - a:kb - a] = slots[k][ka:kb]
        self._barrier(what)  # every member has its copy: the slots may be written again
        return outs

