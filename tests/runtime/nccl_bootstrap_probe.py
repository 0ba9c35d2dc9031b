"""Run under ``mpiexec -n 2``: NCCL's unique-id bootstrap over MPI (no GPU needed for this part).
Rank 0 prints one JSON line with every rank's id digest."""

from __future__ import annotations

import hashlib
import json

from mpi4py import MPI

from partitioner.runtime.comm_nccl import broadcast_unique_id, load_nccl

uid = broadcast_unique_id(load_nccl(), MPI.COMM_WORLD)
raw = bytes(uid)
digests = MPI.COMM_WORLD.gather({"sha": hashlib.sha256(raw).hexdigest(), "nonzero": any(raw), "len": len(raw)}, root=0)
if MPI.COMM_WORLD.Get_rank() == 0:
    print(json.dumps(digests))
