"""ONNX Runtime's memory pattern and buffer reuse are off for 1-rank and data ranks' training
sessions and on for tensor ranks (``partitioner/training/runner.py`` ``MEMORY_PATTERN``,
``MEMORY_REUSE``), read back from the sessions themselves; the knobs turn them back on."""

from __future__ import annotations

import models_zoo
import pytest
from partitioner.runtime.comm_local import LocalWorld
from partitioner.training import runner as runner_mod
from partitioner.training.runner import StepRunner
from partitioner.training.step import build_training_graph
from partitioner.training.tensor import tensor_runners


def _patterns(step_runner: StepRunner, option: str = "enable_mem_pattern") -> list[bool]:
    sessions = [run[0] for _, run in step_runner._exe.steps if run is not None]
    assert sessions
    return [getattr(s.get_session_options(), option) for s in sessions]


def _reuse(step_runner: StepRunner) -> list[bool]:
    return _patterns(step_runner, "enable_mem_reuse")


def _env_arena(step_runner: StepRunner) -> set[str]:
    """``session.use_env_allocators`` of every session: the process arena (its dead-bytes config)."""
    return {s.get_session_options().get_session_config_entry("session.use_env_allocators")
            for s in (run[0] for _, run in step_runner._exe.steps if run is not None)}


@pytest.fixture(scope="module")
def mlp():
    return models_zoo.build("mlp", batch=8, hidden=32, in_features=16)


def test_one_rank_and_data_ranks_run_without_the_memory_pattern(mlp) -> None:
    one = StepRunner(build_training_graph(mlp, loss="cross_entropy"))
    assert _patterns(one) == [False]
    assert _reuse(one) == [False]
    assert _env_arena(one) == {"1"}
    world = LocalWorld(2)
    step = build_training_graph(mlp, loss="cross_entropy", batch=4, world_size=2)
    data = StepRunner(step, comm=world.communicator(0))
    assert set(_patterns(data)) == {False}
    assert set(_reuse(data)) == {False}
    assert _env_arena(data) == {"1"}


def test_tensor_ranks_keep_it_and_the_knob_turns_it_on(mlp, monkeypatch) -> None:
    _, runners = tensor_runners(mlp, "cross_entropy", None, batch=8, devices=2, trainable=None,
                                backend="onnxruntime", comm=None, out=None, threads=1, state=None)
    assert all(set(_patterns(r)) == {True} for r in runners)
    assert all(set(_reuse(r)) == {True} for r in runners)
    monkeypatch.setattr(runner_mod, "MEMORY_PATTERN", True)
    monkeypatch.setattr(runner_mod, "MEMORY_REUSE", True)
    one = StepRunner(build_training_graph(mlp, loss="cross_entropy"))
    assert _patterns(one) == [True]
    assert _reuse(one) == [True]


def test_process_arena_splits_chunks_above_the_dead_bytes_limit(monkeypatch) -> None:
    """The process arena is registered with ``max_dead_bytes_per_chunk`` = ARENA_MAX_DEAD_BYTES
    (1 MiB; ORT's default 128 MiB kept whole chunks for small tensors)."""
    import onnxruntime as ort

    import backends.onnxruntime as ort_backend

    seen = []
    monkeypatch.setattr(ort_backend, "_ENV_ARENA", [])
    monkeypatch.setattr(ort, "create_and_register_allocator", lambda info, cfg: seen.append(cfg))
    ort_backend._shared_arena()
    ort_backend._shared_arena()  # once per process
    assert len(seen) == 1 and ort_backend.ARENA_MAX_DEAD_BYTES == 1 << 20
    assert seen[0].max_dead_bytes_per_chunk == 1 << 20
