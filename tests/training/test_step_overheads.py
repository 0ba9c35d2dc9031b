"""Cost rule 7 (fixed per-step, per-call, per-node costs) and rule 8 (pipeline gradient
accumulation), and their calibration (partitioner/training/overheads.py)."""

from __future__ import annotations

import numpy as np
import pytest

import models_zoo
from partitioner.cost.training import StepOverheads
from partitioner.training.optimizers import SGD
from partitioner.training.overheads import calibrate, chain, fan
from partitioner.training.plan import predict_training
from partitioner.training.step import build_training_graph, step_program


@pytest.fixture(scope="module")
def mlp():
    return models_zoo.build("mlp", batch=16, hidden=32, in_features=16)


def test_calibration_probes_and_figures() -> None:
    """The probes are what rule 1 says (n Add nodes in a chain; k Identity pairs), and the
    figures are finite and non-negative, a program call dearer than one node."""
    assert [n.op_type for n in chain(5).graph.node] == ["Add"] * 5
    f = fan(3)
    assert len(f.graph.input) == len(f.graph.output) == len(f.graph.node) == 3
    o = calibrate("onnxruntime", repeat=30)
    figs = [o.per_step_s, o.per_call_s, o.per_node_s, o.per_array_s, o.per_output_byte_s, o.per_micro_batch_s]
    assert all(np.isfinite(x) and x >= 0 for x in figs)
    assert o.per_call_s > o.per_node_s and o.per_call_s > 0


def test_fixed_costs_count_the_step_graphs_nodes_and_calls(mlp) -> None:
    """Rule 7: with only a per-node cost, a 1-rank step's fixed part is that cost times the built
    step program's node count; with only a per-call cost, one call (single) or one per segment
    between its AllReduces (data: one bucket, two calls); without overheads nothing is added."""
    nodes = len(step_program(build_training_graph(mlp, loss="cross_entropy", optimizer=SGD(lr=0.1))).graph.node)
    base = predict_training(mlp, "single", 1, batch=16)
    per_node = predict_training(mlp, "single", 1, batch=16, overheads=StepOverheads(per_node_s=1e-3))
    assert base.breakdown["fixed_s"] == 0
    assert per_node.breakdown["fixed_s"] == pytest.approx(nodes * 1e-3, rel=1e-9)
    assert per_node.step_time_s == pytest.approx(base.step_time_s + nodes * 1e-3, rel=1e-9)
    call = StepOverheads(per_call_s=1e-3, per_step_s=2e-3)
    assert predict_training(mlp, "single", 1, batch=16, overheads=call).breakdown["fixed_s"] == pytest.approx(3e-3)
    data = predict_training(mlp, "data", 2, batch=16, overheads=call)
    assert data.breakdown["fixed_s"] == pytest.approx(4e-3)


def test_pipeline_pays_calls_per_micro_batch(mlp) -> None:
    """Rule 7: a pipeline step's fixed part grows with the micro-batches (two calls per
    micro-batch on stage 0, one fused on the last stage, plus the runner's Python), and rule 8's
    accumulation makes more micro-batches cost more even without overheads."""
    call = StepOverheads(per_call_s=1e-3, per_micro_batch_s=1e-4)
    p4 = predict_training(mlp, "pipeline", 2, batch=16, micro_batches=4, overheads=call)
    p8 = predict_training(mlp, "pipeline", 2, batch=16, micro_batches=8, overheads=call)
    # stage 0 (2 calls + the runner per micro-batch) bounds the fill-drain; the last stage (4-row
    # micro-batches: it defers its weight gradients, pipeline rule 10) makes 1 update call and
    # 1 whole-batch weight-gradient call (cost rule 9)
    assert p4.breakdown["fixed_s"] == pytest.approx(4 * 2.1e-3 + 2e-3, rel=1e-9)
    assert p8.step_time_s - p4.step_time_s >= 4 * 2.1e-3
    bare4 = predict_training(mlp, "pipeline", 2, batch=16, micro_batches=4)
    bare8 = predict_training(mlp, "pipeline", 2, batch=16, micro_batches=8)
    assert bare4.breakdown["fixed_s"] == 0 and bare8.step_time_s > bare4.step_time_s
