"""Pipeline rule 1's forced cut (``pipeline.CUT_AFTER``, env ``PARTITIONER_TRAIN_PIPE_CUT_AFTER``):
the stages end after the named nodes, whatever the DP would choose; a name the model lacks, a
wrong count or the last node is a one-line usage error. It exists to measure one cut against
another (``benchmarks/pipeline_stages.py --cuts``), so a plan it builds must still train like one
rank (ONNX Runtime stages in a local world against a 1-rank step of the same global batch, 10
seeded SGD steps, losses and weights within rtol 1e-4, atol 1e-5)."""

from __future__ import annotations

import numpy as np
import pytest

import models_zoo
from partitioner.core.errors import UsageError
from partitioner.runtime.comm_local import LocalWorld
from partitioner.training import SGD, build_training_graph, pipeline
from partitioner.training.pipeline import build_pipeline
from partitioner.training.pipeline_runner import PipelineRunner, gathered_state
from partitioner.training.runner import StepRunner
from partitioner.training.step import _load

from .test_pipeline_training import _batches, _run_pipeline


def _model():
    return models_zoo.build("mlp", batch=8, hidden=32, layers=6, in_features=16)


def _plan():
    return build_pipeline(_model(), "cross_entropy", SGD(lr=0.1), batch=8, stages=2, micro_batches=4)


def _nodes():
    return list(_load(_model(), 2).graph)


def test_the_stages_end_after_the_named_node(monkeypatch) -> None:
    nodes = _nodes()
    counts = []
    for i in (1, len(nodes) - 3):  # one cut near each end: at least one is not the DP's
        monkeypatch.setattr(pipeline, "CUT_AFTER", (nodes[i].name,))
        stage0 = _plan().stages[0]
        produced = {o for p in (stage0.forward, stage0.fused) if p is not None for n in p.graph.node for o in n.output}
        assert nodes[i].outputs[0].name in produced  # the named node runs on stage 0
        assert nodes[i + 1].outputs[0].name not in produced  # its successor does not
        counts.append(len(stage0.weights))
    assert counts[0] < counts[1]


@pytest.mark.parametrize("cut", ["unknown", "none", "last", "two"])
def test_bad_cuts_are_one_line_usage_errors(monkeypatch, cut) -> None:
    names = [n.name for n in _nodes()]
    value = {"unknown": ("no.such.node",), "none": (), "last": (names[-1],), "two": (names[1], names[2])}[cut]
    monkeypatch.setattr(pipeline, "CUT_AFTER", value)
    with pytest.raises(UsageError, match="pipeline cut after") as exc:
        _plan()
    assert "\n" not in str(exc.value)


def test_a_forced_plan_trains_like_one_rank(monkeypatch) -> None:
    nodes = _nodes()
    monkeypatch.setattr(pipeline, "CUT_AFTER", (nodes[2].name,))
    plan, batches = _plan(), _batches()
    one = StepRunner(build_training_graph(_model(), optimizer=SGD(lr=0.1)))
    one_losses = [one.step({"input": x}, y) for x, y in batches]
    world = LocalWorld(2, timeout_s=120)
    runners = [PipelineRunner(plan, s, comm=world.communicator(s)) for s in range(2)]
    np.testing.assert_allclose(_run_pipeline(runners, batches), one_losses, rtol=1e-4, atol=1e-5)
    full = gathered_state(runners)
    for name, w in one.state.items():
        np.testing.assert_allclose(full[name], w, rtol=1e-4, atol=1e-5, err_msg=name)
