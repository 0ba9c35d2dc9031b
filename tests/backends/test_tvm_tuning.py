"""MetaSchedule tuning (backends/tvm/tuning.py): database layout and keying (fast), and an end-to-end
tune of the zoo ``mlp`` checked against ONNX Runtime (slow; rtol 1e-4, atol 1e-5)."""

from __future__ import annotations

import time

import numpy as np
import onnxruntime as ort
import pytest

import tvm  # noqa: E402,F401  (a broken install fails, never skips)

import models_zoo  # noqa: E402
from backends.tvm import tuning  # noqa: E402
from backends.tvm.build import build  # noqa: E402
from backends.tvm.executable import load  # noqa: E402
from partitioner.core.errors import BackendError  # noqa: E402
from partitioner.runtime.comm_local import LocalWorld  # noqa: E402

RTOL, ATOL = 1e-4, 1e-5


def test_database_is_keyed_by_target(tmp_path):
    import tvm

    a = tvm.target.Target({"kind": "llvm", "mcpu": "znver4"})
    b = tvm.target.Target({"kind": "llvm", "mcpu": "haswell"})
    assert tuning.target_key(a) != tuning.target_key(b)
    assert tuning.target_key(a) == tuning.target_key(tvm.target.Target({"kind": "llvm", "mcpu": "znver4"}))
    tuning.open_database(tmp_path, tuning.tuning_target(a))
    assert (tuning.database_dir(tmp_path, tuning.tuning_target(a)) / "target.json").is_file()


def test_empty_database_reports_every_contraction_kernel_missing(tmp_path):
    import tvm

    from backends.tvm.lower import lower_program

    m = models_zoo.build("mlp", layers=2, hidden=32, in_features=16)
    target = tvm.target.Target({"kind": "llvm", "mcpu": "x86-64"})
    missing = tuning.missing_tasks(lower_program(m).mod, target, tmp_path)
    assert missing and all("matmul" in name for name in missing)


def test_tune_trials_without_database_is_an_error(tmp_path):
    m = models_zoo.build("mlp", layers=1, hidden=16, in_features=8)
    with pytest.raises(BackendError, match="tuning database"):
        build(m, tmp_path / "r.so", options={"tune_trials": 4})


@pytest.mark.slow
def test_tuned_mlp_matches_ort_and_reuses_database(tmp_path, monkeypatch):
    m = models_zoo.build("mlp")
    name = m.graph.input[0].name
    x = np.random.default_rng(0).standard_normal([d.dim_value for d in m.graph.input[0].type.tensor_type.shape.dim]).astype(np.float32)
    db = tmp_path / "db"

    facts = build(m, tmp_path / "a.so", options={"tune_trials": 64, "tuning_db": str(db)})
    assert facts["tuned"] and facts["tuning"]["untuned_kernels"] == []

    calls = []
    from tvm.s_tir import meta_schedule as ms

    monkeypatch.setattr(ms, "tune_tasks", lambda **kw: calls.append(kw))
    t0 = time.perf_counter()
    facts2 = build(m, tmp_path / "b.so", options={"tune_trials": 64, "tuning_db": str(db)})
    assert calls == [], "second compile tuned again instead of reusing the database"
    assert facts2["tuned"] and time.perf_counter() - t0 < 60

    sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    ref = sess.run(None, {name: x})
    ex = load(m, tmp_path / "b.so")
    got = ex.run({name: x}, LocalWorld(1).communicator(0))
    for r, o in zip(ref, m.graph.output):
        np.testing.assert_allclose(got[o.name], r, rtol=RTOL, atol=ATOL)


@pytest.mark.slow
def test_more_trials_top_up_the_database(tmp_path, monkeypatch):
    """Asking for 8 trials after 4 tunes each kernel 4 more times (starting from its records);
    asking for 8 again, or fewer, tunes nothing."""
    from tvm.s_tir import meta_schedule as ms

    m = models_zoo.build("mlp", layers=1, hidden=32, in_features=16)
    db = tmp_path / "db"
    real = ms.tune_tasks
    asked: list[tuple[int, int]] = []

    def spy(**kw):
        asked.append((len(kw["tasks"]), kw["max_trials_per_task"]))
        return real(**kw)

    monkeypatch.setattr(ms, "tune_tasks", spy)
    build(m, tmp_path / "a.so", options={"tune_trials": 4, "tuning_db": str(db)})
    (n_kernels, first), = asked
    assert first == 4 and n_kernels >= 1
    asked.clear()
    build(m, tmp_path / "b.so", options={"tune_trials": 8, "tuning_db": str(db)})
    assert asked == [(n_kernels, 4)]
    asked.clear()
    facts = build(m, tmp_path / "c.so", options={"tune_trials": 8, "tuning_db": str(db)})
    build(m, tmp_path / "d.so", options={"tune_trials": 2, "tuning_db": str(db)})
    assert asked == [] and facts["tuned"]
    counts = tuning._trials_done(db, tuning.tuning_target(__import__("tvm").target.Target(facts["target"])))
    assert len(counts) == n_kernels and set(counts.values()) == {8}
