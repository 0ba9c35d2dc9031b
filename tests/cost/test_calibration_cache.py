"""The per-machine calibration cache (partitioner/calibrate_cache.py): ``cpu:N`` and ``--devices N``
plan with the cached, calibrated figures; the key names this machine and the backend; a broken
cache falls back to the nominal figures with one line; first-use calibration runs once.

Every test points ``PARTITIONER_CACHE_DIR`` at its own temporary folder, so none reads what this
machine has cached."""

from __future__ import annotations

import json
from pathlib import Path

import onnx
import pytest

import models_zoo
from partitioner import calibrate_cache, cli
from partitioner.calibrate import Calibration, cluster_from_calibration
from partitioner.cluster import Cluster, cpu_cluster
from partitioner.core.machine import cpu_model


def _calibration(gemm: float, backend: str = "tvm") -> Calibration:
    return Calibration(gemm_flops=gemm, gemm_n=512, memory_bandwidth=3e9, launch_overhead_s=7e-6,
                       alpha_s=3e-6, beta_s_per_byte=1e-9, pingpong=((8, 3e-6),), allreduce=(), mpi_ok=True,
                       seconds=1.0, machine={"cpu": cpu_model()}, backend=backend,
                       efficiency_by_class={"conv": 0.4, "gemm": 0.8})


def _cache(cal: Calibration) -> Path:
    return calibrate_cache.save_cached(cluster_from_calibration(cal, 1).to_json(), cal.to_json(), cal.backend)


@pytest.fixture(autouse=True)
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv(calibrate_cache.CACHE_DIR_ENV, str(tmp_path / "cache"))
    monkeypatch.setenv(calibrate_cache.AUTO_ENV, "0")
    return tmp_path / "cache"


def test_cpu_preset_reads_this_machines_calibration(cache_dir: Path) -> None:
    nominal = Cluster.resolve("cpu:3")
    assert "nominal" in nominal.notes
    path = _cache(_calibration(4e10))
    assert path.parent == cache_dir / "calibration"
    assert path.name == calibrate_cache.machine_key("tvm") + ".json"
    c = Cluster.resolve("cpu:3")
    assert c.name == "cpu:3" and c.size == 3 and "calibrated" in c.notes
    assert {d.peak("float32") for d in c.devices} == {4e10}
    d = c.devices[2]
    assert d.launch_overhead_s == 7e-6 and d.memory_bandwidth == 3e9
    assert d.efficiency_by_class == {"conv": 0.4, "gemm": 0.8}
    assert c.levels[0].alpha_s == 3e-6 and c.levels[0].beta_s_per_byte == 1e-9


def test_key_names_cpu_cores_threads_and_backend() -> None:
    key = calibrate_cache.machine_key("onnxruntime", threads=1)
    assert key.endswith("-1t-onnxruntime") and "c-1t" in key
    assert calibrate_cache.machine_key("tvm") != key
    _cache(_calibration(4e10, backend="onnxruntime"))
    # the onnxruntime calibration is not used for the tvm backend, and the reverse
    assert "nominal" in cpu_cluster(2, "tvm").notes
    assert cpu_cluster(2, "onnxruntime").devices[0].peak() == 4e10


def test_unreadable_cache_falls_back_with_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    path = calibrate_cache.cache_path("tvm")
    path.parent.mkdir(parents=True)
    path.write_text("{not json")
    c = Cluster.resolve("cpu:2")
    assert "nominal" in c.notes
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(path) in err[0] and "partitioner calibrate" in err[0]


def test_first_use_calibrates_once(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    calls: list[str] = []

    def run(backend: str) -> None:
        calls.append(backend)
        _cache(_calibration(5e10, backend))

    assert calibrate_cache.ensure_calibrated("tvm", run) is None  # turned off (the test setting)
    monkeypatch.setenv(calibrate_cache.AUTO_ENV, "1")
    doc = calibrate_cache.ensure_calibrated("tvm", run)
    assert calls == ["tvm"] and doc is not None and doc["key"] == calibrate_cache.machine_key("tvm")
    assert "calibrating this machine" in capsys.readouterr().err
    calibrate_cache.ensure_calibrated("tvm", run)
    assert calls == ["tvm"]  # cached: not again


def test_plan_predicts_with_the_cached_figures(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "mlp.onnx"
    onnx.save(models_zoo.build("mlp", batch=8, hidden=256, layers=3), path)

    def latency() -> float:
        capsys.readouterr()
        assert cli.main(["plan", str(path), "--devices", "1", "--strategy", "single", "--json"]) == 0
        return json.loads(capsys.readouterr().out)["prediction"]["latency_s"]

    nominal = latency()
    _cache(_calibration(1e9))  # a much slower calibrated core than any nominal one
    slow = latency()
    assert slow > 2 * nominal


def test_failed_first_use_calibration_is_not_retried(monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    calls: list[str] = []

    def broken(backend: str) -> None:
        calls.append(backend)
        raise RuntimeError("no compiler")

    monkeypatch.setenv(calibrate_cache.AUTO_ENV, "1")
    assert calibrate_cache.ensure_calibrated("tvm", broken) is None
    assert calibrate_cache.ensure_calibrated("tvm", broken) is None
    assert calls == ["tvm"]
    assert "calibration failed (no compiler)" in capsys.readouterr().err
    _cache(_calibration(5e10))  # `partitioner calibrate` succeeds: the marker goes
    assert not calibrate_cache.cache_path("tvm").with_suffix(".failed").exists()
