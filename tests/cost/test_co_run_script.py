"""``benchmarks/co_run.py``: per-core speed alone against all cores busy, one process per core."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="compares one core with two")
def test_the_script_writes_a_share_per_round_for_each_kind(tmp_path) -> None:
    """A short real run (2 rounds of 0.05 s): every round has a lone rate, one rate per core
    together and their ratio; the median share is one of the rounds' values' median."""
    out = tmp_path / "co_run.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "co_run.py"), "--rounds", "2", "--seconds", "0.05",
           "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT, check=False)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(out.read_text())
    assert set(doc["kinds"]) == {"gemm", "copy"}
    for kind in doc["kinds"].values():
        assert len(kind["rounds"]) == 2
        for r in kind["rounds"]:
            assert r["alone"] > 0 and len(r["together"]) == len(doc["cpus"]) >= 2
            assert r["share"] == pytest.approx(sum(r["together"]) / len(r["together"]) / r["alone"], abs=2e-3)
        assert kind["median_share"] == pytest.approx(sum(r["share"] for r in kind["rounds"]) / 2)


@pytest.mark.parametrize("args", [["--kinds", "gemm,disk"], ["--rounds", "0"], ["--seconds", "-1"],
                                  ["--sweep", "0"], ["--sweep", "two"]])
def test_bad_arguments_are_one_line_and_exit_2(args, tmp_path) -> None:
    cmd = [sys.executable, str(ROOT / "benchmarks" / "co_run.py"), *args, "--json", str(tmp_path / "x.json")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT, check=False)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert not (tmp_path / "x.json").exists()


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="compares one core with two")
def test_the_sweep_runs_probe_7_per_size(tmp_path) -> None:
    """``--sweep``: one row per size, each with the probe's 7 rounds, all physical ratios, and the
    row's median the median of its rounds."""
    out = tmp_path / "sweep.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "co_run.py"), "--sweep", "2,64", "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT, check=False)
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(out.read_text())["sweep"]
    assert [r["moved_mib"] for r in rows] == [2.0, 64.0]
    for r in rows:
        assert len(r["shares"]) == 7 and all(0.05 < x < 3 for x in r["shares"])
        assert r["median_share"] == sorted(r["shares"])[3]
