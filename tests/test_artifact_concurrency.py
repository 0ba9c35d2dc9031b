"""The same artifact run twice at the same time: two ``partitioner run DIR --check`` processes
(ONNX Runtime backend, each under its own ``mpiexec -n 2``) both succeed, each output matches an
unpartitioned ONNX Runtime run of the model on that process's seeded inputs (rtol 1e-4,
atol 1e-5), and the artifact directory is byte-for-byte unchanged afterwards: no new, removed or
modified files (the artifact is read-only at run time; outputs go only where ``--outputs`` says).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from partitioner.compiler import compile as compile_artifact
from partitioner.core.bindings import seeded_inputs

SEEDS = (1, 2)


def _mlp() -> onnx.ModelProto:
    rng = np.random.default_rng(7)
    w1 = numpy_helper.from_array((rng.standard_normal((16, 32)) / 4).astype(np.float32), "w1")
    w2 = numpy_helper.from_array((rng.standard_normal((32, 8)) / 6).astype(np.float32), "w2")
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"]), helper.make_node("Relu", ["h"], ["r"]),
             helper.make_node("MatMul", ["r", "w2"], ["y"])]
    g = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 16])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 8])], [w1, w2])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _snapshot(root: Path) -> dict[str, tuple[str, int]]:
    """Every path under ``root`` -> (sha256 or '<dir>', permission bits)."""
    out = {}
    for p in sorted(root.rglob("*")):
        rel = str(p.relative_to(root))
        digest = "<dir>" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest()
        out[rel] = (digest, stat.S_IMODE(p.lstat().st_mode))
    return out


def _cli() -> list[str]:
    script = Path(sys.executable).parent / "partitioner"
    if script.exists():
        return [str(script)]
    found = shutil.which("partitioner")
    if not found:
        pytest.skip("the partitioner console script is not installed")
    return [found]


def _make_read_only(root: Path) -> None:
    for p in [root, *root.rglob("*")]:
        mode = stat.S_IMODE(p.stat().st_mode)
        p.chmod(mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))


def _make_writable(root: Path) -> None:
    for p in [root, *root.rglob("*")]:
        p.chmod(stat.S_IMODE(p.stat().st_mode) | stat.S_IWUSR)


def test_two_concurrent_runs_of_one_artifact(tmp_path: Path) -> None:
    mpiexec = Path(sys.executable).parent / "mpiexec"
    if not mpiexec.exists() and shutil.which("mpiexec") is None:
        pytest.skip("mpiexec not installed (pip install mpich)")
    model = _mlp()
    art_dir = tmp_path / "artifact"
    art = compile_artifact(model, "cpu:2", strategy="data", backend="onnxruntime", out_dir=art_dir)
    assert art.world_size == 2 and art.backend == "onnxruntime"
    _make_read_only(art_dir)  # a run that tries to write into the artifact fails (as non-root)
    before = _snapshot(art_dir)
    work = tmp_path / "cwd"
    work.mkdir()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = []
    try:
        for s in SEEDS:
            cmd = [*_cli(), "run", str(art_dir), "--check", "--seed", str(s),
                   "--outputs", str(tmp_path / f"out{s}.npz"), "--timeout", "120"]
            procs.append(subprocess.Popen(cmd, cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                          text=True))
        results = [p.communicate(timeout=180) for p in procs]
        after = _snapshot(art_dir)  # while still read-only: the modes must not have changed either
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        _make_writable(art_dir)
    for p, (out, err), s in zip(procs, results, SEEDS):
        assert p.returncode == 0, f"run with seed {s} failed ({p.returncode}): {err.strip()[-800:]}"
        assert "MISMATCH" not in out and "ok" in out, out

    # each run's outputs match ONNX Runtime on its own inputs (they differ between the runs)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    outs = []
    for s in SEEDS:
        feeds = seeded_inputs(art.bindings, s)
        (want,) = sess.run(["y"], feeds)
        with np.load(tmp_path / f"out{s}.npz", allow_pickle=False) as z:
            got = z["y"]
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5, err_msg=f"seed {s}")
        outs.append(got)
    assert not np.allclose(outs[0], outs[1]), "the two runs were meant to use different inputs"

    # the artifact is untouched (no stray files, nothing rewritten) and the runs wrote nothing to cwd
    assert after == before, (f"artifact changed: added {sorted(set(after) - set(before))}, removed "
                             f"{sorted(set(before) - set(after))}, modified "
                             f"{sorted(k for k in set(before) & set(after) if before[k] != after[k])}")
    assert list(work.iterdir()) == [], f"stray files in the working directory: {list(work.iterdir())}"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["artifact", "cwd", *(f"out{s}.npz" for s in SEEDS)])
