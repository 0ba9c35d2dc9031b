"""Comm ops on device buffers (issue 17, item 3), as far as a machine without a GPU can test them.

What runs here:
- the staging path (device -> host, the op over the communicator, host -> device) on TVM tensors,
  with host tensors standing in for device ones (the same ``numpy()`` / ``copyfrom`` calls), on 2
  in-process ranks, against numpy computed here;
- the choice between NCCL and staging, and which ops NCCL takes;
- NCCL's bootstrap: libnccl (the nvidia-nccl-cu12 wheel) loads with ctypes and its unique id
  reaches every rank over MPI under ``mpiexec -n 2``.
What needs a GPU (``make gpu-check``): ``ncclCommInitRank`` and the collectives on device memory.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from backends.tvm.device_comm import run_on_device
from partitioner.core.comm_ops import CommOp
from partitioner.core.errors import BackendError
from partitioner.runtime.comm_local import LocalWorld
from partitioner.runtime.comm_nccl import ENV, nccl_runs, nccl_version, select_device_comm

ROOT = Path(__file__).resolve().parents[2]


def _op(op_type: str, **attrs) -> CommOp:
    return CommOp(op_type, op_type.lower(), ("x",), ("y",), {"tag": 7, **attrs})


def _ranks(fn, n: int = 2) -> list:
    world = LocalWorld(n, timeout_s=30)
    out: list = [None] * n
    errors: list = []

    def body(r: int) -> None:
        try:
            out[r] = fn(r, world.communicator(r))
        except Exception as e:  # surfaced below
            errors.append(e)
            world.abort(str(e))

    threads = [threading.Thread(target=body, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    if errors:
        raise errors[0]
    return out


def _tensor(a: np.ndarray):
    import tvm

    return tvm.runtime.tensor(np.ascontiguousarray(a))


def _empty(shape, dtype="float32"):
    import tvm

    return tvm.runtime.empty(tuple(shape), dtype, tvm.cpu(0))


XS = [np.random.default_rng(r).standard_normal((2, 3)).astype(np.float32) for r in range(2)]


def test_staged_allreduce_allgather_reducescatter_broadcast() -> None:
    def body(r, comm):
        got = {}
        out = _empty((2, 3))
        got["allreduce"] = (run_on_device(_op("AllReduce", group=[0, 1], reduction="sum"), [_tensor(XS[r])], out, comm),
                            out.numpy())
        out = _empty((2, 6))
        run_on_device(_op("AllGather", group=[0, 1], axis=1), [_tensor(XS[r])], out, comm)
        got["allgather"] = out.numpy()
        out = _empty((1, 3))
        run_on_device(_op("ReduceScatter", group=[0, 1], axis=0, reduction="max"), [_tensor(XS[r])], out, comm)
        got["reducescatter"] = out.numpy()
        out = _empty((2, 3))
        ins = [_tensor(XS[r])] if r == 1 else []
        run_on_device(_op("Broadcast", group=[0, 1], root=1, shape=[2, 3], dtype=1), ins, out, comm)
        got["broadcast"] = out.numpy()
        return got

    res = _ranks(body)
    for r in range(2):
        path, value = res[r]["allreduce"]
        assert path == "staged"  # a LocalWorld communicator has no NCCL
        np.testing.assert_allclose(value, XS[0] + XS[1], rtol=1e-6)
        np.testing.assert_array_equal(res[r]["allgather"], np.concatenate(XS, axis=1))
        np.testing.assert_array_equal(res[r]["reducescatter"], np.maximum(XS[0], XS[1])[r:r + 1])
        np.testing.assert_array_equal(res[r]["broadcast"], XS[1])


def test_staged_send_recv_and_shape_check() -> None:
    def body(r, comm):
        if r == 0:
            x = _tensor(XS[0])
            run_on_device(CommOp("Send", "s", ("x",), (), {"peer": 1, "tag": 3}), [x], None, comm)
            x.copyfrom(np.zeros((2, 3), np.float32))  # the staged Send copied: reusing x is safe
            return None
        out = _empty((2, 3))
        run_on_device(CommOp("Recv", "r", (), ("y",), {"peer": 0, "tag": 3, "shape": [2, 3], "dtype": 1}),
                      [], out, comm)
        return out.numpy()

    np.testing.assert_array_equal(_ranks(body)[1], XS[0])

    from partitioner.core.errors import RunFailed

    with pytest.raises(RunFailed, match="expects"):
        _ranks(lambda r, comm: run_on_device(_op("AllReduce", group=[0, 1], reduction="sum"), [_tensor(XS[r])],
                                             _empty((3, 2)), comm))


def test_device_comm_selection() -> None:
    assert select_device_comm(False, {})[0] == "staged"
    assert select_device_comm(True, {ENV: "mpi"}) == ("staged", f"{ENV}=mpi")
    assert nccl_version() is not None, "the cuda extra installs nvidia-nccl-cu12"
    assert select_device_comm(True, {})[0] == "nccl"
    assert select_device_comm(True, {ENV: "nccl"})[0] == "nccl"
    with pytest.raises(BackendError, match="use one of auto, nccl, mpi"):
        select_device_comm(True, {ENV: "gloo"})


def test_which_ops_nccl_runs() -> None:
    assert nccl_runs(_op("AllReduce", group=[0, 1], reduction="sum"), (4, 8), "float32")
    assert nccl_runs(_op("AllReduce", group=[0, 1], reduction="max"), (4, 8), "bfloat16")
    assert nccl_runs(_op("Broadcast", group=[0, 1], root=0), (4, 8), "int64")
    # NCCL concatenates flat buffers: equal to a split along axis only when the dims before it are 1
    assert nccl_runs(_op("AllGather", group=[0, 1], axis=0), (4, 8), "float32")
    assert nccl_runs(_op("AllGather", group=[0, 1], axis=1), (1, 8), "float32")
    assert not nccl_runs(_op("AllGather", group=[0, 1], axis=1), (4, 8), "float32")
    assert not nccl_runs(_op("ReduceScatter", group=[0, 1], axis=1, reduction="sum"), (4, 8), "float32")
    # point to point and all-to-all stay staged (MPI's non-blocking send semantics)
    assert not nccl_runs(CommOp("Send", "s", ("x",), (), {"peer": 1, "tag": 0}), (4,), "float32")
    assert not nccl_runs(_op("AllToAll", group=[0, 1], split_axis=0, concat_axis=0), (4,), "float32")
    assert not nccl_runs(_op("AllReduce", group=[0, 1], reduction="sum"), (4,), "bool")


def test_nccl_unique_id_bootstrap_over_mpi() -> None:
    from partitioner.runtime.launch import find_mpiexec

    r = subprocess.run([find_mpiexec(), "-n", "2", sys.executable, str(ROOT / "tests/runtime/nccl_bootstrap_probe.py")],
                       capture_output=True, text=True, timeout=120, cwd=ROOT,
                       env={**__import__("os").environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr
    ranks = json.loads(r.stdout.strip().splitlines()[-1])
    assert len(ranks) == 2 and ranks[0]["len"] == 128 and ranks[0]["nonzero"]
    assert ranks[0]["sha"] == ranks[1]["sha"]  # every rank holds rank 0's id


def test_ranks_sharing_a_gpu_stage_unless_told_otherwise(monkeypatch) -> None:
    from partitioner.runtime.comm_nccl import gpu_communicator

    world = LocalWorld(1)
    mpi = world.communicator(0)
    monkeypatch.setenv(ENV, "auto")
    comm, why = gpu_communicator(mpi, [], 0, shared_gpu=True)
    assert comm is mpi and why["path"] == "staged" and "share a GPU" in why["why"]
    monkeypatch.setenv(ENV, "mpi")
    comm, why = gpu_communicator(mpi, [], 0, shared_gpu=False)
    assert comm is mpi and why == {"path": "staged", "why": f"{ENV}=mpi"}
    # a 1-rank GPU run: NCCL is picked, no communicator needs a GPU to be created, and the wrapper
    # stands in for the MPI communicator (send/recv/barrier go through to it)
    monkeypatch.setenv(ENV, "auto")
    comm, why = gpu_communicator(mpi, [[0]], 0, shared_gpu=False)
    assert why["path"] == "nccl" and comm.rank == 0 and comm.mpi is mpi
    assert not comm.runs(_op("AllReduce", group=[0], reduction="sum"), (4,), "float32")  # a 1-member group stages
