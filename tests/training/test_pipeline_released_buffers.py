"""Memory a TVM pipeline stage no longer keeps. backends/tvm/executable.py rule 9's
``RELEASE_PASSED_BUFFERS`` (default on): an input a TVM
program is given as a tensor (the pipeline runner's weights after the first update, its hoisted
values, ``B``'s stash) frees the persistent input buffer an earlier array filled, so a stage does
not keep a dead weight-sized copy per program; the pipeline still trains like 1 rank (4 SGD steps
against a 1-rank ONNX Runtime step, losses and every weight within rtol 1e-4, atol 1e-5).
pipeline_runner.RELEASE_STEP_CONSTANTS (default on): a program's lifted step constants are
dropped after its last call of the step (same equivalence check)."""

from __future__ import annotations

from backends.tvm import executable

from .test_pipeline_hoist import conv_pipeline_case, trains_like_one_rank


def _dead_buffers(tmp_path) -> tuple[int, int]:
    """After the steps: (input buffers of inputs last given as tensors, inputs last given so)."""
    plan, batches, one, runners = conv_pipeline_case(tmp_path)
    trains_like_one_rank(runners, batches, one)
    exes = [e for r in runners for e in r._exe.values()]
    passed = [(e, i) for e in exes for i in e._passed]
    return sum(e._in_bufs[i] is not None for e, i in passed), len(passed)


def test_tensor_inputs_hold_no_buffer(tmp_path) -> None:
    """The default (fails with ``RELEASE_PASSED_BUFFERS`` off: the first step's weight buffers stay)."""
    dead, passed = _dead_buffers(tmp_path)
    assert passed > 0 and dead == 0, (dead, passed)


def test_knob_off_keeps_them(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(executable, "RELEASE_PASSED_BUFFERS", False)
    dead, passed = _dead_buffers(tmp_path)
    assert passed > 0 and dead > 0, (dead, passed)


def _lifted_after_steps(tmp_path, monkeypatch) -> tuple[int, int]:
    """After the steps: (programs still holding lifted step constants, programs that lift)."""
    from partitioner.training import hoist

    monkeypatch.setattr(hoist, "LIFT_MIN_BYTES", 0)  # the conv net's weights are small
    plan, batches, one, runners = conv_pipeline_case(tmp_path)
    trains_like_one_rank(runners, batches, one)  # a result dropped too early or kept too long fails it
    lifting = [e for r in runners for e in r._exe.values() if e._constants]
    return sum(e._lifted is not None for e in lifting), len(lifting)


def test_step_constants_released_after_last_call(tmp_path, monkeypatch) -> None:
    """pipeline_runner.RELEASE_STEP_CONSTANTS (default on; fails with it off: every lifting
    program keeps its lifted values until its first call of the next step)."""
    kept, lifting = _lifted_after_steps(tmp_path, monkeypatch)
    assert lifting > 0 and kept == 0, (kept, lifting)


def test_step_constants_knob_off_keeps_them(tmp_path, monkeypatch) -> None:
    from partitioner.training import pipeline_runner

    monkeypatch.setattr(pipeline_runner, "RELEASE_STEP_CONSTANTS", False)
    kept, lifting = _lifted_after_steps(tmp_path, monkeypatch)
    assert lifting > 0 and kept == lifting, (kept, lifting)
