"""pipeline_runner.STASH_TENSORS (backends/tvm/executable.py rule 9; default on): on a TVM stage, ``B`` reads
the activations ``F`` stashed as ``F``'s own output tensors (no copy into its input buffers), and
the pipeline still trains like 1 rank (4 SGD steps against a 1-rank ONNX Runtime step, losses and
every weight within rtol 1e-4, atol 1e-5)."""

from __future__ import annotations

from partitioner.training import pipeline_runner

from .test_pipeline_hoist import conv_pipeline_case, trains_like_one_rank


def _trains_like_one_rank(tmp_path) -> dict[str, int]:
    """The conv net's 2 TVM stages against 1 rank; returns, over the steps, how many stashed
    values ``B`` got as tensors and as numpy arrays."""
    import tvm

    plan, batches, one, runners = conv_pipeline_case(tmp_path)
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
    trains_like_one_rank(runners, batches, one)
    return seen


def test_backward_reads_forward_tensors(tmp_path) -> None:
    """The default (fails with ``STASH_TENSORS`` off: ``B`` then gets every stashed value copied)."""
    seen = _trains_like_one_rank(tmp_path)
    assert seen["tensor"] > 0 and seen["array"] == 0, seen


def test_knob_off_copies(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(pipeline_runner, "STASH_TENSORS", False)
    seen = _trains_like_one_rank(tmp_path)
    assert seen["tensor"] == 0 and seen["array"] > 0, seen
