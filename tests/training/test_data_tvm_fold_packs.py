"""Training with the conv weights' transposes folded into their packs (backends/tvm/
fold_weight_packs.py, ``FOLD_TRANSPOSED_PACKS``): a small CNN whose 64-channel 3x3 conv takes
the folded forward pack and the folded flipped pack of its input gradient. 2 in-process TVM data
ranks match a 1-rank TVM run of the same global batch after 10 SGD steps, and that run matches
ONNX Runtime's 1-rank step (weights within rtol 1e-4, atol 1e-5, seeded data). The builds fold
at least one pack per library that reads a conv weight (with the knob off none: the count
assertion fails)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from backends.tvm import fold_weight_packs as F
from partitioner.training import SGD, build_training_graph
from partitioner.training.runner import StepRunner

from .test_data_tvm_buckets import step_data_ranks
from .test_pipeline_hoist import _conv_net

STEPS = 10


def _cnn() -> onnx.ModelProto:
    """Conv 4->64 3x3 -> Relu -> Conv 64->64 3x3 -> Relu -> Flatten -> Gemm (no BatchNormalization)."""
    return _conv_net(cin=4, c1=64, c2=64, size=6, scale=0.1, seed=13, name="cnn32")


@pytest.mark.slow
def test_folded_packs_train_data_ranks_like_one_rank_and_onnxruntime(tmp_path, monkeypatch) -> None:
    from partitioner.runtime.comm_local import LocalWorld

    folded: list[int] = []
    real = F.folded_pack
    monkeypatch.setattr(F, "folded_pack", lambda *a, **k: folded.append(1) or real(*a, **k))
    model, opt = _cnn(), SGD(lr=0.05)
    rng = np.random.default_rng(16)
    batches = [(rng.standard_normal((8, 4, 6, 6)).astype(np.float32), rng.integers(0, 10, 8)) for _ in range(STEPS)]
    one_step = build_training_graph(model, optimizer=opt)
    one = StepRunner(one_step, backend="tvm", workdir=tmp_path / "one")
    assert folded, "the 1-rank TVM step must fold its conv weights' transposes into their packs"
    ort = StepRunner(one_step)
    for x, y in batches:
        np.testing.assert_allclose(one.step({"input": x}, y), ort.step({"input": x}, y), rtol=1e-4, atol=1e-5)
    folded.clear()
    step2 = build_training_graph(model, optimizer=opt, batch=4, world_size=2)
    world = LocalWorld(2, timeout_s=120)
    runners = [StepRunner(step2, backend="tvm", comm=world.communicator(r), workdir=tmp_path / f"r{r}")
               for r in range(2)]
    assert folded, "the data ranks' TVM libraries must fold their conv weights' transposes into their packs"
    step_data_ranks(runners, batches)
    for n, w in one.weights().items():
        np.testing.assert_allclose(w, ort.state[n], rtol=1e-4, atol=1e-5, err_msg=f"1 rank vs ORT: {n}")
        for r in runners:
            np.testing.assert_allclose(r.state[n], w, rtol=1e-4, atol=1e-5, err_msg=f"2 ranks vs 1: {n}")
