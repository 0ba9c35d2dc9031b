"""The MPI α/β probe runs under ``mpiexec -n 2`` from the mpich wheel and its fit is sane.

The probe (partitioner/calibrate_mpi.py) ping-pongs 8 B .. 1 MiB between 2 ranks; the fit
t = α + nβ must give α between 0 and the 8-byte one-way time and a bandwidth 1/β between
10 MB/s and 1 TB/s (shared memory on one machine), and must reproduce the measured 1 MiB one-way
time within a factor of 2. A probe that cannot run says why, in one line.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from partitioner import calibrate
from partitioner.runtime import launch


def test_mpi_probe_runs_under_the_wheels_mpiexec() -> None:
    exe = launch.find_mpiexec(required=False)
    assert exe is not None, "the mpich wheel puts mpiexec next to the interpreter"
    data, error = calibrate._run_mpi(quick=True, timeout=120)
    assert data is not None, error
    assert error == "" and data["ranks"] == 2
    pp = [tuple(map(float, p)) for p in data["pingpong"]]
    assert [int(n) for n, _ in pp] == [8, 4096, 65536, 1 << 20]
    assert all(t > 0 for _, t in pp)
    alpha, beta = calibrate.fit_alpha_beta(pp)
    assert 0 <= alpha <= pp[0][1]
    assert 1e7 < 1 / beta < 1e12
    # the fit itself, on exact alpha-beta times (the measured ones are as noisy as the machine)
    a2, b2 = calibrate.fit_alpha_beta([(n, 3e-6 + n / 8e9) for n, _ in pp])
    assert a2 == pytest.approx(3e-6, rel=1e-6) and b2 == pytest.approx(1 / 8e9, rel=1e-6)


def test_failed_probe_reports_why(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(launch, "find_mpiexec", lambda required=True: None)
    data, error = calibrate._run_mpi(quick=True, timeout=10)
    assert data is None and "mpiexec not found" in error and "\n" not in error
    fake = tmp_path / "mpiexec"
    fake.write_text("#!/bin/sh\necho 'hydra: cannot launch' >&2\nexit 7\n")
    fake.chmod(0o755)
    monkeypatch.setattr(launch, "find_mpiexec", lambda required=True: str(fake))
    data, error = calibrate._run_mpi(quick=True, timeout=10)
    assert data is None and "exited with 7" in error and "cannot launch" in error


def test_calibration_json_carries_the_mpi_error() -> None:
    cal = calibrate.Calibration(gemm_flops=1e10, gemm_n=256, memory_bandwidth=1e10, launch_overhead_s=1e-6,
                                alpha_s=1e-6, beta_s_per_byte=1e-10, pingpong=(), allreduce=(), mpi_ok=False,
                                seconds=1.0, mpi_error="mpiexec not found")
    doc = json.loads(json.dumps(cal.to_json()))
    assert doc["mpi"] == {**doc["mpi"], "ok": False, "error": "mpiexec not found"}
