"""The per-run call overhead (``Device.call_overhead_s``): calibration measures it, and the
simulator and the search estimate both charge it once per micro-batch on every rank, so they keep
agreeing (one prediction, one number) and a tiny model's many-micro-batch pipeline is no longer
predicted at a third of its measured step."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

import models_zoo
from partitioner.calibrate import call_overhead
from partitioner.cluster import Cluster, cpu_cluster
from partitioner.compiler import prepare
from partitioner.partition import partition

CALL = 50e-6


def _with_call(c: Cluster, call: float) -> Cluster:
    return Cluster(c.name, tuple(dataclasses.replace(d, call_overhead_s=call) for d in c.devices), c.nodes,
                   c.levels, c.notes)


@pytest.mark.parametrize("strategy, microbatches", [("single", 1), ("data", 1), ("pipeline", 4)])
def test_simulation_and_estimate_charge_one_call_per_microbatch(strategy: str, microbatches: int) -> None:
    model = prepare(models_zoo.build("mlp", batch=8))[0]
    base = cpu_cluster(1 if strategy == "single" else 2, "tvm")
    plain = partition(model, base, strategy=strategy, microbatches=microbatches if microbatches > 1 else None)
    slow = partition(model, _with_call(base, CALL), strategy=strategy,
                     microbatches=microbatches if microbatches > 1 else None)
    d_sim = slow.prediction["simulated"]["step_latency_s"] - plain.prediction["simulated"]["step_latency_s"]
    d_est = slow.prediction["search_estimate"]["latency_s"] - plain.prediction["search_estimate"]["latency_s"]
    m = plain.plan.microbatches
    # at least one call per micro-batch on the critical path, at most one per slot of the pipeline
    assert m * CALL * 0.99 <= d_sim <= (m + plain.plan.num_stages - 1) * CALL * 1.01, d_sim
    assert m * CALL * 0.99 <= d_est <= (m + plain.plan.num_stages - 1) * CALL * 1.01, d_est


def test_cluster_file_round_trips_call_overhead(tmp_path: Path) -> None:
    c = _with_call(cpu_cluster(2), 7e-6)
    c.save(tmp_path / "c.json")
    assert Cluster.load(tmp_path / "c.json").devices[1].call_overhead_s == 7e-6


def test_onnxruntime_call_overhead_is_measured(tmp_path: Path) -> None:
    # a real one-kernel session run: above zero, and far under a millisecond on any CPU
    call = call_overhead("onnxruntime", tmp_path, 0.0, quick=True)
    assert 0 < call < 1e-3
