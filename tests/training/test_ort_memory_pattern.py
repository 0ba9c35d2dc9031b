"""ONNX Runtime's memory pattern is off for 1-rank and data ranks' training sessions and on for
tensor ranks (``partitioner/training/runner.py`` ``MEMORY_PATTERN``), read back from the sessions
themselves; the knob turns it back on."""

from __future__ import annotations

import models_zoo
import pytest
from partitioner.runtime.comm_local import LocalWorld
from partitioner.training import runner as runner_mod
from partitioner.training.runner import StepRunner
from partitioner.training.step import build_training_graph
from partitioner.training.tensor import tensor_runners


def _patterns(step_runner: StepRunner) -> list[bool]:
    sessions = [run[0] for _, run in step_runner._exe.steps if run is not None]
    assert sessions
    return [s.get_session_options().enable_mem_pattern for s in sessions]


@pytest.fixture(scope="module")
def mlp():
    return models_zoo.build("mlp", batch=8, hidden=32, in_features=16)


def test_one_rank_and_data_ranks_run_without_the_memory_pattern(mlp) -> None:
    one = StepRunner(build_training_graph(mlp, loss="cross_entropy"))
    assert _patterns(one) == [False]
    world = LocalWorld(2)
    step = build_training_graph(mlp, loss="cross_entropy", batch=4, world_size=2)
    data = StepRunner(step, comm=world.communicator(0))
    assert set(_patterns(data)) == {False}


def test_tensor_ranks_keep_it_and_the_knob_turns_it_on(mlp, monkeypatch) -> None:
    _, runners = tensor_runners(mlp, "cross_entropy", None, batch=8, devices=2, trainable=None,
                                backend="onnxruntime", comm=None, out=None, threads=1, state=None)
    assert all(set(_patterns(r)) == {True} for r in runners)
    monkeypatch.setattr(runner_mod, "MEMORY_PATTERN", True)
    assert _patterns(StepRunner(build_training_graph(mlp, loss="cross_entropy"))) == [True]
