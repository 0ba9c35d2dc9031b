"""MPI probe for ``partitioner calibrate``: run under ``mpiexec -n 2``.

Rank 0 and rank 1 ping-pong messages of several sizes (one-way time = round trip / 2) and time
``Allreduce`` on float32 buffers. Rank 0 prints one JSON object on stdout:
``{"pingpong": [[bytes, seconds], ...], "allreduce": [[bytes, seconds], ...], "ranks": 2}``.
Each point is the median over repetitions after a warm-up.
"""

from __future__ import annotations

import json
import statistics
import sys


def _sizes(quick: bool) -> tuple[list[int], list[int]]:
    if quick:
        return [8, 4096, 65536, 1 << 20], [1024, 1 << 20]
    return [8, 1024, 16384, 65536, 262144, 1 << 20, 4 << 20], [1024, 65536, 1 << 20, 4 << 20]


def main(argv: list[str] | None = None) -> int:
    import numpy as np
    from mpi4py import MPI

    argv = sys.argv[1:] if argv is None else argv
    quick = "--quick" in argv
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    if size < 2:
        if rank == 0:
            print(json.dumps({"error": "run with mpiexec -n 2"}))
        return 2
    pp_sizes, ar_sizes = _sizes(quick)
    reps_small, reps_big = (20, 5) if quick else (100, 20)
    pingpong, allreduce = [], []
    for n in pp_sizes:
        buf = np.zeros(n, np.uint8)
        reps = reps_small if n <= 65536 else reps_big
        times = []
        for it in range(reps + 3):
            comm.Barrier()
            t0 = MPI.Wtime()
            if rank == 0:
                comm.Send(buf, dest=1, tag=1)
                comm.Recv(buf, source=1, tag=2)
            elif rank == 1:
                comm.Recv(buf, source=0, tag=1)
                comm.Send(buf, dest=0, tag=2)
            dt = MPI.Wtime() - t0
            if it >= 3:
                times.append(dt / 2)
        pingpong.append([n, statistics.median(times)])
    for n in ar_sizes:
        buf = np.ones(n // 4, np.float32)
        reps = reps_small if n <= 65536 else reps_big
        times = []
        for it in range(reps + 3):
            comm.Barrier()
            t0 = MPI.Wtime()
            comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
            dt = comm.allreduce(MPI.Wtime() - t0, op=MPI.MAX)
            if it >= 3:
                times.append(dt)
        allreduce.append([n, statistics.median(times)])
    if rank == 0:
        print(json.dumps({"pingpong": pingpong, "allreduce": allreduce, "ranks": size}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
