"""The fixed runtime costs of a step (``cost/runtime_overhead.py``): per comm op, per step, and a
rank's threads per op class. The simulator and the search estimate charge the same numbers, and
calibration measures them on this machine."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

import models_zoo
from partitioner.calibrate import comm_op_overhead, thread_efficiency
from partitioner.cluster import Cluster, cpu_cluster
from partitioner.compiler import prepare
from partitioner.core.errors import ClusterError
from partitioner.cost.ops import COMM_DOMAIN
from partitioner.cost.runtime_overhead import rank_overhead, step_overheads, step_sync
from partitioner.cost.threads import THREAD_EFFICIENCY, class_thread_speedup
from partitioner.partition import partition

COMM_OP = 40e-6


def _with(c: Cluster, **changes: object) -> Cluster:
    return Cluster(c.name, tuple(dataclasses.replace(d, **changes) for d in c.devices), c.nodes, c.levels, c.notes)


def _comm_ops(res) -> list[int]:
    return [sum(1 for n in m.graph if n.domain == COMM_DOMAIN) for m in res.models]


@pytest.mark.parametrize("strategy, microbatches", [("data", 1), ("pipeline", 4), ("tensor", 1)])
def test_comm_op_overhead_is_charged_once_per_comm_op_and_micro_batch(strategy: str, microbatches: int) -> None:
    model = prepare(models_zoo.build("mlp", batch=8))[0]
    base = cpu_cluster(2, "tvm")
    mb = microbatches if microbatches > 1 else None
    plain = partition(model, base, strategy=strategy, microbatches=mb)
    slow = partition(model, _with(base, comm_op_overhead_s=COMM_OP), strategy=strategy, microbatches=mb)
    m = plain.plan.microbatches
    ops = _comm_ops(slow)
    # the simulator: every rank's compute grows by exactly one charge per comm op it runs
    for r, n in enumerate(ops):
        grew = slow.simulation.compute_time[r] - plain.simulation.compute_time[r]
        assert grew == pytest.approx(m * n * COMM_OP, rel=1e-6), (r, n)
    d_sim = slow.prediction["simulated"]["step_latency_s"] - plain.prediction["simulated"]["step_latency_s"]
    d_est = slow.prediction["search_estimate"]["latency_s"] - plain.prediction["search_estimate"]["latency_s"]
    if max(ops) == 0:  # nothing to charge (a plan without communication)
        assert d_sim == pytest.approx(0.0, abs=1e-12)
        return
    # the step grows by at least the busiest rank's per-micro-batch charges on its path, at most
    # by every slot of the pipeline paying the busiest rank's charges; the estimate likewise
    low, high = m * COMM_OP * 0.99, (m + plain.plan.num_stages - 1) * max(ops) * COMM_OP * 1.01
    assert low <= d_sim <= high, (d_sim, ops)
    assert low <= d_est <= high, (d_est, ops)


def test_step_ends_with_a_barrier_of_the_link_alpha() -> None:
    c = cpu_cluster(2, "tvm")
    alpha = c.levels[0].alpha_s
    assert step_sync(c, 1) == 0.0
    assert step_sync(c, 2) == pytest.approx(alpha)  # a 0-byte allreduce of 2 ranks: one α
    model = prepare(models_zoo.build("mlp", batch=8))[0]
    res = partition(model, c, strategy="data")
    sim = res.simulation
    assert sim.step_latency == pytest.approx(max(sim.compute_time) + alpha, rel=1e-6)
    o = step_overheads(c, 2)
    assert o.step_sync_s == pytest.approx(alpha) and o.call_s == c.devices[0].call_overhead_s
    assert rank_overhead(c.devices[0], 4, 2) == pytest.approx(4 * (o.call_s + 2 * o.comm_op_s))


def test_threads_speed_up_only_the_classes_that_use_them() -> None:
    dev = dataclasses.replace(cpu_cluster(1).devices[0], thread_efficiency_by_class={"gemm": 1.0, "elementwise": 0.0})
    assert class_thread_speedup(dev, "gemm", 2) == 2.0
    assert class_thread_speedup(dev, "elementwise", 4) == 1.0
    assert class_thread_speedup(dev, "conv", 2) == pytest.approx(1 + THREAD_EFFICIENCY)  # not listed: nominal
    assert class_thread_speedup(dev, "gemm", 1) == 1.0
    # a 1-rank plan on 2 cores: a MatMul-only model halves, an elementwise-only model does not move
    base = cpu_cluster(2, "tvm")
    flat = _with(base, thread_efficiency_by_class={"gemm": 1.0, "elementwise": 0.0}, call_overhead_s=0.0,
                 launch_overhead_s=0.0)
    none = _with(flat, thread_efficiency_by_class={"gemm": 0.0, "elementwise": 0.0})
    gemm = prepare(models_zoo.build("mlp", batch=64, layers=2, hidden=256, in_features=256, out_features=256))[0]
    t_par = partition(gemm, flat, strategy="single").simulation.compute_time[0]
    t_one = partition(gemm, none, strategy="single").simulation.compute_time[0]
    assert t_par < 0.75 * t_one  # the MatMuls dominate and run on both threads


def test_cluster_file_round_trips_the_new_figures(tmp_path: Path) -> None:
    c = _with(cpu_cluster(2), comm_op_overhead_s=3e-6, thread_efficiency_by_class={"gemm": 0.9, "norm": 0.0})
    c.save(tmp_path / "c.json")
    d = Cluster.load(tmp_path / "c.json").devices[1]
    assert d.comm_op_overhead_s == 3e-6 and d.thread_efficiency_by_class == {"gemm": 0.9, "norm": 0.0}
    bad = tmp_path / "bad.json"
    bad.write_text((tmp_path / "c.json").read_text().replace('"gemm": 0.9', '"gemm": 1.5'))
    with pytest.raises(ClusterError, match="thread_efficiency_by_class"):
        Cluster.load(bad)


def test_thread_efficiency_rule() -> None:
    one = {"g1": 2.0, "g2": 8.0, "e1": 1.0, "x": 1.0}
    many = {"g1": 1.0, "g2": 4.0, "e1": 1.2, "x": 0.5}
    eff = thread_efficiency(one, many, {"g1": "gemm", "g2": "gemm", "e1": "elementwise"}, 2)
    assert eff == {"gemm": pytest.approx(1.0), "elementwise": 0.0}  # slower on 2 threads: clamped to 0
    assert thread_efficiency(one, many, {"g1": "gemm"}, 1) == {}


def test_onnxruntime_comm_op_overhead_is_measured(tmp_path: Path) -> None:
    # a real chain of sessions split by one-rank AllReduces: above zero, far under a millisecond
    t = comm_op_overhead("onnxruntime", tmp_path, 0.0, quick=True)
    assert 0 < t < 1e-3


@pytest.mark.slow
def test_tvm_comm_op_overhead_is_measured(tmp_path: Path) -> None:
    t = comm_op_overhead("tvm", tmp_path, 0.0, quick=True)
    assert 0 < t < 1e-3


def test_thread_probe_waits_for_free_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    # a parallel speed-up measured while other work holds the cores measures that work
    from partitioner import calibrate as cal

    monkeypatch.setattr(cal.os, "getloadavg", lambda: (6.0, 6.0, 6.0))
    assert not cal._cores_free(2)
    monkeypatch.setattr(cal.os, "getloadavg", lambda: (1.0, 1.0, 1.0))
    assert cal._cores_free(2) and not cal._cores_free(1)
