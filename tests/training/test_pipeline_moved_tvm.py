"""Pipeline rule 12 on TVM by default (:mod:`partitioner.training.moved_wgrad`, ``MOVE_BY_BACKEND``)
with rule 6's extra warm-up (``WARMUP_WHEN_MOVED``): the plan a TVM build gets, and its TVM stages
against 1 rank (10 SGD steps, weights and losses within rtol 1e-4, atol 1e-5)."""

from __future__ import annotations

import numpy as np
import pytest

import models_zoo
from partitioner.runtime.comm_local import LocalWorld
from partitioner.training import SGD, build_training_graph, measured_cut, moved_wgrad
from partitioner.training.pipeline import build_pipeline
from partitioner.training.pipeline_runner import PipelineRunner, gathered_state
from partitioner.training.runner import StepRunner
from tests.training.test_pipeline_split_cut import _seconds
from tests.training.test_pipeline_training import _run_pipeline

TOL = {"rtol": 1e-4, "atol": 1e-5}


def _plan(backend: str, monkeypatch, schedule: str = "1f1b"):
    """The 2|2 cut of a 4-layer mlp 64 wide (whatever the machine), the knobs at their defaults
    whatever the environment says."""
    monkeypatch.setattr(moved_wgrad, "MOVE_WEIGHT_GRADIENT", None)
    monkeypatch.setattr(measured_cut, "shared_node_seconds", _seconds)
    model = models_zoo.build("mlp", batch=8, layers=4, hidden=64, in_features=16)
    return model, build_pipeline(model, "cross_entropy", SGD(lr=0.1), batch=8, stages=2, micro_batches=4,
                                 schedule=schedule, backend=backend)


def test_tvm_plans_move_columns_and_warm_up_once_more(monkeypatch) -> None:
    """A TVM 1F1B plan moves half of fc2's weight-gradient columns to stage 0 and runs one extra
    warm-up forward there (rule 6; TVM's own ``EXTRA_WARMUP_BY_BACKEND`` is 0); GPipe moves them
    without a warm-up; an ONNX Runtime plan moves nothing. Fails with ``MOVE_BY_BACKEND["tvm"]``
    off (``moved`` is None) or ``WARMUP_WHEN_MOVED`` = 0 (``extra_warmup`` 0)."""
    monkeypatch.setattr("partitioner.training.pipeline.EXTRA_WARMUP", None)
    _, plan = _plan("tvm", monkeypatch)
    first, last = plan.stages
    assert last.moved is not None and first.moved is not None
    assert (last.moved.weight, last.moved.kept) == ("fc2.weight", 32)
    assert plan.extra_warmup == 1
    _, gpipe = _plan("tvm", monkeypatch, "gpipe")
    assert gpipe.stages[-1].moved is not None and gpipe.extra_warmup == 0
    _, ort = _plan("onnxruntime", monkeypatch)
    assert ort.stages[-1].moved is None and ort.stages[0].moved is None


def test_memory_limit_keeps_the_plans_warm_up(monkeypatch) -> None:
    """Rule 6 does not raise the warm-up of a plan built under a memory limit (its stash was sized
    by the memory DP)."""
    from types import SimpleNamespace

    calls = []
    plan = SimpleNamespace(num_stages=2, recompute=False, parts={}, schedule="1f1b", extra_warmup=0,
                           stages=[SimpleNamespace(moved=None), SimpleNamespace(moved=object())])
    monkeypatch.setattr(moved_wgrad, "MOVE_WEIGHT_GRADIENT", None)
    monkeypatch.setattr(moved_wgrad, "_move", calls.append)
    moved_wgrad.apply(plan, "tvm", memory_limit=1e9)
    assert calls == [plan] and plan.extra_warmup == 0
    moved_wgrad.apply(plan, "tvm")
    assert plan.extra_warmup == moved_wgrad.WARMUP_WHEN_MOVED == 1


@pytest.mark.slow
def test_tvm_stages_with_moved_columns_match_one_rank(tmp_path, monkeypatch) -> None:
    """The default TVM plan (moved columns, one extra warm-up) on 2 TVM stages in threads: 10 SGD
    steps against a 1-rank ONNX Runtime step, losses and every gathered weight within TOL."""
    monkeypatch.setattr("partitioner.training.pipeline.EXTRA_WARMUP", None)
    model, plan = _plan("tvm", monkeypatch)
    assert plan.stages[-1].moved is not None and plan.extra_warmup == 1
    rng = np.random.default_rng(5)
    batches = [(rng.standard_normal((8, 16)).astype(np.float32), rng.integers(0, 10, 8)) for _ in range(10)]
    one = StepRunner(build_training_graph(model, optimizer=SGD(lr=0.1)))
    one_losses = [one.step({"input": x}, y) for x, y in batches]
    world = LocalWorld(2, timeout_s=120)
    runners = [PipelineRunner(plan, s, comm=world.communicator(s), backend="tvm", workdir=tmp_path)
               for s in range(2)]
    np.testing.assert_allclose(_run_pipeline(runners, batches), one_losses, **TOL)
    assert runners[0].peak_stash == 3  # S - s + e = 2 + 1 on stage 0
    full = gathered_state(runners)
    assert set(full) == set(one.state)
    for name, w in one.state.items():
        np.testing.assert_allclose(full[name], w, err_msg=name, **TOL)


def test_moved_seed_keeps_the_stage_weights_liftable(monkeypatch) -> None:
    """Rule 3's new inputs (the seed) go before the stage's step constants (hoist rule 7), so the
    TVM build still lifts the first stage's weight-only kernels out of its ``B`` (``lift_step_constants``
    rule 1 wants the constants last), and so does the running-sum rewrite (pipeline_runner rule 13).
    Fails with ``lift_step_constants.KEEP_LAST`` off: the seed was appended after the constants and
    ``B`` repacked the weight on every micro-batch."""
    from backends.tvm.lift_step_constants import marked_step_constants, step_constant_inputs
    from partitioner.training import hoist
    from partitioner.training.pipeline_runner import accumulating

    monkeypatch.setattr(hoist, "LIFT_MIN_BYTES", 0)
    _, plan = _plan("tvm", monkeypatch)
    first = plan.stages[0]
    backward = first.backward
    names = [v.name for v in backward.graph.input]
    assert first.moved is not None and first.moved.seed in names
    marked = marked_step_constants(backward)
    assert marked and step_constant_inputs(backward) == tuple(marked)
    assert names.index(first.moved.seed) < names.index(marked[0])
    summed, acc = accumulating(backward, first.weights)
    assert acc and step_constant_inputs(summed) == tuple(marked)
