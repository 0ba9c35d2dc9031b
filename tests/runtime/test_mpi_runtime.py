"""The MPI runtime end to end: ``partitioner run`` starts mpiexec with 2 ranks.

Every numeric check compares against ONNX Runtime on the unpartitioned source model (``--check``,
rtol 1e-4, atol 1e-5) or against numpy computed here. Each test starts one mpiexec (about 1-2 s);
the default set keeps that count small, the rest is marked slow.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import pytest

sys.path.insert(0, str(Path(__file__).parent))
import rank_programs as rp  # noqa: E402

from partitioner import cli  # noqa: E402
from partitioner.compiler import build_artifact  # noqa: E402
from partitioner.core.errors import RunFailed  # noqa: E402
from partitioner.runtime.launch import find_mpiexec  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def _worker_procs(path: Path) -> list[psutil.Process]:
    found = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if "partitioner.runtime.worker" in cmd and str(path) in cmd:
            found.append(p)
    return found


def _build(tmp_path: Path, name: str, fn, **kw):
    src, progs, bind = fn(**kw)
    return build_artifact(tmp_path / name, progs, bind, source=src, backend="onnxruntime")


@pytest.fixture
def inputs_npz(tmp_path: Path) -> Path:
    path = tmp_path / "in.npz"
    np.savez(path, **rp.inputs())
    return path


@pytest.mark.parametrize("builder", ["data_parallel", "pipeline", "tensor_parallel"])
def test_run_check_passes(builder, tmp_path, inputs_npz, capsys):
    art = _build(tmp_path, builder, getattr(rp, builder))
    out = tmp_path / "out.npz"
    rc = cli.main(["run", str(art.root), "--inputs", str(inputs_npz), "--outputs", str(out), "--check", "--json"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    doc = json.loads(captured.out)
    assert doc["check"]["ok"] and all(o["max_abs"] <= 1e-5 + 1e-4 for o in doc["check"]["outputs"])
    with np.load(out, allow_pickle=False) as got:
        # the in-process oracle (threads, same reductions in group order) gives bit-identical results
        oracle = art.run(rp.inputs(), in_process=True).outputs
        for name in oracle:
            np.testing.assert_array_equal(got[name], oracle[name])
    assert not _worker_procs(art.root)


def test_collectives_against_numpy(tmp_path):
    art = _build(tmp_path, "coll", rp.collectives)
    x = np.random.default_rng(3).standard_normal((4, 8)).astype(np.float32)
    got = art.run({"x": x}).outputs
    for name, want in rp.collectives_expected(x).items():
        np.testing.assert_array_equal(got[name], want, err_msg=name)


def test_relocated_artifact_runs_under_user_mpiexec(tmp_path, inputs_npz):
    """Copy the artifact elsewhere and run the worker under our own mpiexec (`partitioner worker`)."""
    art = _build(tmp_path, "pp", rp.pipeline, microbatches=4)
    moved = tmp_path / "moved" / "pp"
    shutil.copytree(art.root, moved)
    shutil.rmtree(art.root)
    out = tmp_path / "out.npz"
    cmd = [find_mpiexec(), "-n", "2", sys.executable, "-m", "partitioner.cli", "worker", str(moved),
           "--inputs", str(inputs_npz), "--outputs", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    w = rp.weights()
    x = rp.inputs()["x"]
    want = np.maximum(x @ w["W1"], 0) @ w["W2"]
    with np.load(out, allow_pickle=False) as got:
        np.testing.assert_allclose(got["y"], want, rtol=1e-4, atol=1e-5)


def _faulty_run(art, fault: str, monkeypatch, timeout_env: str = "10") -> tuple[float, str]:
    monkeypatch.setenv("PARTITIONER_FAULT", fault)
    monkeypatch.setenv("PARTITIONER_COMM_TIMEOUT", timeout_env)
    t0 = time.monotonic()
    with pytest.raises(RunFailed) as info:
        art.run(rp.inputs(), timeout=120)
    elapsed = time.monotonic() - t0
    assert info.value.exit_code == 1
    assert not _worker_procs(art.root), "worker processes survived the failed run"
    return elapsed, str(info.value)


def test_raise_on_rank1_ends_fast_naming_rank1(tmp_path, inputs_npz, monkeypatch, capsys):
    art = _build(tmp_path, "pp", rp.pipeline)
    monkeypatch.setenv("PARTITIONER_FAULT", "rank:1,at:recv,kind:raise")
    t0 = time.monotonic()
    rc = cli.main(["run", str(art.root), "--inputs", str(inputs_npz)])
    elapsed = time.monotonic() - t0
    err = capsys.readouterr().err
    assert rc == 1
    assert "rank 1" in err and "recv" in err and "Traceback" not in err
    assert elapsed < 5 + 10, elapsed  # 5 s to end every rank, plus mpiexec start-up on a busy machine (the timeout is 10 s + 120 s)
    assert not _worker_procs(art.root)


@pytest.mark.parametrize("kind", ["kill", "exit"])
def test_rank1_dies_run_ends_without_orphans(kind, tmp_path, monkeypatch):
    art = _build(tmp_path, "pp", rp.pipeline)
    elapsed, msg = _faulty_run(art, f"rank:1,at:recv,kind:{kind}", monkeypatch)
    assert elapsed < 30, elapsed
    assert "rank" in msg


def test_overall_timeout_kills_everything(tmp_path, monkeypatch):
    art = _build(tmp_path, "hang", rp.hanging)
    monkeypatch.setenv("PARTITIONER_COMM_TIMEOUT", "120")
    t0 = time.monotonic()
    with pytest.raises(RunFailed, match="timed out after 4 s"):
        art.run(rp.inputs(), timeout=4)
    assert time.monotonic() - t0 < 15
    assert not _worker_procs(art.root)


def test_bench_writes_json(tmp_path, capsys):
    art = _build(tmp_path, "tp", rp.tensor_parallel)
    out = tmp_path / "bench.json"
    assert cli.main(["bench", str(art.root), "--repeat", "3", "--warmup", "1", "-o", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert {"machine", "versions", "settings", "results", "ratios"} <= set(doc)
    part = doc["results"]["partitioned"]
    assert part["ranks"] == 2 and len(part["times_s"]) == 3 and part["median_s"] > 0
    assert doc["results"]["onnxruntime"]["threads"] == part["threads"]
    assert doc["ratios"]["onnxruntime_over_partitioned"] == pytest.approx(
        doc["results"]["onnxruntime"]["median_s"] / part["median_s"])
    assert "partitioned" in capsys.readouterr().out


# --- slow: more mpiexec runs -------------------------------------------------------------------


@pytest.mark.slow
def test_comm_timeout_names_the_waiting_rank(tmp_path, monkeypatch):
    art = _build(tmp_path, "hang", rp.hanging)
    monkeypatch.setenv("PARTITIONER_COMM_TIMEOUT", "2")
    with pytest.raises(RunFailed, match="timed out after 2 s"):
        art.run(rp.inputs(), timeout=60)
    assert not _worker_procs(art.root)


@pytest.mark.slow
def test_wrong_world_size_under_user_mpiexec(tmp_path, inputs_npz):
    art = _build(tmp_path, "pp", rp.pipeline)
    cmd = [find_mpiexec(), "-n", "3", sys.executable, "-m", "partitioner.runtime.worker", str(art.root),
           "--inputs", str(inputs_npz)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode != 0 and "built for 2 ranks" in proc.stderr


@pytest.mark.slow
def test_nondeterministic_reduce_still_matches(tmp_path):
    from partitioner.runtime.launch import run_artifact

    art = _build(tmp_path, "coll", rp.collectives)
    x = np.random.default_rng(4).standard_normal((4, 8)).astype(np.float32)
    got = run_artifact(art, {"x": x}, extra_worker_args=["--nondeterministic-reduce"]).outputs
    for name, want in rp.collectives_expected(x).items():
        np.testing.assert_allclose(got[name], want, rtol=1e-6, atol=1e-6, err_msg=name)


@pytest.mark.slow
def test_repeated_runs_are_bit_identical(tmp_path):
    art = _build(tmp_path, "tp", rp.tensor_parallel)
    a = art.run(rp.inputs()).outputs
    b = art.run(rp.inputs()).outputs
    for name in a:
        np.testing.assert_array_equal(a[name], b[name])


@pytest.mark.slow
def test_tampered_rank_file_refused_by_worker(tmp_path, inputs_npz):
    art = _build(tmp_path, "pp", rp.pipeline)
    data = bytearray((art.root / "rank1.onnx").read_bytes())
    data[30] ^= 1
    (art.root / "rank1.onnx").write_bytes(bytes(data))
    cmd = [find_mpiexec(), "-n", "2", sys.executable, "-m", "partitioner.runtime.worker", str(art.root),
           "--inputs", str(inputs_npz)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT, env=dict(os.environ))
    assert proc.returncode != 0 and "rank1.onnx" in proc.stderr
