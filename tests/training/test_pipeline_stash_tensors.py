"""pipeline_runner.STASH_TENSORS (backends/tvm/executable.py rule 9; default off): on a TVM stage, ``B`` reads
the activations ``F`` stashed as ``F``'s own output tensors (no copy into its input buffers), and
the pipeline still trains like 1 rank (4 SGD steps against a 1-rank ONNX Runtime step, losses and
every weight within rtol 1e-4, atol 1e-5)."""

from __future__ import annotations

import numpy as np

from partitioner.runtime.comm_local import LocalWorld
from partitioner.training import SGD, build_training_graph, pipeline_runner
from partitioner.training.pipeline import build_pipeline
from partitioner.training.pipeline_runner import PipelineRunner, gathered_state
from partitioner.training.runner import StepRunner

from .test_pipeline_hoist import _conv_net
from .test_pipeline_training import _run_pipeline


def _trains_like_one_rank(tmp_path) -> dict[str, int]:
    """The conv net's 2 TVM stages against 1 rank; returns, over the steps, how many stashed
    values ``B`` got as tensors and as numpy arrays."""
    import tvm

    model = _conv_net()
    plan = build_pipeline(model, "cross_entropy", SGD(lr=0.1), batch=8, stages=2, micro_batches=4, backend="tvm")
    rng = np.random.default_rng(2)
    batches = [(rng.standard_normal((8, 2, 5, 5)).astype(np.float32), rng.integers(0, 10, 8)) for _ in range(4)]
    one = StepRunner(build_training_graph(model, optimizer=SGD(lr=0.1)))
    one_losses = [one.step({"input": x}, y) for x, y in batches]
    world = LocalWorld(2, timeout_s=120)
    runners = [PipelineRunner(plan, s, comm=world.communicator(s), backend="tvm", workdir=tmp_path) for s in range(2)]
    seen = {"tensor": 0, "array": 0}
    stage0 = runners[0]
    produced = {o.name for o in plan.stages[0].forward.graph.output}
    stashed = [v for v in plan.stages[0].stash if v in produced]
    assert stashed, "the case must stash an F output"
    run = stage0._exe["B"].run

    def counted(feeds, comm):
        for v in stashed:
            seen["tensor" if isinstance(feeds[v], tvm.runtime.Tensor) else "array"] += 1
        return run(feeds, comm)

    stage0._exe["B"].run = counted
    np.testing.assert_allclose(_run_pipeline(runners, batches), one_losses, rtol=1e-4, atol=1e-5)
    full = gathered_state(runners)
    for name, w in one.state.items():
        np.testing.assert_allclose(full[name], w, rtol=1e-4, atol=1e-5, err_msg=name)
    return seen


def test_backward_reads_forward_tensors(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(pipeline_runner, "STASH_TENSORS", True)  # default off: not measured faster yet
    seen = _trains_like_one_rank(tmp_path)
    assert seen["tensor"] > 0 and seen["array"] == 0, seen


def test_knob_off_copies(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(pipeline_runner, "STASH_TENSORS", False)
    seen = _trains_like_one_rank(tmp_path)
    assert seen["tensor"] == 0 and seen["array"] > 0, seen
