"""A TVM pipeline stage's predicted peak (``partitioner.cost.memory.tvm_stage_memory``, issue 16).

Fast: the terms on a small mlp's 2-stage TVM plan (graphs and memory plans, nothing compiled) against bytes
derived here from the zoo model's own weight shapes and the plan's micro-batch; the rule is what
``predict_training`` charges TVM pipeline ranks, and ``TVM_STAGE_MEMORY`` off gives rule 3's sum.
Slow: the predicted peak of a TVM stage against its measured one, in a fresh process
(``benchmarks/pipeline_stage_memory.py``: the ``train --bench`` window, RSS above the baseline,
the state counted in), within 25%; without the pool term, and with the knob off, it is not.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest

import models_zoo
from backends.tvm.lift_step_constants import step_constant_inputs
from backends.tvm.planned_memory import PlannedBytes, planned_bytes
from partitioner.cost import memory
from partitioner.cost.training import stashed_micro_batches
from partitioner.training import SGD
from partitioner.training.pipeline import build_pipeline
from partitioner.training.plan import predict_training

from tests.bench_scripts import load

M = 4
BATCH = 16
HIDDEN = 64


def _model() -> onnx.ModelProto:
    return models_zoo.build("mlp", batch=BATCH, hidden=HIDDEN, in_features=32)


def _terms(plan, s: int) -> memory.TvmStageMemory:
    counts = stashed_micro_batches(plan.schedule, plan.num_stages, M, plan.extra_warmup)
    return memory.tvm_stage_memory(plan.stages[s], micro_batches=M, in_flight=counts[s],
                                   constant_inputs=step_constant_inputs, planned=planned_bytes)


def _weight_bytes(model: onnx.ModelProto, names) -> dict[str, int]:
    return {t.name: int(np.prod(t.dims)) * 4 for t in model.graph.initializer if t.name in set(names)}


def test_terms_of_a_small_mlp_plan() -> None:
    model = _model()
    plan = build_pipeline(model, "cross_entropy", SGD(lr=0.1), batch=BATCH, stages=2, micro_batches=M, backend="tvm")
    micro = BATCH // M
    activation = micro * HIDDEN * 4  # the cut of an mlp of equal hidden layers: one (micro, hidden) value
    for s, st in enumerate(plan.stages):
        t = _terms(plan, s)
        w = _weight_bytes(model, st.weights)
        assert set(w) == set(st.weights)
        assert t.state == sum(w.values())  # SGD: the weights, no slots
        # each micro-batch's activation goes forward and its gradient back, copied until the flush
        assert t.sends == M * activation
        # the prepare program's outputs (weight transposes, at most one per matrix); nothing is
        # lifted (every weight is under hoist.LIFT_MIN_BYTES)
        prepared = sum(int(np.prod([d.dim_value for d in o.type.tensor_type.shape.dim])) * 4
                       for o in st.prepare.graph.output)
        assert 0 < t.step_constants == prepared <= sum(b for n, b in w.items() if n.endswith(".weight"))
        # the accumulator and one backward call's outputs: the weight gradients again, plus the
        # input gradient sent back (stage 1) and the loss
        assert t.gradients >= 2 * sum(w.values()) + (activation if s == 1 else 0)
        assert t.pool > 0
    first, last = (_terms(plan, s) for s in (0, 1))
    # stage 0 stashes the micro-batches in flight (1F1B on 2 stages: 2), the last stage none
    assert first.stash >= 2 * activation and last.stash == 0


def test_predict_training_charges_the_rule_on_tvm_only(monkeypatch) -> None:
    model = _model()
    kw = dict(batch=BATCH, micro_batches=M, loss="cross_entropy")
    plan = build_pipeline(model, "cross_entropy", SGD(lr=1e-3), batch=BATCH, stages=2, micro_batches=M, backend="tvm")
    tvm = predict_training(model, "pipeline", 2, backend="tvm", **kw).memory_per_rank
    assert tvm == pytest.approx([_terms(plan, s).total for s in range(2)])
    ort = predict_training(model, "pipeline", 2, backend="onnxruntime", **kw).memory_per_rank
    monkeypatch.setattr(memory, "TVM_STAGE_MEMORY", False)
    off = predict_training(model, "pipeline", 2, backend="tvm", **kw).memory_per_rank
    assert off != pytest.approx(tvm)
    assert ort != pytest.approx(tvm)


def test_pool_counts_each_programs_plan(monkeypatch) -> None:
    """``TVM_STAGE_PLANNED_POOL``: a program with a memory plan counts the plan's bytes in the pool
    term, one without (``planned`` answers None) its graph's peak, and with the knob off every
    program its graph's peak. The real plans of this stage differ from the graphs' peaks."""
    plan = build_pipeline(_model(), "cross_entropy", SGD(lr=0.1), batch=BATCH, stages=2, micro_batches=M,
                          backend="tvm")
    st = plan.stages[0]
    programs = memory.stage_programs(st)
    assert len(programs) >= 2
    graphs = {k: memory.pool_bytes(st, {k: p}) for k, p in programs.items()}
    assert memory.pool_bytes(st, programs) == pytest.approx(sum(graphs.values()))
    assert memory.pool_bytes(st, programs, lambda p: PlannedBytes(1000.0, 24.0)) == 1024.0 * len(programs)
    first = next(iter(programs))
    mixed = memory.pool_bytes(st, programs, lambda p: None if p is programs[first] else PlannedBytes(0.0, 8.0))
    assert mixed == pytest.approx(graphs[first] + 8.0 * (len(programs) - 1))
    real = memory.pool_bytes(st, programs, planned_bytes)
    assert real == pytest.approx(sum(planned_bytes(p).total for p in programs.values()))
    assert real != pytest.approx(sum(graphs.values()))
    monkeypatch.setattr(memory, "TVM_STAGE_PLANNED_POOL", False)
    assert memory.pool_bytes(st, programs, lambda p: PlannedBytes(1000.0, 24.0)) == pytest.approx(sum(graphs.values()))


@pytest.mark.slow
def test_measured_peak_of_a_tvm_stage_within_25_percent(monkeypatch) -> None:
    """The zoo bert's last stage (``train_step.py``'s size, 8 micro-batches), 3 steps in a fresh
    process (``benchmarks/pipeline_stage_memory.py``): predicted within 25% of measured; the rule
    without its pool term, and rule 3's sum (the knob off), are not. Measured in this process
    after the rest of the slow suite, the peak came out 56.5 MiB against 87.4 predicted (the
    earlier tests' freed heap served the stage's allocations without growing the RSS); alone it
    passed, so the measurement runs in a process of its own."""
    import re
    import subprocess
    import sys

    from tests.bench_scripts import ROOT

    stages = load("pipeline_stages")
    model, loss, batch, _feed, _y = stages.case("bert")
    plan = build_pipeline(model, loss, SGD(lr=1e-3), batch=batch, stages=2, micro_batches=stages.MICRO_BATCHES,
                          backend="tvm")
    counts = stashed_micro_batches(plan.schedule, 2, stages.MICRO_BATCHES, plan.extra_warmup)
    terms = memory.tvm_stage_memory(plan.stages[1], micro_batches=stages.MICRO_BATCHES, in_flight=counts[1],
                                    constant_inputs=step_constant_inputs, planned=planned_bytes)
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "pipeline_stage_memory.py"), "--model", "bert",
                          "--stage", "1", "--steps", "3"], capture_output=True, text=True, check=True, timeout=1200).stdout
    measured = max(float(v) for v in re.findall(r"peak\s+([0-9.]+) MiB", out)) * 2**20
    assert abs(terms.total - measured) <= 0.25 * measured, (terms, measured)
    assert abs(terms.total - terms.pool - measured) > 0.25 * measured
    monkeypatch.setattr(memory, "TVM_STAGE_MEMORY", False)
    old = predict_training(model, "pipeline", 2, batch=batch, micro_batches=stages.MICRO_BATCHES, loss=loss,
                           backend="tvm").memory_per_rank[1]
    assert abs(old - measured) > 0.25 * measured
