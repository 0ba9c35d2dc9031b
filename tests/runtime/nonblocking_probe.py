"""Run under ``mpiexec -n 2``: shows that ``MPICommunicator.send`` does not wait for the receiver.

Rank 1 sleeps ``DELAY`` seconds before it receives a 16 MiB array (far above MPICH's eager limit,
so a blocking send would wait for it). Rank 0 prints ``send_s`` (how long ``send`` took) and
``flush_s`` (how long completing it took); rank 1 checks the data against numpy and prints ``ok``.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from partitioner.runtime.comm_mpi import MPICommunicator  # noqa: E402

DELAY = 1.0
SHAPE = (4, 1024, 1024)


def main() -> int:
    comm = MPICommunicator(timeout_s=30)
    x = np.arange(np.prod(SHAPE), dtype=np.float32).reshape(SHAPE)
    comm.barrier()
    if comm.rank == 0:
        t0 = time.perf_counter()
        comm.send(x, 1, 5)
        t1 = time.perf_counter()
        comm.flush()
        t2 = time.perf_counter()
        print(json.dumps({"rank": 0, "send_s": t1 - t0, "flush_s": t2 - t1}), flush=True)
    else:
        time.sleep(DELAY)
        got = comm.recv(0, 5, SHAPE, np.dtype(np.float32))
        print(json.dumps({"rank": 1, "ok": bool(np.array_equal(got, x))}), flush=True)
    comm.barrier()
    return 0


if __name__ == "__main__":
    sys.exit(main())
