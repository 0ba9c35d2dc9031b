"""The MPI communicator's shared-memory AllReduce (``comm_mpi`` rule 7) on 2 real MPI ranks.

Each rank's arrays come from ``numpy.random.default_rng(seed + rank)``, so every rank can compute
the expected reduction itself (numpy, group order). The shared-memory path must give bit-identical
results to the gather path (rule 4) for sum, max and float32/float64/int64, through a window that
grows (a larger array after a smaller one) and is reused (the same size again), and leave small
arrays on the gather path.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
from tests.mpi_script import rank_reports

ROOT = Path(__file__).resolve().parents[2]
CASES = [("float32", (512, 1024), "sum"), ("float32", (300_001,), "sum"), ("float64", (1 << 17, 3), "max"),
         ("int64", (1 << 18,), "sum"), ("float32", (1 << 19,), "sum"), ("float32", (1000,), "sum")]


def _array(rank: int, k: int, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    rng = np.random.default_rng(100 * k + rank)
    if dtype == "int64":
        return rng.integers(-1000, 1000, shape).astype(np.int64)
    return rng.standard_normal(shape).astype(dtype)


def _rank_main(out: str) -> None:
    from mpi4py import MPI

    from partitioner.runtime.comm_mpi import MPICommunicator

    comm = MPICommunicator([[0, 1]])
    plain = MPICommunicator([[0, 1]])
    plain.use_shm = False
    report = []
    for k, (dtype, shape, red) in enumerate(CASES):
        x = _array(comm.rank, k, dtype, shape)
        before = comm._shm[(0, 1)].calls if comm._shm.get((0, 1)) is not None else 0
        got = comm.allreduce(x, [0, 1], red, 7)
        ref = plain.allreduce(x, [0, 1], red, 7)
        fn = {"sum": np.add, "max": np.maximum}[red]
        want = fn(_array(0, k, dtype, shape), _array(1, k, dtype, shape))
        report.append({"shape": list(got.shape) == list(shape), "dtype": str(got.dtype) == dtype,
                       "equal_numpy": bool(np.array_equal(got, want)), "equal_gather": bool(np.array_equal(got, ref)),
                       "shm_calls": comm._shm[(0, 1)].calls - before, "capacity": comm._shm[(0, 1)].capacity
                       if comm._shm.get((0, 1)) is not None else 0})
        # the input array is left as it was
        report[-1]["input_kept"] = bool(np.array_equal(x, _array(comm.rank, k, dtype, shape)))
    comm.barrier()
    Path(out, f"rank{MPI.COMM_WORLD.Get_rank()}.json").write_text(json.dumps(report))


def test_shared_memory_allreduce_is_bit_identical_to_the_gather(tmp_path: Path) -> None:
    for rank, report in enumerate(rank_reports(__file__, tmp_path, timeout=120)):
        for case, r in zip(CASES, report):
            big = np.dtype(case[0]).itemsize * int(np.prod(case[1])) >= (1 << 20)
            assert r["shm_calls"] == (1 if big else 0), (rank, case, r)  # rule 7: >= 1 MiB only
            assert r["shape"] and r["dtype"] and r["equal_numpy"] and r["equal_gather"] and r["input_kept"], (rank, case, r)
        # the window grew to the largest array reduced through it (int64 2 MiB, float32 2 MiB, ...)
        assert report[-1]["capacity"] == max(np.dtype(d).itemsize * int(np.prod(s)) for d, s, _ in CASES), report


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    _rank_main(sys.argv[1])
