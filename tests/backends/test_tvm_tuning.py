"""MetaSchedule tuning (backends/tvm/tuning.py): database layout and keying, the never-worse rule
(a forced slower record loses to the default schedule), budgets and resumes (fast), and an
end-to-end tune of the zoo ``mlp`` checked against ONNX Runtime (slow; rtol 1e-4, atol 1e-5)."""

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


def _matmul_model(m: int = 64, k: int = 256, n: int = 256):
    import onnx
    from onnx import helper as h, numpy_helper

    w = np.random.default_rng(0).standard_normal((k, n)).astype(np.float32)
    g = h.make_graph([h.make_node("MatMul", ["x", "w"], ["y"])], "mm",
                     [h.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [m, k])],
                     [h.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [m, n])],
                     [numpy_helper.from_array(w, "w")])
    return h.make_model(g, opset_imports=[h.make_opsetid("", 17)])


def _host_tasks(m, db):
    import tvm

    from backends.tvm.lower import lower_program
    from backends.tvm.target import target_dict

    target = tuning.tuning_target(tvm.target.Target(target_dict(None)))
    prepared, _ = tuning.prepare_for_database(lower_program(m).mod, target, db)
    return target, tuning.extract_tasks(prepared, target)


def _force_unscheduled_record(db, task, target, tag: int = 1):
    """A record claiming 1 ns whose schedule is the unscheduled kernel (serial scalar loops; an
    annotation only: MetaSchedule ignores records with an empty trace)."""
    from tvm import s_tir
    from tvm.s_tir import meta_schedule as ms

    sch = s_tir.Schedule(task.dispatched[0])
    sch.annotate(sch.get_sblock(task.task_name, "main"), "forced", tag)
    db.commit_tuning_record(ms.database.TuningRecord(sch.trace, db.commit_workload(task.dispatched[0]), [1e-9], target,
                                                     ms.arg_info.ArgInfo.from_prim_func(task.dispatched[0]["main"])))


def _check_against_ort(m, so):
    x = np.random.default_rng(1).standard_normal((64, 256)).astype(np.float32)
    ref = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    got = load(m, so).run({"x": x}, LocalWorld(1).communicator(0))["y"]
    np.testing.assert_allclose(got, ref, rtol=RTOL, atol=ATOL)


def test_never_worse_keeps_the_default_where_the_tuned_record_is_slower(tmp_path, monkeypatch):
    """Rule 6: the database's best (a forced unscheduled matmul, ~20x slower than the packed GEMM)
    is timed against the default schedule, recorded as slower, and the build keeps the default;
    with the rule off the record is applied. Both builds match ONNX Runtime."""
    m = _matmul_model()
    db_dir = tmp_path / "db"
    target, (task,) = _host_tasks(m, db_dir)
    db = tuning.open_database(db_dir, target)
    _force_unscheduled_record(db, task, target)
    entry = tuning.compare_kernel(task, target, db_dir, db)
    assert entry["use"] == "default" and entry["tuned_us"] > entry["default_us"], entry
    assert tuning.comparisons(db_dir, target)[tuning._task_key(task)]["use"] == "default"

    facts = build(m, tmp_path / "kept.so", options={"tuning_db": str(db_dir)})
    assert facts["tuning"]["default_kept_kernels"] == ["matmul"] and not facts["tuned"]
    _check_against_ort(m, tmp_path / "kept.so")

    monkeypatch.setattr(tuning, "NEVER_WORSE", False)
    facts = build(m, tmp_path / "forced.so", options={"tuning_db": str(db_dir)})
    assert facts["tuned"] and facts["tuning"]["default_kept_kernels"] == []
    _check_against_ort(m, tmp_path / "forced.so")


def test_killed_run_is_topped_up_from_its_records(tmp_path, monkeypatch):
    """Rule 4: records without a count in trials.json (a run killed mid-way) count as the trials
    they are, not as a finished kernel."""
    m = _matmul_model(8, 32, 32)
    db_dir = tmp_path / "db"
    target, (task,) = _host_tasks(m, db_dir)
    db = tuning.open_database(db_dir, target)
    for tag in range(3):
        _force_unscheduled_record(db, task, target, tag)
    asked: list[tuple[int, int]] = []
    # a stand-in for MetaSchedule's search (its first call imports tensor intrinsics: minutes)
    monkeypatch.setattr(tuning, "_run_metaschedule", lambda ms, tasks, n, *a: asked.append((len(tasks), n)))
    monkeypatch.setattr(tuning, "NEVER_WORSE", False)
    tuning.tune_tasks_to([task], target, 8, db_dir, progress=False)
    assert asked == [(1, 5)]
    assert tuning._trials_done(db_dir, target) == {tuning._task_key(task): 8}


def test_budget_tunes_the_largest_kernel_first_stops_and_resumes(tmp_path, monkeypatch):
    """Rule 7: with 0.02 s/trial on record and a 2 s budget, the kernel with the most FLOPs x
    occurrences gets its 32 trials (the stand-in tuner takes 2 s), then the run stops with the
    counts written; the plan reports the rest, and a run without a budget tunes only the rest."""
    import json

    m = models_zoo.build("mlp", layers=2, hidden=32, in_features=16)
    db_dir = tmp_path / "db"
    target, tasks = _host_tasks(m, db_dir)
    assert len(tasks) >= 2
    tuning.open_database(db_dir, target)
    (tuning.database_dir(db_dir, target) / tuning.TIME_FILE).write_text(json.dumps({"seconds": 20.0, "trials": 1000}))
    asked: list[list[str]] = []

    def stand_in(ms, tasks, n, *a):  # MetaSchedule's search, taking 2 s
        asked.append([t.task_name for t in tasks])
        assert n == 32
        time.sleep(2.0)

    monkeypatch.setattr(tuning, "_run_metaschedule", stand_in)
    largest = max(tasks, key=lambda t: tuning.task_flops(t) * int(t.weight))
    out = tuning.tune_tasks_to(tasks, target, 32, db_dir, progress=False, budget_s=2.0)
    assert out["stopped_by_budget"] and out["tuned"] == [tuning._task_key(largest)]
    assert tuning._trials_done(db_dir, target) == {tuning._task_key(largest): 32}
    p = tuning.plan([("mlp", t) for t in tasks], target, 32, db_dir)
    assert p["tasks"] == len(tasks) and p["trials_left"] == 32 * (len(tasks) - 1)
    assert p["kernels"][0]["key"] == tuning._task_key(largest) and p["kernels"][0]["trials_done"] == 32
    assert p["s_per_trial_source"].startswith("measured")
    asked.clear()
    tuning.tune_tasks_to(tasks, target, 32, db_dir, progress=False)
    assert len(asked) == 1 and len(asked[0]) == len(tasks) - 1


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
