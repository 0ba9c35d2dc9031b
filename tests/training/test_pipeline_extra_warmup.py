"""Pipeline rule 5's extra warm-up, chosen per backend: the plan, the runner and the cost model agree.

``EXTRA_WARMUP_BY_BACKEND`` gives ONNX Runtime plans one more warm-up forward on the stages before
the last (``S - s + 1`` stashed micro-batches) and TVM plans none; ``PARTITIONER_TRAIN_PIPE_EXTRA_WARMUP``
overrides it both ways. The cost model's predicted memory of stage 0 grows by one micro-batch of
its activations, here summed from the model's own shapes (ONNX shape inference at the micro-batch).
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import onnx
import pytest

import models_zoo
from partitioner.training import SGD, measured_cut, pipeline
from partitioner.training.pipeline import build_pipeline, extra_warmup
from partitioner.training.plan import predict_training

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_extra_warmup_is_on_for_onnxruntime_and_off_for_tvm(monkeypatch) -> None:
    """The table's defaults (no environment setting) and the knob's override both ways. Fails with
    the ONNX Runtime default off (0)."""
    monkeypatch.setattr(pipeline, "EXTRA_WARMUP", None)
    assert (extra_warmup("onnxruntime"), extra_warmup("tvm"), extra_warmup(None)) == (1, 0, 1)
    monkeypatch.setattr(pipeline, "EXTRA_WARMUP", 0)
    assert (extra_warmup("onnxruntime"), extra_warmup("tvm")) == (0, 0)
    monkeypatch.setattr(pipeline, "EXTRA_WARMUP", 1)
    assert (extra_warmup("onnxruntime"), extra_warmup("tvm")) == (1, 1)


@pytest.mark.parametrize("value,expected", [("0", (0, 0)), ("1", (1, 1)), ("", (1, 0))])
def test_the_environment_overrides_the_table_at_import(value, expected) -> None:
    """``PARTITIONER_TRAIN_PIPE_EXTRA_WARMUP`` is read at import (MPI ranks inherit it): 0 turns
    the ONNX Runtime default off, 1 turns TVM's on, empty leaves the table."""
    code = ("from partitioner.training.pipeline import extra_warmup; "
            "print(extra_warmup('onnxruntime'), extra_warmup('tvm'))")
    env = {**os.environ, "PYTHONPATH": ROOT, "PARTITIONER_TRAIN_PIPE_EXTRA_WARMUP": value}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120,
                         check=True)
    assert tuple(int(t) for t in out.stdout.split()) == expected


def test_onnxruntime_plan_keeps_it_gpipe_does_not(monkeypatch) -> None:
    """The ONNX Runtime 1F1B plan records the extra warm-up (the runner reads it from the plan);
    GPipe has no warm-up to extend."""
    monkeypatch.setattr(pipeline, "EXTRA_WARMUP", None)
    monkeypatch.setattr(measured_cut, "MEASURED_CUT", False)
    model = models_zoo.build("mlp", batch=8, hidden=32, in_features=16)
    kw = {"batch": 8, "stages": 2, "micro_batches": 4}
    assert build_pipeline(model, "cross_entropy", SGD(lr=0.1), schedule="1f1b", **kw).extra_warmup == 1
    assert build_pipeline(model, "cross_entropy", SGD(lr=0.1), schedule="gpipe", **kw).extra_warmup == 0


def _output_bytes(model: onnx.ModelProto) -> dict[str, int]:
    """Every value's bytes in ``model`` by ONNX shape inference (float32 and int64 only here)."""
    inferred = onnx.shape_inference.infer_shapes(model)
    out = {}
    for vi in list(inferred.graph.value_info) + list(inferred.graph.output):
        t = vi.type.tensor_type
        out[vi.name] = int(np.prod([d.dim_value for d in t.shape.dim])) * onnx.helper.tensor_dtype_to_np_dtype(
            t.elem_type).itemsize
    return out


def test_cost_model_prices_one_more_stashed_micro_batch_on_stage_0(monkeypatch) -> None:
    """With the extra warm-up, stage 0 of a 2-stage 1F1B plan over 4 micro-batches stashes 3
    micro-batches instead of 2: its predicted peak grows by exactly one micro-batch of its nodes'
    outputs (summed from the model's shapes at the micro-batch of 2, over the nodes of the plan's
    stage 0), the last stage's is unchanged, and the step time too (rule 4). Fails when the cost
    model ignores the extra warm-up (equal predictions)."""
    monkeypatch.setattr(measured_cut, "MEASURED_CUT", False)  # the cost-model cut: the same in both
    model = models_zoo.build("mlp", batch=8, layers=3, hidden=32, in_features=16)
    kw = {"batch": 8, "optimizer": "sgd", "schedule": "1f1b", "micro_batches": 4}
    preds = {}
    for e in (0, 1):
        monkeypatch.setattr(pipeline, "EXTRA_WARMUP", e)
        preds[e] = predict_training(model, "pipeline", 2, **kw)
    plan = build_pipeline(model, "cross_entropy", SGD(lr=0.1), batch=8, stages=2, micro_batches=4)
    sizes = _output_bytes(models_zoo.build("mlp", batch=2, layers=3, hidden=32, in_features=16))
    stage0 = {o for prog in (plan.stages[0].forward, plan.stages[0].backward) for n in prog.graph.node
              for o in n.output if o in sizes}
    expected = sum(sizes[o] for o in stage0)
    assert expected > 0
    assert preds[1].memory_per_rank[0] - preds[0].memory_per_rank[0] == pytest.approx(expected)
    assert preds[1].memory_per_rank[1] == pytest.approx(preds[0].memory_per_rank[1])
    assert preds[1].step_time_s == pytest.approx(preds[0].step_time_s)


def test_memory_limit_drops_the_extra_warmup_before_recompute(monkeypatch) -> None:
    """Under a ``--memory-limit`` at which only the plain 1F1B stash fits without recompute (found
    by the stage DP on both in-flight counts), the planner keeps the plain schedule: the plan does
    not recompute and runs no extra warm-up, and the prediction fits the limit without recompute.
    Fails without ``warmup_cut``'s fallback (the plan recomputes)."""
    from partitioner.core.errors import UsageError
    from partitioner.training.pipeline import in_flight, stage_cut
    from partitioner.training.step import _load

    monkeypatch.setattr(measured_cut, "MEASURED_CUT", False)
    monkeypatch.setattr(pipeline, "EXTRA_WARMUP", 1)
    model = models_zoo.build("mlp", batch=256, layers=4, hidden=32, in_features=16)  # activations > weights
    graph = _load(model, 32).graph
    top = max(predict_training(model, "pipeline", 2, batch=256, optimizer="sgd", micro_batches=8).memory_per_rank)

    def plain_only(limit: float) -> bool:
        def recomputes(extra: int) -> bool:
            try:
                return stage_cut(graph, 2, memory_limit=limit, in_flight=in_flight("1f1b", 2, 8, extra))[1]
            except UsageError:
                return True
        return recomputes(1) and not recomputes(0)

    limit = next((f * top for f in np.linspace(1.0, 0.2, 161) if plain_only(f * top)), None)
    assert limit is not None, "no limit separates the two stash counts"
    fitted = predict_training(model, "pipeline", 2, batch=256, optimizer="sgd", micro_batches=8, memory_limit=limit)
    assert not fitted.recompute and max(fitted.memory_per_rank) <= limit
    plan = build_pipeline(model, "cross_entropy", SGD(lr=0.1), batch=256, stages=2, micro_batches=8,
                          memory_limit=limit)
    assert not plan.recompute and plan.extra_warmup == 0
