"""Pipeline rule 12 (:mod:`partitioner.training.moved_wgrad`): the last stage's first product's
weight-gradient columns computed on the stage before, against 1 rank (10 steps, SGD and AdamW,
GPipe and 1F1B, per-micro-batch, ZB-H1 tail and whole-batch deferred weight gradients; weights
within rtol 1e-4, atol 1e-5)."""

from __future__ import annotations

import numpy as np
import pytest

import models_zoo
from partitioner.training import SGD, AdamW, deferred_wgrad, measured_cut, moved_wgrad
from partitioner.training.pipeline import build_pipeline
from tests.training.test_pipeline_split_cut import _seconds, assert_ten_steps_match_one_rank


def _plan(optimizer, schedule: str, monkeypatch, rows: bool = False):
    """The 2|2 cut, whatever the machine (``rows``: as measured_cut rule 7's two rows, which the
    whole-batch deferral needs), the knob on (off by default)."""
    monkeypatch.setattr(moved_wgrad, "MOVE_WEIGHT_GRADIENT", True)
    monkeypatch.setattr(measured_cut, "shared_node_seconds",
                        (lambda fwd, *a, **k: np.stack([_seconds(fwd)] * 2)) if rows else _seconds)
    model = models_zoo.build("mlp", batch=8, layers=4, hidden=64, in_features=16)
    return model, build_pipeline(model, "cross_entropy", optimizer, batch=8, stages=2, micro_batches=4,
                                 schedule=schedule)


def _widths(program, name: str) -> list[int]:
    out = [o for o in program.graph.output if o.name == name][0]
    return [d.dim_value for d in out.type.tensor_type.shape.dim]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("optimizer", [SGD(lr=0.1), AdamW(lr=1e-2, weight_decay=0.01)], ids=["sgd", "adamw"])
@pytest.mark.parametrize("defer", ["per-micro-batch", "tail", "whole-batch"])
def test_moved_columns_match_one_rank(schedule, optimizer, defer, monkeypatch) -> None:
    """The mlp's fc2 (MatMul, weight [64, 64]) is the last stage's first product: the last stage
    keeps its weight gradient's first 32 columns (rule 2: half), stage 0's ``B`` computes the other
    32 from the ``fc1.relu`` it sent; 10 steps match 1 rank, the weight and its state stay on the
    last stage under the 1-rank names. Fails with MOVE_WEIGHT_GRADIENT off (nothing moves:
    ``moved`` is None)."""
    if defer == "tail":
        monkeypatch.setattr(deferred_wgrad, "DEFER_MAX_ROWS", 0)
    if defer == "whole-batch":
        monkeypatch.setattr(deferred_wgrad, "DEFER_ALWAYS", True)
    model, plan = _plan(optimizer, schedule, monkeypatch, rows=defer == "whole-batch")
    first, last = plan.stages
    assert last.moved is not None and first.moved is not None
    moved = last.moved
    assert (moved.weight, moved.kept, moved.axis, moved.x) == ("fc2.weight", 32, 1, "fc1.relu")
    assert "fc2.weight" in last.weights and "fc2.weight" not in first.weights
    assert _widths(first.backward, "fc2.weight.grad.moved") == [64, 32]
    assert "fc1.relu" in first.stash
    assert (last.w_tail == 2) == (defer == "tail") and (last.w_tail == 4) == (defer == "whole-batch")
    assert_ten_steps_match_one_rank(model, plan, optimizer)


def test_column_count(monkeypatch) -> None:
    """Rule 2: a fixed count, rounded down to 16; too few columns on either side moves nothing."""
    monkeypatch.setattr(moved_wgrad, "MOVED_COLUMNS", 40)
    _, plan = _plan(SGD(lr=0.1), "1f1b", monkeypatch)
    assert plan.stages[-1].moved.kept == 64 - 32
    monkeypatch.setattr(moved_wgrad, "MOVED_COLUMNS", 56)
    _, plan = _plan(SGD(lr=0.1), "1f1b", monkeypatch)
    assert plan.stages[-1].moved.kept == 64 - 48
    monkeypatch.setattr(moved_wgrad, "MOVED_COLUMNS", 12)
    _, plan = _plan(SGD(lr=0.1), "1f1b", monkeypatch)
    assert plan.stages[-1].moved is None and plan.stages[0].moved is None
