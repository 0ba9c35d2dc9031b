"""Pipeline rule 11 (:mod:`partitioner.training.split_cut`): one product split by output columns
across the last cut, against 1 rank (10 steps, SGD and AdamW, GPipe and 1F1B, weights within
rtol 1e-4, atol 1e-5, the gathered state under the 1-rank names)."""

from __future__ import annotations

import numpy as np
import pytest

import models_zoo
from partitioner.runtime.comm_local import LocalWorld
from partitioner.training import SGD, AdamW, build_training_graph, deferred_wgrad, measured_cut, split_cut
from partitioner.training.pipeline import build_pipeline, plan_state
from partitioner.training.pipeline_runner import PipelineRunner, gathered_state
from partitioner.training.runner import StepRunner
from tests.training.test_pipeline_training import _run_pipeline

TOL = {"rtol": 1e-4, "atol": 1e-5}


def _seconds(fwd, *_args, **_kw) -> np.ndarray:
    """Measured-cut prices that leave the last stage the slower: products 3, the head 2, the rest
    0.1 (the mlp's 2|2 cut: stage 0 6.3, the last 8.3; a third of fc2's 3 balances them)."""
    price = {"MatMul": 3.0, "Gemm": 3.0}
    nodes = list(fwd.graph)
    out = np.array([price.get(n.op_type, 0.1) for n in nodes])
    out[-1] = 2.0
    return out


def _plan(optimizer, schedule: str, monkeypatch):
    monkeypatch.setattr(split_cut, "SPLIT_ACROSS_CUT", True)  # off by default (split_cut rule 6)
    monkeypatch.setattr(split_cut, "COLUMNS", 0)
    monkeypatch.setattr(measured_cut, "shared_node_seconds", _seconds)
    model = models_zoo.build("mlp", batch=8, layers=4, hidden=64, in_features=16)
    return model, build_pipeline(model, "cross_entropy", optimizer, batch=8, stages=2, micro_batches=4,
                                 schedule=schedule)


def assert_ten_steps_match_one_rank(model, plan, optimizer) -> None:
    """10 SGD/AdamW steps of the 2-stage ``plan`` (in-process ranks) against 1 rank of the same
    global batches: the losses and every gathered weight and optimizer state within ``TOL``."""
    rng = np.random.default_rng(11)
    batches = [(rng.standard_normal((8, 16)).astype(np.float32), rng.integers(0, 10, 8)) for _ in range(10)]
    one = StepRunner(build_training_graph(model, optimizer=optimizer))
    assert set(plan_state(plan)) == set(one.state)
    one_losses = [one.step({"input": x}, y) for x, y in batches]
    world = LocalWorld(2, timeout_s=60)
    runners = [PipelineRunner(plan, s, comm=world.communicator(s)) for s in range(2)]
    np.testing.assert_allclose(_run_pipeline(runners, batches), one_losses, **TOL)
    full = gathered_state(runners)
    assert set(full) == set(one.state)
    for name, w in one.state.items():
        np.testing.assert_allclose(full[name], w, err_msg=name, **TOL)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("optimizer", [SGD(lr=0.1), AdamW(lr=1e-2, weight_decay=0.01)], ids=["sgd", "adamw"])
@pytest.mark.parametrize("tail", [False, True], ids=["per-micro-batch", "tail"])
def test_split_product_matches_one_rank(schedule, optimizer, tail, monkeypatch) -> None:
    """The mlp's fc2 (MatMul [64, 64]) split 16 | 48 across the cut (rule 3: n = 64 x 2 / 6 = 21,
    down to 16): stage 0 holds fc2.weight.part0, the last stage part1 and fc2's bias; 10 steps
    match 1 rank, with deferred_wgrad rule 7's tail too. Fails with SPLIT_ACROSS_CUT off."""
    if tail:
        monkeypatch.setattr(deferred_wgrad, "DEFER_MAX_ROWS", 0)
    model, plan = _plan(optimizer, schedule, monkeypatch)
    first, last = plan.stages
    assert plan.parts == {"fc2.weight.part0": ("fc2.weight", 1, 16), "fc2.weight.part1": ("fc2.weight", 1, 16)}
    assert "fc2.weight.part0" in first.weights and "fc2.weight.part1" in last.weights
    assert (last.w_tail == 2) == tail
    assert_ten_steps_match_one_rank(model, plan, optimizer)


def test_split_stages_start_from_a_one_rank_state(monkeypatch) -> None:
    """Rule 4: runners given a 1-rank state (``--resume``) cut it into the parts and gather it back."""
    _, plan = _plan(AdamW(lr=1e-2), "1f1b", monkeypatch)
    rng = np.random.default_rng(3)
    start = {k: rng.standard_normal(v.shape).astype(v.dtype) for k, v in plan_state(plan).items()}
    world = LocalWorld(2, timeout_s=60)
    runners = [PipelineRunner(plan, s, comm=world.communicator(s), state=start) for s in range(2)]
    np.testing.assert_array_equal(runners[0].state["fc2.weight.part0.m"], start["fc2.weight.m"][:, :16])
    full = gathered_state(runners)
    assert set(full) == set(start)
    for k, v in start.items():
        np.testing.assert_array_equal(full[k], v, err_msg=k)


def test_no_split_when_the_last_stage_is_not_the_slower(monkeypatch) -> None:
    """Rule 3: with the first stage the slower (or the knob off) nothing is split."""
    def first_heavy(fwd, *_a, **_k):
        out = _seconds(fwd)
        out[0] = 6.0
        return out

    monkeypatch.setattr(measured_cut, "shared_node_seconds", first_heavy)
    monkeypatch.setattr(split_cut, "SPLIT_ACROSS_CUT", True)
    monkeypatch.setattr(split_cut, "COLUMNS", 0)
    model = models_zoo.build("mlp", batch=8, layers=4, hidden=64, in_features=16)
    assert build_pipeline(model, "cross_entropy", SGD(lr=0.1), batch=8, stages=2, micro_batches=4).parts == {}
    monkeypatch.setattr(measured_cut, "shared_node_seconds", _seconds)
    monkeypatch.setattr(split_cut, "SPLIT_ACROSS_CUT", False)
    assert build_pipeline(model, "cross_entropy", SGD(lr=0.1), batch=8, stages=2, micro_batches=4).parts == {}


@pytest.mark.parametrize("optimizer", [SGD(lr=0.1), AdamW(lr=1e-2, weight_decay=0.01)], ids=["sgd", "adamw"])
def test_extra_warmup_matches_one_rank(optimizer, monkeypatch) -> None:
    """Pipeline rule 5's extra warm-up, the ONNX Runtime default (``EXTRA_WARMUP_BY_BACKEND``, no
    environment setting): stage 0 runs two warm-up forwards (F0 F1 F2 B0 ...) and stashes 3
    micro-batches at its peak (the plan's in_flight says so); 10 1F1B steps match 1 rank (rtol
    1e-4, atol 1e-5). Fails with the ONNX Runtime default at 0 (peak 2)."""
    from partitioner.training import pipeline
    from partitioner.training.pipeline import in_flight, schedule_order

    monkeypatch.setattr(pipeline, "EXTRA_WARMUP", None)
    assert schedule_order("1f1b", 0, 2, 4, 1)[:4] == [("F", 0), ("F", 1), ("F", 2), ("B", 0)]
    assert in_flight("1f1b", 2, 8, 1) == [3, 1]
    model = models_zoo.build("mlp", batch=8, hidden=32, in_features=16)
    plan = build_pipeline(model, "cross_entropy", optimizer, batch=8, stages=2, micro_batches=4, schedule="1f1b")
    assert plan.extra_warmup == 1
    rng = np.random.default_rng(13)
    batches = [(rng.standard_normal((8, 16)).astype(np.float32), rng.integers(0, 10, 8)) for _ in range(10)]
    one = StepRunner(build_training_graph(model, optimizer=optimizer))
    one_losses = [one.step({"input": x}, y) for x, y in batches]
    world = LocalWorld(2, timeout_s=60)
    runners = [PipelineRunner(plan, s, comm=world.communicator(s)) for s in range(2)]
    np.testing.assert_allclose(_run_pipeline(runners, batches), one_losses, **TOL)
    assert runners[0].peak_stash == 3
    full = gathered_state(runners)
    for name, w in one.state.items():
        np.testing.assert_allclose(full[name], w, err_msg=name, **TOL)
