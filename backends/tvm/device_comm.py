"""Comm ops whose tensors live on a device (a CUDA rank library calls them with GPU tensors).

Rules (the paths are described in :mod:`partitioner.runtime.comm_nccl`):
1. When the rank's communicator is an :class:`~partitioner.runtime.comm_nccl.NcclCommunicator`
   and NCCL runs the op (collectives on device pointers), the op is enqueued on the default CUDA
   stream: no copy through the host.
2. Otherwise the op is staged: each input is copied device -> host (``Tensor.numpy()``), the op
   runs on numpy arrays with the rank's communicator exactly as on the CPU
   (:func:`partitioner.core.comm_ops.execute`: MPI, rank-order reductions), and the result is copied
   host -> device into the output tensor the library allocated (``Tensor.copyfrom``). A Send
   copies by construction, so the library may reuse the input's storage at once.
The functions take any TVM tensors: on host tensors (tests, a CPU build) staging is the identity
copy path, which is how it is tested on a machine without a GPU.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from partitioner.core.comm_ops import CommOp, Communicator, execute
from partitioner.core.errors import RunFailed


def to_host(t: Any) -> np.ndarray:
    """A host copy of a TVM tensor (device -> host)."""
    return t.numpy()


def to_device(out: Any, value: np.ndarray) -> None:
    """Copy ``value`` (host) into the TVM tensor ``out`` (host -> device), checking the shape."""
    shape = tuple(int(d) for d in out.shape)
    if tuple(value.shape) != shape:
        raise RunFailed(f"comm op result has shape {list(value.shape)}, the library expects {list(shape)}")
    arr = np.ascontiguousarray(value)
    want = str(out.dtype)
    if want != "bfloat16" and arr.dtype != np.dtype(want):
        arr = arr.astype(want)
    out.copyfrom(arr)


def staged(op: CommOp, tensors: Sequence[Any], out: Any | None, comm: Communicator) -> None:
    """Rule 2: device -> host, the op on numpy through ``comm``, host -> device."""
    results = execute(op, [to_host(t) for t in tensors], comm)
    if out is not None:
        to_device(out, results[0])


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def run_on_device(op: CommOp, tensors: Sequence[Any], out: Any | None, comm: Any) -> str:
    """Run ``op`` on device tensors; returns the path taken (``"nccl"`` or ``"staged"``)."""
    runs = getattr(comm, "runs", None)
    if out is not None and runs is not None:
        x = tensors[0] if tensors else None
        shape = tuple(int(d) for d in (x.shape if x is not None else out.shape))
        if runs(op, shape, str(out.dtype)):
            comm.run(op, x.data_ptr() if x is not None else None, _numel(shape), out.data_ptr(), str(out.dtype))
            return "nccl"
    staged(op, tensors, out, comm)
    return "staged"
