"""Comm ops on GPU buffers: the NCCL fast path, and the choice between it and staging via MPI.

Two ways to run a comm op whose tensors live on a GPU (see ``backends/tvm/device_comm.py`` for
the call site):

1. **Staged** (the baseline, always correct): copy device -> host, run the op with the MPI
   communicator on numpy arrays (the CPU path, bit-identical results), copy host -> device.
2. **NCCL** (the fast path): ``libnccl.so.2`` from the ``nvidia-nccl-cu12`` wheel, loaded with
   ctypes, runs the collective on the device pointers, on the default CUDA stream, which TVM's
   kernels also use, so kernel -> collective -> kernel order holds without host syncs.

Selection (:func:`select_device_comm`), from ``PARTITIONER_GPU_COMM``: ``mpi`` forces staging;
``nccl`` requires NCCL (an error when it cannot load); ``auto`` (default) uses NCCL when the run
is on a GPU and libnccl loads, staging otherwise.

Bootstrap (as NCCL's own MPI examples do): for each communicator, the group's first member calls
``ncclGetUniqueId``, the 128-byte id is broadcast over the group's MPI communicator, and every
member calls ``ncclCommInitRank`` with its index in the group. Communicators are created at load
time for every collective group of the manifest, in the manifest's global order, on every rank
(the order MPI's groups are created in too), so no rank waits on a group another rank has not
reached yet.

What runs on NCCL, and why the rest stays staged:
- ``AllReduce`` (sum/prod/max/min), ``Broadcast``;
- ``AllGather`` and ``ReduceScatter`` when every dimension before ``axis`` is 1 (NCCL concatenates
  and splits flat buffers, which equals a split along ``axis`` only then);
- ``Send``/``Recv`` and ``AllToAll`` stay staged: the lowering's deadlock check assumes MPI's
  non-blocking send (rank programs may both send before they receive); an NCCL send on the
  stream waits for its receive and could deadlock such a pair.
NCCL's sums are reproducible run to run for one configuration, but not bit-identical to the
staged path's rank-order sums; ``PARTITIONER_GPU_COMM=mpi`` gives those.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from partitioner.core.errors import BackendError, RunFailed

ENV = "PARTITIONER_GPU_COMM"
CHOICES = ("auto", "nccl", "mpi")

# ncclDataType_t and ncclRedOp_t (nccl.h)
NCCL_DTYPES = {np.dtype(np.int8): 0, np.dtype(np.uint8): 1, np.dtype(np.int32): 2, np.dtype(np.uint32): 3,
               np.dtype(np.int64): 4, np.dtype(np.uint64): 5, np.dtype(np.float16): 6,
               np.dtype(np.float32): 7, np.dtype(np.float64): 8}
NCCL_BFLOAT16 = 9
NCCL_OPS = {"sum": 0, "prod": 1, "max": 2, "min": 3}
NCCL_OPS_ON_DEVICE = ("AllReduce", "AllGather", "ReduceScatter", "Broadcast")


class NcclUniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_char * 128)]


def nccl_library_path() -> Path | None:
    """``libnccl.so.2`` of the ``nvidia-nccl-cu12`` wheel, or None when it is not installed."""
    try:
        import nvidia.nccl as pkg
    except ImportError:
        return None
    for root in getattr(pkg, "__path__", []):
        p = Path(root) / "lib" / "libnccl.so.2"
        if p.is_file():
            return p
    return None


_LIB: ctypes.CDLL | None = None


def load_nccl() -> ctypes.CDLL:
    """The NCCL library (loaded once); BackendError naming the wheel when it cannot load."""
    global _LIB
    if _LIB is not None:
        return _LIB
    path = nccl_library_path()
    candidates = [str(path)] if path is not None else []
    candidates.append("libnccl.so.2")  # a system NCCL
    for c in candidates:
        try:
            lib = ctypes.CDLL(c)
        except OSError:
            continue
        lib.ncclGetErrorString.restype = ctypes.c_char_p
        lib.ncclCommInitRank.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, NcclUniqueId, ctypes.c_int]
        _LIB = lib
        return lib
    raise BackendError("NCCL is not available (libnccl.so.2 not found); install it with pip install .[cuda] "
                       f"(nvidia-nccl-cu12) or set {ENV}=mpi")


def nccl_version() -> int | None:
    """NCCL's version code (e.g. 23203 for 2.32.3), or None when the library does not load."""
    try:
        lib = load_nccl()
    except BackendError:
        return None
    v = ctypes.c_int(0)
    return v.value if lib.ncclGetVersion(ctypes.byref(v)) == 0 else None


def select_device_comm(on_gpu: bool, env: dict[str, str] | None = None) -> tuple[str, str]:
    """``("nccl" | "staged", why)`` for a rank whose tensors are on a GPU (``on_gpu``) or not."""
    choice = (env if env is not None else os.environ).get(ENV, "auto").strip().lower() or "auto"
    if choice not in CHOICES:
        raise BackendError(f"{ENV}={choice!r}: use one of {', '.join(CHOICES)}")
    if not on_gpu:
        return "staged", "the tensors are in host memory"
    if choice == "mpi":
        return "staged", f"{ENV}=mpi"
    version = nccl_version()
    if version is None:
        if choice == "nccl":
            load_nccl()  # raises the one-line error
        return "staged", "NCCL is not installed"
    return "nccl", f"NCCL {version}"


def nccl_runs(op: Any, shape: Sequence[int], dtype: np.dtype | str) -> bool:
    """Whether :class:`NcclCommunicator` runs ``op`` on device buffers (see the module docstring)."""
    if op.op_type not in NCCL_OPS_ON_DEVICE:
        return False
    if str(dtype) != "bfloat16" and np.dtype(dtype) not in NCCL_DTYPES:
        return False
    if op.op_type in ("AllReduce", "ReduceScatter") and op.attrs.get("reduction") not in NCCL_OPS:
        return False
    if op.op_type in ("AllGather", "ReduceScatter"):
        axis = int(op.attrs["axis"]) % max(1, len(shape))
        if any(int(d) != 1 for d in shape[:axis]):
            return False
    return True


def broadcast_unique_id(lib: ctypes.CDLL, mpi_comm: Any) -> NcclUniqueId:
    """NCCL's bootstrap over MPI: rank 0 of ``mpi_comm`` (an mpi4py communicator) creates the
    unique id, every rank receives its 128 bytes by ``Bcast`` and returns it."""
    buf = np.zeros(ctypes.sizeof(NcclUniqueId), dtype=np.uint8)
    if mpi_comm.Get_rank() == 0:
        uid = NcclUniqueId()
        _check(lib, lib.ncclGetUniqueId(ctypes.byref(uid)), "ncclGetUniqueId")
        buf[:] = np.frombuffer(bytes(uid), dtype=np.uint8)
    mpi_comm.Bcast(buf, root=0)
    return NcclUniqueId.from_buffer_copy(buf.tobytes())


def _check(lib: ctypes.CDLL, code: int, what: str) -> None:
    if code != 0:
        msg = lib.ncclGetErrorString(code)
        raise RunFailed(f"NCCL {what} failed: {msg.decode() if msg else code}")


class NcclCommunicator:
    """NCCL communicators for every collective group of a rank, bootstrapped over MPI.

    ``mpi`` is the rank's :class:`partitioner.runtime.comm_mpi.MPICommunicator` (its
    ``group_comm`` gives each group's MPI communicator); ``groups`` the manifest's comm groups in
    global order. Every other method call goes to ``mpi`` (this object stands in for it)."""

    def __init__(self, mpi: Any, groups: Sequence[Sequence[int]], device_index: int) -> None:
        self.mpi = mpi
        self.lib = load_nccl()
        self.device_index = device_index
        self._comms: dict[tuple[int, ...], ctypes.c_void_p] = {}
        rank = int(mpi.rank)
        for g in groups:
            group = tuple(int(r) for r in g)
            if rank in group and len(group) > 1 and group not in self._comms:
                self._comms[group] = self._init(group, group.index(rank))

    def __getattr__(self, name: str) -> Any:  # send/recv/barrier/... of the MPI communicator
        return getattr(self.mpi, name)

    def _init(self, group: tuple[int, ...], index: int) -> ctypes.c_void_p:
        uid = broadcast_unique_id(self.lib, self.mpi.group_comm(group, 0))
        comm = ctypes.c_void_p()
        _check(self.lib, self.lib.ncclCommInitRank(ctypes.byref(comm), len(group), uid, index),
               f"ncclCommInitRank (group {list(group)})")
        return comm

    def runs(self, op: Any, shape: Sequence[int], dtype: Any) -> bool:
        return tuple(op.group) in self._comms and nccl_runs(op, shape, dtype)

    def run(self, op: Any, x_ptr: int | None, x_count: int, out_ptr: int, dtype: Any) -> None:
        """Enqueue ``op`` on the default stream: ``x_ptr`` (``x_count`` elements; None for a
        non-root Broadcast) into ``out_ptr``. The caller checked :meth:`runs`."""
        lib, comm = self.lib, self._comms[tuple(op.group)]
        dt = NCCL_BFLOAT16 if str(dtype) == "bfloat16" else NCCL_DTYPES[np.dtype(dtype)]
        stream = ctypes.c_void_p(0)
        send = ctypes.c_void_p(x_ptr if x_ptr is not None else out_ptr)
        recv = ctypes.c_void_p(out_ptr)
        n = len(op.group)
        if op.op_type == "AllReduce":
            code = lib.ncclAllReduce(send, recv, ctypes.c_size_t(x_count), dt, NCCL_OPS[op.attrs["reduction"]], comm, stream)
        elif op.op_type == "AllGather":
            code = lib.ncclAllGather(send, recv, ctypes.c_size_t(x_count), dt, comm, stream)
        elif op.op_type == "ReduceScatter":
            code = lib.ncclReduceScatter(send, recv, ctypes.c_size_t(x_count // n), dt,
                                         NCCL_OPS[op.attrs["reduction"]], comm, stream)
        elif op.op_type == "Broadcast":
            root = list(op.group).index(int(op.attrs["root"]))  # root is a global rank; NCCL wants its index
            code = lib.ncclBroadcast(send, recv, ctypes.c_size_t(x_count), dt, root, comm, stream)
        else:  # pragma: no cover - runs() excludes it
            raise RunFailed(f"{op.op_type} does not run on NCCL")
        _check(lib, code, op.op_type)

    def close(self) -> None:
        for comm in self._comms.values():
            self.lib.ncclCommDestroy(comm)
        self._comms.clear()


def gpu_communicator(mpi: Any, groups: Sequence[Sequence[int]], device_index: int,
                     shared_gpu: bool = False) -> tuple[Any, dict[str, str]]:
    """The communicator a GPU rank runs with: ``mpi`` wrapped with NCCL when
    :func:`select_device_comm` picks it, else ``mpi`` itself (staging); plus ``{"path", "why"}``
    for the run's report. Call it on every rank, after the rank's library is loaded (that makes
    its GPU current, which NCCL binds its communicators to). ``shared_gpu``: more ranks than
    visible GPUs on this host; NCCL refuses two ranks of one communicator on one GPU, so ``auto``
    stages then. ``PARTITIONER_GPU_COMM=nccl`` overrides it (ranks given one GPU each through
    their own ``CUDA_VISIBLE_DEVICES`` see one GPU apiece but do not share it)."""
    path, why = select_device_comm(True)
    if path == "nccl" and shared_gpu and os.environ.get(ENV, "auto").strip().lower() != "nccl":
        return mpi, {"path": "staged", "why": "ranks share a GPU on this host (NCCL needs one GPU per rank)"}
    if path == "nccl":
        return NcclCommunicator(mpi, groups, device_index), {"path": path, "why": why}
    return mpi, {"path": path, "why": why}
