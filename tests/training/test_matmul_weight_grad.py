"""linear.py's flat MatMul weight gradient rule: ``y = a @ W`` with a batched ``a`` and a 2-D
``W`` takes ``dW`` as one Gemm over the flattened rows (transA=1), with no batched MatMul to a
``[*B, K, N]`` intermediate and no ReduceSum over the batch; with the rule off, the batched form.
Both forms are checked against central finite differences (float64, ORT; tolerances of
``tests/training/gradcheck.py``) and against each other (rtol 1e-10)."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from tests.training.gradcheck import finite_differences, gradients

#: name -> (a shape, W shape, y shape); a batched over one and two leading axes
CASES = {"3d": ((2, 3, 4), (4, 5), (2, 3, 5)), "4d": ((2, 2, 3, 4), (4, 5), (2, 2, 3, 5))}


def _model(case: str):
    sa, sw, sy = CASES[case]
    rng = np.random.default_rng(4321)  # the same operands for both forms
    inits = [numpy_helper.from_array(rng.standard_normal(sa), "a"), numpy_helper.from_array(rng.standard_normal(sw), "w")]
    node = helper.make_node("MatMul", ["a", "w"], ["y"], name="proj")
    graph = helper.make_graph([node], case, [], [helper.make_tensor_value_info("y", TensorProto.DOUBLE, list(sy))],
                              initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 8
    return model


def _count(prog, op_type: str) -> int:
    return sum(1 for n in prog.graph.node if n.op_type == op_type)


@pytest.mark.parametrize("case", sorted(CASES))
def test_flat_weight_gradient_form(case: str, monkeypatch) -> None:
    from partitioner.training.rules import linear

    feeds = {"labels": np.random.default_rng(7).standard_normal(CASES[case][2])}
    results = {}
    for on in (True, False):
        monkeypatch.setattr(linear, "MATMUL_FLAT_WEIGHT_GRAD", on)
        loss, grads, prog, weights = gradients(_model(case), feeds, "mse", ["a", "w"])
        ops = [n.op_type for n in prog.graph.node]
        assert ("Gemm" in ops) == on, ops
        # MatMuls: the forward and dA, plus the batched dW with the rule off
        assert _count(prog, "MatMul") == (2 if on else 3), ops
        results[on] = [_count(prog, "ReduceSum")]
        bad = finite_differences(prog, feeds, weights, grads)
        assert not bad, f"{case} (flat form {on}): " + "; ".join(bad[:5])
        results[on] += [loss, grads]
    assert results[True][0] == results[False][0] - 1  # the batched form's ReduceSum over the batch (the loss has one)
    assert results[True][1] == pytest.approx(results[False][1], rel=1e-12)
    for name in ("a", "w"):
        np.testing.assert_allclose(results[True][2][name], results[False][2][name], rtol=1e-10, atol=1e-12)


def test_zoo_bert_step_has_no_batched_weight_gradient(monkeypatch) -> None:
    """The zoo bert's training step (2 layers, batch 4): every 2-D projection weight's gradient is
    a Gemm (12: q, k, v, o, fc1, fc2 per layer), and the only ReduceSum over a batch axis (the
    cost model's ``_sums_the_batch``) is the position embedding's (a broadcast Add, not a
    MatMul); with the rule off, the 12 weight gradients' batch sums are back."""
    import models_zoo
    from partitioner.cost.training import FORWARD_NODE_KEY, _sums_the_batch
    from partitioner.training.optimizers import make_optimizer
    from partitioner.training.rules import linear
    from partitioner.training.step import build_training_graph

    counts = {}
    for on in (True, False):
        monkeypatch.setattr(linear, "MATMUL_FLAT_WEIGHT_GRAD", on)
        model = models_zoo.build("bert", batch=4, seq=8, hidden=32, heads=2, layers=2, vocab=50)
        step = build_training_graph(model, loss="mse", optimizer=make_optimizer("sgd", 1e-3), batch=4)
        sums = [n.metadata_props.get(FORWARD_NODE_KEY) for n in step.graph if _sums_the_batch(n)]
        counts[on] = (sum(n.op_type == "Gemm" for n in step.graph), sums)
    assert counts[True][1] == ["embeddings.position"], counts
    assert len(counts[False][1]) == 13, counts
    assert counts[True][0] - counts[False][0] == 12, counts
