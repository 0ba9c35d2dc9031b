"""Event simulator on hand-built per-rank programs: GPipe bubble, collectives, deadlocks, speed."""

from __future__ import annotations

import time

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper, numpy_helper

from partitioner.cluster import Cluster, Device, LinkLevel
from partitioner.core.errors import VerifyError
from partitioner.cost.pipeline import bubble_fraction
from partitioner.cost.comm import SEND_OVERHEAD_ALPHA
from partitioner.cost.runtime_overhead import step_sync
from partitioner.cost.simulate import simulate

COMM = "partitioner.comm"
PEAK = 1e9  # FLOP/s: a [64,256]x[256,256] MatMul = 2·64·256·256 = 8388608 FLOPs -> 8.388608 ms
T_MM = 2 * 64 * 256 * 256 / PEAK
ALPHA, BETA = 1e-6, 1e-12
ACT = 64 * 256 * 4  # bytes of one activation


def cluster(n: int) -> Cluster:
    devs = tuple(Device(f"d{i}", "cpu", {"float32": PEAK}, 1e9, 1e15, 1.0, 0.0) for i in range(n))
    return Cluster("toy", devs, (tuple(range(n)),), (LinkLevel("link", ALPHA, BETA),))


def program(nodes, inputs, outputs, value_info=(), inits=()) -> ir.Model:
    g = helper.make_graph(nodes, "rank", inputs, outputs, initializer=list(inits), value_info=list(value_info))
    proto = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(COMM, 1)])
    return ir.serde.deserialize_model(proto)


def t(name, shape):
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)


def weight(name="w"):
    return numpy_helper.from_array(np.zeros((256, 256), np.float32), name)


def stage(rank: int, p: int, n_matmuls: int = 1) -> ir.Model:
    nodes, vis, inputs, outputs = [], [], [], []
    if rank == 0:
        inputs.append(t("x", [64, 256]))
    else:
        nodes.append(helper.make_node("Recv", [], ["x"], domain=COMM, peer=rank - 1, tag=rank - 1,
                                      shape=[64, 256], dtype=TensorProto.FLOAT))
        vis.append(t("x", [64, 256]))
    cur = "x"
    for k in range(n_matmuls):
        nodes.append(helper.make_node("MatMul", [cur, "w"], [f"h{k}"]))
        cur = f"h{k}"
        vis.append(t(cur, [64, 256]))
    if rank < p - 1:
        nodes.append(helper.make_node("Send", [cur], [], domain=COMM, peer=rank + 1, tag=rank))
    else:
        outputs.append(t(cur, [64, 256]))
    return program(nodes, inputs, outputs, vis, [weight()])


def test_gpipe_bubble_4_stages_8_microbatches():
    p, m = 4, 8
    res = simulate([stage(r, p) for r in range(p)], cluster(p), microbatches=m, batch_size=m * 64)
    send = ALPHA + ACT * BETA
    post = SEND_OVERHEAD_ALPHA * ALPHA + ACT * BETA  # each end of a message: post it, take it out
    # fill-drain: (m+p−1)·t + (p−1) sends; the middle stages receive and send, so they set the
    # pace at t + 2·post; the step ends with a barrier (cost/runtime_overhead.py rule 4: α here)
    sync = step_sync(cluster(p), p)
    assert sync == pytest.approx(2 * ALPHA, rel=1e-9)  # a 0-byte allreduce of 4 ranks: ⌈log₂4⌉·α
    assert res.step_latency == pytest.approx((m + p - 1) * T_MM + (p - 1) * send + (m - 1) * 2 * post + sync,
                                             rel=1e-9)
    for r in range(p):
        assert res.compute_time[r] == pytest.approx(m * T_MM, rel=1e-9)
        # idle + in-flight waits make up the bubble: (p−1)/(m+p−1) = 3/11 of the step
        posting = (m * post if r < p - 1 else 0.0) + ((m - 1) * post if r > 0 else 0.0)
        frac = (res.idle_time[r] + res.comm_time[r] - posting - sync) / res.step_latency
        assert frac == pytest.approx(bubble_fraction(p, m), abs=0.02)
    assert res.throughput == pytest.approx(m * 64 / res.step_latency)
    # m sends per boundary, 3 boundaries
    assert res.bytes_per_level == {"link": pytest.approx(3 * m * ACT)}
    # weights (256 KiB) + live activations (x and h0: 128 KiB on a middle stage) + buffered inputs
    assert res.peak_memory[1] >= 256 * 256 * 4 + 2 * ACT
    kinds = {e.kind for e in res.events}
    assert kinds == {"compute", "comm", "idle"}
    assert all(e.end > e.start for e in res.events)


def test_slow_stage_sets_the_pace():
    p, m = 3, 6
    progs = [stage(0, p), stage(1, p, n_matmuls=2), stage(2, p)]
    res = simulate(progs, cluster(p), microbatches=m)
    send = ALPHA + ACT * BETA
    post = SEND_OVERHEAD_ALPHA * ALPHA + ACT * BETA
    # Σ t_i + Σ s_i + (m−1)·max cycle = (1 + 2 + 1)·t + 2 sends + 5·(2t + 2·post): the slow
    # stage receives and sends
    assert res.step_latency == pytest.approx(4 * T_MM + 2 * send + (m - 1) * (2 * T_MM + 2 * post)
                                             + step_sync(cluster(p), p), rel=1e-9)


def _allreduce_rank(n_matmuls: int) -> ir.Model:
    nodes, vis = [], []
    cur = "x"
    for k in range(n_matmuls):
        nodes.append(helper.make_node("MatMul", [cur, "w"], [f"h{k}"]))
        cur = f"h{k}"
        vis.append(t(cur, [64, 256]))
    nodes.append(helper.make_node("AllReduce", [cur], ["y"], domain=COMM, group=[0, 1], reduction="sum", tag=7))
    return program(nodes, [t("x", [64, 256])], [t("y", [64, 256])], vis, [weight()])


def test_collective_waits_for_all_members():
    res = simulate([_allreduce_rank(1), _allreduce_rank(2)], cluster(2), microbatches=1)
    # p = 2: every allreduce algorithm here costs 2α + nβ (ring/Rabenseifner) or α + nβ + nγ;
    # γ = 3 / 1e15 s/B. Recursive doubling: 1·(α + nβ + nγ)
    gamma = 3 / 1e15
    ar = min(2 * ALPHA + ACT * BETA + ACT / 2 * gamma, ALPHA + ACT * BETA + ACT * gamma)
    sync = ALPHA  # the barrier that ends the step: a 0-byte allreduce of 2 ranks
    assert res.step_latency == pytest.approx(2 * T_MM + ar + sync, rel=1e-9)
    assert res.idle_time[0] == pytest.approx(T_MM, rel=1e-9)  # rank 0 waits one MatMul
    assert res.idle_time[1] == pytest.approx(0.0, abs=1e-12)
    assert res.comm_time == (pytest.approx(ar + sync, rel=1e-9), pytest.approx(ar + sync, rel=1e-9))


def test_deadlock_is_reported():
    lonely = program([helper.make_node("Recv", [], ["x"], domain=COMM, peer=1, tag=3, shape=[4], dtype=1)],
                     [], [t("x", [4])], [])
    idle = program([helper.make_node("Relu", ["a"], ["b"])], [t("a", [4])], [t("b", [4])])
    with pytest.raises(VerifyError, match="rank 0 waits on recv from 1 tag 3"):
        simulate([lonely, idle], cluster(2))


def test_fast_on_thousands_of_nodes_and_32_ranks():
    n = 2000
    nodes = [helper.make_node("Relu", [f"a{i}"], [f"a{i + 1}"]) for i in range(n)]
    nodes.append(helper.make_node("AllReduce", [f"a{n}"], ["y"], domain=COMM, group=list(range(32)), tag=0))
    vis = [t(f"a{i}", [64, 256]) for i in range(1, n + 1)]
    model = program(nodes, [t("a0", [64, 256])], [t("y", [64, 256])], vis)
    c = Cluster.resolve("h200:4x8")
    t0 = time.perf_counter()
    res = simulate([model] * 32, c, microbatches=4)
    assert time.perf_counter() - t0 < 5.0  # about 0.1 s idle; the bound only catches a quadratic blow-up
    assert res.compute_time[0] > 0 and res.comm_time[0] > 0
    assert set(res.bytes_per_level) == {"nvlink4", "ib-ndr-400g"}  # hierarchical allreduce
