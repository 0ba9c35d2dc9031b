"""Pipeline rule 5's extra warm-up chosen by the plan (``pipeline.PLANNED_WARMUP``, off by default):
the 1F1B step simulated with and without it (``cost.pipeline.simulated_step_time``), from the
stages' measured prices and the cost model's message time.

The simulation is checked against the period derived by hand for 2 stages (``t0``, ``t1`` a
micro-batch each, ``c`` one message): without the extra warm-up the last stage's ``FB(i)`` waits
for ``FB(i - 2)``, a message, ``B(i - 2)`` and ``F(i)`` on stage 0 and a message, so two
micro-batches take ``max(2 t0, 2 t1, t0 + t1 + 2 c)``; with it the same chain spans three
(``max(3 t0, 3 t1, t0 + t1 + 2 c)``). The planner's choice follows it: a plan whose message is
long against the stages' imbalance keeps the extra warm-up, one whose message is negligible drops
it; both plans equal 1 rank after 10 steps.
"""

from __future__ import annotations

import numpy as np
import pytest

import models_zoo
from partitioner.cost.pipeline import pipeline_step_time, simulated_step_time
from partitioner.training import SGD, AdamW, measured_cut, pipeline
from partitioner.training.pipeline import build_pipeline, stage_cut
from partitioner.training.plan import predict_training
from partitioner.training.step import _load
from tests.training.test_pipeline_split_cut import _seconds, assert_ten_steps_match_one_rank


def _split(t: float) -> tuple[float, float]:
    return t / 3, 2 * t / 3


@pytest.mark.parametrize("t0,t1,c", [(3.0, 3.0, 0.5), (3.0, 3.4, 0.5), (3.5, 3.0, 0.4), (3.0, 3.0, 2.0),
                                     (2.0, 4.0, 0.3)])
def test_simulated_period_is_the_chain_through_both_ranks(t0, t1, c) -> None:
    """Two more micro-batches without the extra warm-up add ``max(2 t0, 2 t1, t0 + t1 + 2 c)``;
    three more with it add ``max(3 t0, 3 t1, t0 + t1 + 2 c)`` (the module docstring's chain)."""
    (f0, b0), (f1, b1) = _split(t0), _split(t1)
    step = {e: [simulated_step_time([f0, f1], [b0, b1], [c], m, "1f1b", e) for m in (8, 10, 11)] for e in (0, 1)}
    assert step[0][1] - step[0][0] == pytest.approx(max(2 * t0, 2 * t1, t0 + t1 + 2 * c))
    assert step[1][2] - step[1][0] == pytest.approx(max(3 * t0, 3 * t1, t0 + t1 + 2 * c))


@pytest.mark.parametrize("extra", [0, 1])
def test_free_messages_and_balanced_stages_are_the_fill_drain_formula(extra) -> None:
    """With no message time and equal stages 1F1B has the fill-drain step ``(M + S - 1) t``
    (:func:`pipeline_step_time`'s closed form), with or without the extra warm-up."""
    f, b = _split(3.0)
    assert simulated_step_time([f, f], [b, b], [0.0], 8, "1f1b", extra) == pytest.approx(
        pipeline_step_time([3.0, 3.0], [0.0], 8))


def _scaled(scale: float):
    def seconds(fwd, *_args, **_kw) -> np.ndarray:
        return _seconds(fwd) * scale
    return seconds


def _message_and_gap() -> tuple[float, float]:
    """The cost model's one-way message at the mlp's measured cut (micro-batch 2) and the stages'
    imbalance ``t1 - t0`` at unit prices (``_seconds``: the last stage the slower)."""
    from partitioner.cluster import resolve_cluster
    from partitioner.cost.comm import collective_time
    from partitioner.cost.training import cut_bytes

    graph = _load(models_zoo.build("mlp", batch=8, layers=4, hidden=64, in_features=16), 2).graph
    unit = _seconds(_load(models_zoo.build("mlp", batch=8, layers=4, hidden=64, in_features=16), 2))
    ends = stage_cut(graph, 2, seconds=unit)[0]
    c = collective_time("send", cut_bytes(graph, ends[0]), [0, 1], resolve_cluster("cpu:2")).seconds
    t0, t1 = float(unit[:ends[0] + 1].sum()), float(unit[ends[0] + 1:].sum())
    assert t1 > t0 and c > 0
    return c, t1 - t0


@pytest.mark.parametrize("optimizer", [SGD(lr=0.1), AdamW(lr=1e-2, weight_decay=0.01)], ids=["sgd", "adamw"])
def test_plan_keeps_the_extra_warmup_only_where_the_message_is_long(optimizer, monkeypatch) -> None:
    """The same mlp and cut, its measured prices scaled so that the round trip ``2 c`` is 4x the
    stages' imbalance (the chain sets the pace: the plan keeps the extra warm-up) or 1/50 of it
    (the last stage sets it: the plan drops it, on ONNX Runtime whose table says 1). The predicted
    stage-0 peak follows the plan's choice (one more stashed micro-batch); both plans equal 1 rank
    after 10 steps. Fails with ``PLANNED_WARMUP`` off (the negligible case keeps the table's 1)."""
    monkeypatch.setattr(pipeline, "PLANNED_WARMUP", True)
    monkeypatch.setattr(pipeline, "EXTRA_WARMUP", None)
    c, gap = _message_and_gap()
    model = models_zoo.build("mlp", batch=8, layers=4, hidden=64, in_features=16)
    chosen, peaks = {}, {}
    for case, round_trip in (("long", 4.0), ("negligible", 0.02)):
        scaled = _scaled(2 * c / (round_trip * gap))  # 2 c = round_trip x (t1 - t0)
        monkeypatch.setattr(measured_cut, "shared_node_seconds", scaled)
        monkeypatch.setattr(measured_cut, "node_seconds", scaled)
        plan = build_pipeline(model, "cross_entropy", optimizer, batch=8, stages=2, micro_batches=4)
        chosen[case] = plan.extra_warmup
        peaks[case] = predict_training(model, "pipeline", 2, batch=8, optimizer="sgd", micro_batches=4,
                                       backend="onnxruntime").memory_per_rank
        assert_ten_steps_match_one_rank(model, plan, optimizer)
    assert chosen == {"long": 1, "negligible": 0}
    assert peaks["long"][0] > peaks["negligible"][0]
    assert peaks["long"][1] == pytest.approx(peaks["negligible"][1])
