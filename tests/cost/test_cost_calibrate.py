"""Calibration: the α/β fit on known data, the cluster it builds, and (slow) the real CLI run."""

from __future__ import annotations

import json

import pytest

from partitioner.calibrate import Calibration, cluster_from_calibration, fit_alpha_beta
from partitioner.cluster import Cluster


def test_fit_recovers_exact_alpha_beta():
    # t = 2 µs + n / 4 GB/s
    pts = [(n, 2e-6 + n * 2.5e-10) for n in (8, 1024, 65536, 1 << 20, 4 << 20)]
    alpha, beta = fit_alpha_beta(pts)
    assert alpha == pytest.approx(2e-6, rel=1e-6)
    assert beta == pytest.approx(2.5e-10, rel=1e-6)


def test_fit_weights_relative_error():
    # a 10% error on the largest message must not swamp α (weighted by 1/t)
    pts = [(8, 3e-6), (4096, 3e-6 + 4096e-9), (1 << 20, 1.1 * (3e-6 + (1 << 20) * 1e-9))]
    alpha, _ = fit_alpha_beta(pts)
    assert 1e-6 < alpha < 5e-6


def test_cluster_from_calibration_round_trips(tmp_path):
    cal = Calibration(gemm_flops=1e11, gemm_n=512, memory_bandwidth=1.5e10, launch_overhead_s=1e-6,
                      alpha_s=2e-6, beta_s_per_byte=4e-10, pingpong=((8, 2e-6),), allreduce=(),
                      mpi_ok=True, seconds=1.0, machine={"cpu": "test"})
    c = cluster_from_calibration(cal, 3)
    assert c.size == 3 and c.devices[2].peak("float32") == 1e11
    assert c.levels[0].alpha_s == 2e-6 and c.levels[0].beta_s_per_byte == 4e-10
    c.save(tmp_path / "c.json")
    assert Cluster.resolve(str(tmp_path / "c.json")) == c
    json.dumps(cal.to_json())


@pytest.mark.slow
def test_calibrate_cli_quick(tmp_path, monkeypatch, capsys):
    from partitioner.cli import main

    monkeypatch.setenv("PARTITIONER_CALIBRATION", str(tmp_path / "local.json"))
    assert main(["calibrate", "--quick", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    cal = doc["calibration"]
    assert 1e9 < cal["gemm_flops_per_core"] < 1e13  # between 1 GFLOP/s and 10 TFLOP/s per core
    assert 1e8 < cal["memory_bandwidth_per_core"] < 1e12
    # the FMA loop is the limit: no GEMM (numpy's best run) beats it by more than timing noise
    assert cal["fma_peak_flops_per_core"] > 0.8 * cal["gemm_flops_per_core"]
    assert 1e8 < cal["stream_bandwidth_per_core"] < 1e12
    assert cal["seconds"] < 60  # TVM micro-kernels compile and run inside the budget
    assert cal["backend"] == "tvm" and 0 < cal["efficiency_by_class"]["conv"] <= 16
    local = Cluster.resolve("local")
    assert local.name == "local" and local.devices[0].peak() == pytest.approx(cal["gemm_flops_per_core"])
    assert cal["mpi"]["ok"], cal["mpi"].get("error")  # the mpich wheel's mpiexec is installed
    # the α-β model predicts the measured 2-rank allreduce of 1 MiB within a factor of 2
    from partitioner.cost.comm import allreduce_time

    n, measured = [p for p in cal["mpi"]["allreduce"] if p[0] == 1 << 20][0]
    predicted, _ = allreduce_time(n, 2, local.levels[0])
    assert 0.5 < predicted / measured < 2.0
