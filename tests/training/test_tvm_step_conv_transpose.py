"""runner.TVM_CONV_TRANSPOSE_AS_CONV: a TVM step (1 rank) runs a conv's input gradient as a Conv of
the flipped weight instead of a ConvTranspose, and still trains like the ONNX Runtime step
(weights after 4 SGD steps within rtol 1e-4, atol 1e-5, seeded data)."""

from __future__ import annotations

import numpy as np
import pytest

from partitioner.training import SGD, build_training_graph
from partitioner.training import runner as runner_mod
from partitioner.training.runner import StepRunner

from .test_pipeline_hoist import _conv_net


def _ops(r: StepRunner) -> set[str]:
    return {n.op_type for n in r.program.graph.node}


def _tvm_steps_match_ort(tvm: StepRunner, ort: StepRunner, image: tuple[int, ...], seed: int) -> None:
    """4 SGD steps on seeded batches of 8 ``image``-shaped inputs: the TVM step's losses and every
    state entry within rtol 1e-4, atol 1e-5 of the ONNX Runtime step's."""
    rng = np.random.default_rng(seed)
    for _ in range(4):
        x, y = rng.standard_normal((8, *image)).astype(np.float32), rng.integers(0, 10, 8)
        np.testing.assert_allclose(tvm.step({"input": x}, y), ort.step({"input": x}, y), rtol=1e-4, atol=1e-5)
    for name, w in ort.state.items():
        np.testing.assert_allclose(tvm.state[name], w, rtol=1e-4, atol=1e-5, err_msg=name)


@pytest.mark.parametrize("on", [True, False])
def test_tvm_step_rewrites_conv_transpose_and_matches_ort(tmp_path, monkeypatch, on) -> None:
    monkeypatch.setattr(runner_mod, "TVM_CONV_TRANSPOSE_AS_CONV", on)
    step = build_training_graph(_conv_net(), optimizer=SGD(lr=0.1))
    ort = StepRunner(step)
    assert "ConvTranspose" in _ops(ort), "the case must have an input gradient as ConvTranspose"
    tvm = StepRunner(step, backend="tvm", workdir=tmp_path)
    assert ("ConvTranspose" in _ops(tvm)) is not on
    _tvm_steps_match_ort(tvm, ort, (2, 5, 5), seed=3)
