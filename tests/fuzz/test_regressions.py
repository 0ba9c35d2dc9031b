"""Regression tests for the bugs the differential fuzzer found: one hand-written minimal model per
bug (docs/fuzzing.md describes each). Every test compares against unpartitioned ONNX Runtime on
seeded inputs (rtol 1e-4, atol 1e-5), or checks the strategy now refuses with a one-line
StrategyNotApplicable.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from partitioner.core.errors import StrategyNotApplicable

from .differential import check_reference, ort_outputs, partition_graph, run_tvm_ranks, seeded_feeds
from .graph_strategy import FuzzGraph, FuzzPlan


def _model(nodes, inputs, outputs, inits=()) -> onnx.ModelProto:  # noqa: ANN001
    g = helper.make_graph(nodes, "regression", [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in inputs],
                          [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in outputs], list(inits))
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.checker.check_model(m, full_check=True)
    return m


def _assert_matches_ort(model: onnx.ModelProto, got: dict[str, np.ndarray]) -> None:
    want = ort_outputs(model, seeded_feeds(model))
    for name, w in want.items():
        assert got[name].shape == w.shape, name
        np.testing.assert_allclose(got[name], w, rtol=1e-4, atol=1e-5, err_msg=name)


# -- bug 1: micro-batching an output whose batch axis is not axis 0 -------------------------------

def transposed_batch_output() -> onnx.ModelProto:
    """x[4,2,3] -> Relu -> Transpose(perm 1,0,2) -> y[2,4,3]: the output carries the batch on axis 1."""
    return _model([helper.make_node("Relu", ["x"], ["r"]),
                   helper.make_node("Transpose", ["r"], ["y"], perm=[1, 0, 2])],
                  [("x", [4, 2, 3])], [("y", [2, 4, 3])])


def test_pipeline_microbatches_refuses_output_with_batch_off_axis_0() -> None:
    """Was: pipeline x2 with 2 micro-batches concatenated the micro-batches of y on axis 0 and
    returned y[4,2,3] (silently wrong shape). Now: StrategyNotApplicable naming the output."""
    fg = FuzzGraph(transposed_batch_output(), 1, ())
    with pytest.raises(StrategyNotApplicable, match="output 'y' carries the batch on axis 1") as info:
        partition_graph(fg, FuzzPlan("pipeline", 2, 2))
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("plan", [FuzzPlan("pipeline", 2, 1), FuzzPlan("auto", 2, None), FuzzPlan("data", 2, None)])
def test_transposed_batch_output_matches_ort(plan: FuzzPlan) -> None:
    """Each of these plans applies to this model (checked: no refusal is accepted) and matches."""
    outcome = check_reference(FuzzGraph(transposed_batch_output(), 1, ()), plan)
    assert outcome.status == "ok", f"{outcome.status}: {outcome.detail}"


# -- bug 2: micro-batching a constant that is the size of the batch -------------------------------

def batch_sized_constant() -> onnx.ModelProto:
    """y = Tanh(c - Relu(x)) with a constant c[4,3] the size of the batch (it does not broadcast)."""
    c = numpy_helper.from_array(np.linspace(-1, 1, 12, dtype=np.float32).reshape(4, 3), "c")
    return _model([helper.make_node("Relu", ["x"], ["r"]), helper.make_node("Sub", ["c", "r"], ["s"]),
                   helper.make_node("Tanh", ["s"], ["y"])],
                  [("x", [4, 3])], [("y", [4, 3])], [c])


def test_pipeline_microbatches_refuses_batch_sized_constant() -> None:
    """Was: each micro-batch ran Sub(c[4,3], r[2,3]) -> ONNX Runtime refused the segment
    (incompatible dimensions), or with batch 3 / 3 micro-batches it broadcast to [3,..] and the
    Recv on the next stage failed. Now: StrategyNotApplicable naming the constant."""
    fg = FuzzGraph(batch_sized_constant(), 1, ())
    with pytest.raises(StrategyNotApplicable, match="'c'"):
        partition_graph(fg, FuzzPlan("pipeline", 2, 2))


@pytest.mark.parametrize("plan", [FuzzPlan("auto", 2, None), FuzzPlan("auto", 4, None), FuzzPlan("data", 2, None),
                                  FuzzPlan("pipeline", 2, 1)])
def test_batch_sized_constant_matches_ort(plan: FuzzPlan) -> None:
    """auto used to pick pipeline with micro-batches here and crash; data slices c per rank."""
    model = batch_sized_constant()
    outcome = check_reference(FuzzGraph(model, 1, ()), plan)
    assert outcome.status == "ok", f"{outcome.status}: {outcome.detail}"


# -- bug 3: TVM returned a view of its (reused) input buffer as an output -------------------------

def flatten_of_input_output() -> onnx.ModelProto:
    """f = Flatten(x) is an output of stage 0; s = Sigmoid(Tanh(Relu(x))) ends on stage 1."""
    return _model([helper.make_node("Flatten", ["x"], ["f"], axis=1), helper.make_node("Relu", ["x"], ["r"]),
                   helper.make_node("Tanh", ["r"], ["t"]), helper.make_node("Sigmoid", ["t"], ["s"])],
                  [("x", [4, 4, 8])], [("s", [4, 4, 8]), ("f", [4, 32])])


def test_tvm_output_view_of_input_survives_next_microbatch(tmp_path: Path) -> None:
    """Was: with 2 micro-batches, rank 0's output f (a Flatten = view of the persistent input
    buffer) was returned without a copy, so micro-batch 2's input overwrote micro-batch 1's f
    (max |diff| 3.2). Now the executable copies outputs that share memory with an input buffer."""
    model = flatten_of_input_output()
    res = partition_graph(FuzzGraph(model, 1, ()), FuzzPlan("pipeline", 2, 2))
    assert res.bindings.microbatches == 2
    got = run_tvm_ranks(res.programs, res.bindings, seeded_feeds(model), tmp_path)
    _assert_matches_ort(model, got)


def test_flatten_of_input_output_reference_backend() -> None:
    outcome = check_reference(FuzzGraph(flatten_of_input_output(), 1, ()), FuzzPlan("pipeline", 2, 2))
    assert outcome.status == "ok", outcome.detail
