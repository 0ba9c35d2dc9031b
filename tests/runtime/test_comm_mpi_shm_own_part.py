"""``comm_mpi`` rule 10 on 2 real MPI ranks: a rank reduces its own part of the shared-memory
AllReduce straight from its inputs, so only the other half of its input is copied into its slot.

Each rank's arrays come from ``numpy.random.default_rng(100 * k + rank)``, so every rank computes
the expected sum itself. A list of three arrays whose ends do not fall on the ranks' part boundary
is reduced in place (``out=xs``, as TVM data ranks do) and must equal numpy's ``a0 + a1`` bit for
bit; the bytes ``numpy.copyto`` writes into the rank's own slot (the copy in) must be the other
rank's part only. That count fails with the rule off (``PARTITIONER_SHM_OWN_PART=0``: the whole
input is copied in).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
from tests.mpi_script import rank_reports

ROOT = Path(__file__).resolve().parents[2]
SIZES = (300_001, 77, 500_000)  # float32, 3.2 MB in all: over SHM_MIN_BYTES; the part boundary splits array 2


def _arrays(rank: int) -> list[np.ndarray]:
    return [np.random.default_rng(100 * k + rank).standard_normal(n).astype(np.float32) for k, n in enumerate(SIZES)]


def _rank_main(out: str) -> None:
    from mpi4py import MPI

    from partitioner.runtime.comm_mpi import MPICommunicator

    comm = MPICommunicator([[0, 1]])
    xs = _arrays(comm.rank)
    comm.allreduce_list(xs, [0, 1], "sum", 3, out=xs)  # grows the window; the counted call follows
    xs = _arrays(comm.rank)
    slot = np.frombuffer(comm._shm[(0, 1)].slots[comm.rank], dtype=np.uint8)
    copied = [0]
    plain_copyto = np.copyto

    def counting(dst, src, *args, **kw):  # noqa: ANN001, ANN202
        if np.may_share_memory(dst, slot):
            copied[0] += int(np.asarray(dst).nbytes)
        return plain_copyto(dst, src, *args, **kw)

    np.copyto = counting
    try:
        got = comm.allreduce_list(xs, [0, 1], "sum", 3, out=xs)
    finally:
        np.copyto = plain_copyto
    want = [a + b for a, b in zip(_arrays(0), _arrays(1))]
    n = sum(SIZES)
    mine = (comm.rank + 1) * n // 2 - comm.rank * n // 2
    report = {"equal": all(np.array_equal(g, w) for g, w in zip(got, want)),
              "in_place": all(g is x for g, x in zip(got, xs)), "copied_in": copied[0],
              "others_part": 4 * (n - mine), "whole": 4 * n}
    comm.barrier()
    Path(out, f"rank{MPI.COMM_WORLD.Get_rank()}.json").write_text(json.dumps(report))


def test_own_part_is_reduced_from_the_input_and_not_copied_in(tmp_path: Path) -> None:
    for rank, r in enumerate(rank_reports(__file__, tmp_path, timeout=120)):
        assert r["equal"] and r["in_place"], (rank, r)
        assert r["copied_in"] == r["others_part"] < r["whole"], (rank, r)


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    _rank_main(sys.argv[1])
