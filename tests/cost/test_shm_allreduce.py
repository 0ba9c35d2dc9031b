"""The shared-memory AllReduce rule (partitioner/cost/comm.py, ``SHM_ALLREDUCE``).

Each test that prices the rule fails without it (``SHM_ALLREDUCE`` off, or before it existed:
every AllReduce was an alpha-beta algorithm on the link)."""

from __future__ import annotations

import pytest

from partitioner.cluster import Cluster, Device, LinkLevel
from partitioner.cost import comm
from partitioner.cost.comm import collective_time

BW, ALPHA, BETA = 2.0e10, 3e-6, 2e-10  # link: 5 GB/s


def cluster(kind: str = "cpu", nodes: tuple[tuple[int, ...], ...] = ((0, 1),)) -> Cluster:
    n = sum(len(g) for g in nodes)
    devs = tuple(Device(f"{kind}{i}", kind, {"float32": 1e11}, 1e9, BW) for i in range(n))
    levels = (LinkLevel("shm-mpi", ALPHA, BETA), LinkLevel("net", 1e-5, 1e-9))
    return Cluster("c", devs, nodes, levels[:1] if len(nodes) == 1 else levels)


def test_large_allreduce_on_one_node_is_priced_as_memory_passes(monkeypatch):
    n = 16 * 2**20
    c = collective_time("allreduce", n, [0, 1], cluster())
    # copy in of the other rank's half (n: read and write n/2; runtime rule 10) + reduce (n read + n/2
    # written) + copy out (2n) at the memory bandwidth, 3 barriers
    assert c.algorithm == "shm"
    assert c.seconds == pytest.approx(3 * ALPHA + (n + 1.5 * n + 2 * n) / BW)
    monkeypatch.setattr(comm, "SHM_OWN_PART", False)  # the whole input copied in (2n)
    assert collective_time("allreduce", n, [0, 1], cluster()).seconds == pytest.approx(
        3 * ALPHA + (2 * n + 1.5 * n + 2 * n) / BW)
    assert c.seconds > comm.allreduce_time(n, 2, cluster().levels[0])[0]  # the alpha-beta price was lower


def test_where_the_runtime_keeps_the_gather_the_link_prices_it(monkeypatch):
    n = 16 * 2**20
    small = collective_time("allreduce", comm.SHM_MIN_BYTES - 4, [0, 1], cluster())
    assert small.algorithm != "shm"
    assert collective_time("allreduce", n, [0, 1], cluster("gpu")).algorithm != "shm"
    assert collective_time("allreduce", n, [0, 1], cluster(nodes=((0,), (1,)))).algorithm != "shm"
    monkeypatch.setattr(comm, "SHM_ALLREDUCE", False)
    off = collective_time("allreduce", n, [0, 1], cluster())
    assert off.seconds == pytest.approx(comm.allreduce_time(n, 2, cluster().levels[0],
                                                            comm.reduction_gamma(cluster(), [0, 1]))[0])


def test_the_lent_last_bucket_is_priced_without_its_copy_out(monkeypatch):
    n = 16 * 2**20
    # the runtime's rule 11: the last bucket's reduced gradients are read in the window, so its
    # copy out (read n, write n) is not paid; nothing is saved where the shm path is not taken
    assert comm.shm_lent_saving(n, [0, 1], cluster()) == pytest.approx(2 * n / BW)
    assert comm.shm_lent_saving(comm.SHM_MIN_BYTES - 4, [0, 1], cluster()) == 0.0
    assert comm.shm_lent_saving(n, [0, 1], cluster("gpu")) == 0.0
    monkeypatch.setattr(comm, "SHM_LEND_LAST_BUCKET", False)
    assert comm.shm_lent_saving(n, [0, 1], cluster()) == 0.0
