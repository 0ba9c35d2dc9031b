"""Collective formulas against hand arithmetic (COST_MODEL.md table), algorithm choice, and
mapping collectives onto a two-level cluster. Throughout: α = 1 µs, β = 1 ns/B, γ = 0.5 ns/B,
n = 1 MB, p = 8 (so ⌈log₂p⌉ = 3 and (p−1)/p = 7/8)."""

from __future__ import annotations

import pytest

from partitioner.cluster import Cluster, LinkLevel
from partitioner.cost import comm, pipeline

A, B, G, N, P = 1e-6, 1e-9, 5e-10, 1e6, 8


def approx(x):
    return pytest.approx(x, rel=1e-12, abs=1e-15)


def test_point_to_point():
    assert comm.p2p(N, A, B) == approx(1e-6 + 1e-3)


def test_allreduce_rows():
    # ring: 2·7·1µs + 2·1e6·7/8·1ns + 1e6·7/8·0.5ns = 14e-6 + 1.75e-3 + 4.375e-4
    assert comm.allreduce_ring(N, P, A, B, G) == approx(14e-6 + 1.75e-3 + 4.375e-4)
    # Rabenseifner: 2·3·1µs + 1.75e-3 + 4.375e-4
    assert comm.allreduce_rabenseifner(N, P, A, B, G) == approx(6e-6 + 1.75e-3 + 4.375e-4)
    # recursive doubling: 3·(1e-6 + 1e-3 + 5e-4)
    assert comm.allreduce_recursive_doubling(N, P, A, B, G) == approx(3 * (1e-6 + 1e-3 + 5e-4))
    # tree: 2·3·(1e-6 + 1e-3) (+ 3·1e6·0.5ns of reductions)
    assert comm.allreduce_tree(N, P, A, B, 0.0) == approx(6 * (1e-6 + 1e-3))
    assert comm.allreduce_tree(N, P, A, B, G) == approx(6 * (1e-6 + 1e-3) + 1.5e-3)
    # lower bound: 3·1e-6 + 1.75e-3
    assert comm.allreduce_lower_bound(N, P, A, B) == approx(3e-6 + 1.75e-3)
    for f in comm.ALLREDUCE.values():
        assert f(N, P, A, B, 0.0) >= comm.allreduce_lower_bound(N, P, A, B) - 1e-15


def test_allgather_reducescatter_rows():
    assert comm.allgather_ring(N, P, A, B) == approx(7e-6 + 8.75e-4)
    assert comm.allgather_recursive_doubling(N, P, A, B) == approx(3e-6 + 8.75e-4)
    # n(p−1)/p·(β+γ) = 1e6·7/8·1.5e-9 = 1.3125e-3
    assert comm.reducescatter_pairwise(N, P, A, B, G) == approx(7e-6 + 1.3125e-3)
    assert comm.reducescatter_recursive_halving(N, P, A, B, G) == approx(3e-6 + 1.3125e-3)


def test_broadcast_alltoall_ps_rows():
    assert comm.broadcast_binomial(N, P, A, B) == approx(3 * (1e-6 + 1e-3))
    assert comm.broadcast_scatter_allgather(N, P, A, B) == approx((3 + 7) * 1e-6 + 1.75e-3)
    assert comm.alltoall_pairwise(N, P, A, B) == approx(7e-6 + 1e-3)
    assert comm.alltoall_bruck(N, P, A, B) == approx(3e-6 + 5e5 * 3 * 1e-9)
    # 2α + 2·p·n·β/s with s = 2: 2e-6 + 2·8·1e6·1e-9/2
    assert comm.parameter_server(N, P, 2, A, B) == approx(2e-6 + 8e-3)


def test_one_rank_costs_nothing():
    for f in (comm.allreduce_ring, comm.allreduce_tree, comm.allgather_ring, comm.broadcast_binomial):
        assert f(N, 1, A, B) == 0.0


def test_algorithm_choice_small_vs_large():
    lv = LinkLevel("x", A, B)
    # 8 bytes: latency dominates; recursive doubling has ⌈log₂p⌉α = 3 µs (+ 24 ns)
    t, alg = comm.allreduce_time(8, P, lv, gamma=0.0)
    assert alg == "recursive_doubling" and t == approx(3 * (1e-6 + 8e-9))
    # 1 MB: bandwidth dominates; Rabenseifner has the least α among the 2n(p−1)/p·β algorithms
    t, alg = comm.allreduce_time(N, P, lv, gamma=0.0)
    assert alg == "rabenseifner" and t == approx(6e-6 + 1.75e-3)
    assert comm.broadcast_time(8, P, lv)[1] == "binomial"
    assert comm.broadcast_time(N, P, lv)[1] == "scatter_allgather"
    assert comm.alltoall_time(8, P, lv)[1] == "bruck"
    assert comm.alltoall_time(N, P, lv)[1] == "pairwise"


def test_collective_on_one_node_and_p2p():
    c = Cluster.resolve("h200:4x8")
    intra = c.levels[0]
    cc = comm.collective_time("allreduce", N, list(range(8)), c, gamma=0.0)
    # recursive doubling 3·(3 µs + 1e6/450e9) = 15.7 µs beats Rabenseifner 6·3 µs + 3.9 µs
    assert cc.algorithm == "recursive_doubling"
    assert cc.seconds == approx(3 * (3e-6 + N / 450e9))
    assert cc.seconds == approx(comm.allreduce_time(N, 8, intra)[0])
    assert cc.bytes_per_level == {"nvlink4": 8 * 3 * N}  # every rank sends n in each of 3 rounds
    # send across nodes: 5 µs + 1e6 / 50e9
    assert comm.p2p_time(N, 0, 8, c) == approx(5e-6 + 2e-5)
    s = comm.collective_time("send", N, [0, 8], c)
    assert s.seconds == approx(2.5e-5) and s.bytes_per_level == {"ib-ndr-400g": N}


def test_hierarchical_allreduce_across_nodes():
    c = Cluster.resolve("h200:4x8")  # NVLink 3 µs, 1/450e9 s/B; IB 5 µs, 1/50e9 s/B
    n = 1e9
    cc = comm.collective_time("allreduce", n, list(range(32)), c, gamma=0.0)
    assert cc.algorithm.startswith("hierarchical")
    rs = 3 * 3e-6 + n * 7 / 8 / 450e9          # reduce-scatter in node, p=8
    ar = 2 * 2 * 5e-6 + 2 * (n / 8) * 3 / 4 / 50e9  # Rabenseifner across 4 nodes on n/8
    ag = 3 * 3e-6 + n * 7 / 8 / 450e9          # allgather in node
    assert cc.seconds == pytest.approx(rs + ar + ag, rel=1e-9)
    flat = 2 * 5 * 5e-6 + 2 * n * 31 / 32 / 50e9
    assert cc.seconds < flat
    assert cc.bytes_per_level["nvlink4"] == pytest.approx(4 * 2 * n * 7)
    assert cc.bytes_per_level["ib-ndr-400g"] == pytest.approx(8 * 2 * (n / 8) * 3)


def test_flat_collective_spanning_nodes_uses_slowest_level():
    c = Cluster.resolve("h200:4x8")
    cc = comm.collective_time("allgather", N, [0, 8], c)
    assert cc.seconds == approx(5e-6 + N / 2 / 50e9)  # p=2: one step, n/2 bytes over IB


def test_pipeline_formulas():
    assert pipeline.bubble_fraction(4, 8) == pytest.approx(3 / 11)
    # equal stages t=1, sends 0.1: (m+p−1)·t + Σ sends = 11 + 0.3
    assert pipeline.pipeline_step_time([1, 1, 1, 1], [0.1, 0.1, 0.1], 8) == pytest.approx(11.3)
    # slowest stage 2 sets the pace: Σt + Σs + (m−1)·2 = 5 + 0 + 14
    assert pipeline.pipeline_step_time([1, 2, 1, 1], [0, 0, 0], 8) == pytest.approx(19)
