"""pipeline_runner.WEIGHT_TENSORS (backends/tvm/executable.py rule 9; default on): after the first
step's update, a TVM stage's programs read its weights as the update program's output tensors (no
copy into each program's input buffers once a step), and the pipeline still trains like 1 rank (4
SGD steps against a 1-rank ONNX Runtime step, losses and every weight within rtol 1e-4, atol 1e-5:
a tensor fed after the update replaced it would fail it)."""

from __future__ import annotations

from partitioner.training import pipeline_runner

from .test_pipeline_hoist import conv_pipeline_case, trains_like_one_rank


def _weight_feeds(tmp_path) -> list[tuple[int, str, int, int]]:
    """Per program call after the first update (stage, kind, weights fed as tensors, as arrays)."""
    import tvm

    plan, batches, one, runners = conv_pipeline_case(tmp_path)
    calls: list[tuple[int, str, int, int]] = []
    updated = set()
    for r in runners:
        for kind, exe in r._exe.items():
            def counted(feeds, comm, run=exe.run, kind=kind, r=r):
                i = r.stage.index
                if i in updated:
                    ws = [feeds[w] for w in r.stage.weights if w in feeds]
                    tensors = sum(isinstance(w, tvm.runtime.Tensor) for w in ws)
                    calls.append((i, kind, tensors, len(ws) - tensors))
                if kind == "U":
                    updated.add(i)
                return run(feeds, comm)

            exe.run = counted
    trains_like_one_rank(runners, batches, one)
    return calls


def test_programs_read_weights_as_tensors(tmp_path) -> None:
    """The default (fails with ``WEIGHT_TENSORS`` off: every weight then comes as an array)."""
    calls = _weight_feeds(tmp_path)
    assert calls and all(arrays == 0 for _, _, _, arrays in calls), calls
    assert sum(t for _, _, t, _ in calls) > 0, calls


def test_knob_off_copies(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(pipeline_runner, "WEIGHT_TENSORS", False)
    calls = _weight_feeds(tmp_path)
    assert calls and all(tensors == 0 for _, _, tensors, _ in calls), calls
