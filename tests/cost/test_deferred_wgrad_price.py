"""cost.training rule 9 (``PRICE_DEFERRED_WGRAD``): a pipeline whose last stage defers its weight
gradients (pipeline rule 10) is priced as it runs: the last stage's micro-batches without their
weight-gradient-only nodes and without accumulation, plus the whole-batch weight-gradient
program's time beyond the earlier stages' drain."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper, numpy_helper

from partitioner.cost import training as ct
from partitioner.training import SGD, build_training_graph


def _two_layer_step() -> ir.Model:
    """x[4,8] -> MatMul w1 -> Add b1 -> Relu -> MatMul w2 -> y[4,3], cross-entropy, SGD."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal((8, 16)).astype(np.float32), "w1"),
             numpy_helper.from_array(np.zeros(16, np.float32), "b1"),
             numpy_helper.from_array(rng.standard_normal((16, 3)).astype(np.float32), "w2")]
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"], name="fc1"),
             helper.make_node("Add", ["h", "b1"], ["hb"], name="bias1"),
             helper.make_node("Relu", ["hb"], ["r"], name="relu"),
             helper.make_node("MatMul", ["r", "w2"], ["y"], name="fc2")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 3])], inits)
    step = build_training_graph(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]),
                                optimizer=SGD(lr=0.1))
    return step if isinstance(step, ir.Model) else ir.serde.deserialize_model(step)


def test_weight_gradient_only_nodes() -> None:
    """W = the weight products and the bias sum (and their operands' transposes); fc2's input
    gradient, the ReLU gradient's Where, the loss and the update are not."""
    step = _two_layer_step()
    only = ct.weight_gradient_only(step.graph)
    by_key: dict[str, list[str]] = {}
    for n in only:
        by_key.setdefault(n.metadata_props[ct.FORWARD_NODE_KEY], []).append(n.op_type)
    assert sorted(by_key) == ["bias1", "fc1", "fc2"]
    assert sorted(by_key["fc2"]) == ["MatMul", "Transpose"]  # dW2 = r^T dy (dx = dy W2^T stays)
    assert sorted(by_key["fc1"]) == ["MatMul", "Transpose"]
    assert "ReduceSum" in by_key["bias1"]
    fc2_products = [n for n in step.graph if n.op_type == "MatMul"
                    and n.metadata_props.get(ct.FORWARD_NODE_KEY) == "fc2"]
    assert len(fc2_products) == 2 and sum(n in only for n in fc2_products) == 1
    assert not any(n.op_type == "Where" for n in only)


def _profile(deferred: ct.DeferredWeightGradients | None) -> ct._Profile:
    """Four forward nodes, two per stage; seconds chosen by hand, no weights (no accumulation)."""
    ms = 1e-3
    return ct._Profile(forward=np.array([1.0, 1.0, 2.0, 2.0]) * ms, backward=np.array([2.0, 2.0, 6.0, 6.0]) * ms,
                       activation=np.zeros(4), weight=np.zeros(4), names=["a", "b", "c", "d"], graph=SimpleNamespace(inputs=[]),
                       weight_tensors=np.zeros(4), optimizer_s=0.0, deferred=deferred)


@pytest.mark.parametrize("on", [True, False])
def test_pipeline_prices_the_deferred_last_stage(monkeypatch, on) -> None:
    """Stage 0 = a, b: 2 + 4 ms a micro-batch; stage 1 = c, d: 4 + 12 ms, 4 of them weight
    gradients, which take 10 ms once at the whole batch. 1F1B x8, free sends:
    without deferral 6 + 16 + 7 x 16 = 134 ms; deferred 6 + 12 + 7 x 12 = 102 ms, plus the
    whole-batch program's 10 ms beyond stage 0's last backward (4 ms): 108 ms."""
    monkeypatch.setattr(ct, "PRICE_DEFERRED_WGRAD", on)
    monkeypatch.setattr(ct, "cut_bytes", lambda graph, end: 0.0)
    cluster = SimpleNamespace()
    monkeypatch.setattr("partitioner.cost.comm.collective_time",
                        lambda *a, **k: SimpleNamespace(seconds=0.0))
    device = SimpleNamespace(memory_bandwidth=1e10, efficiency_by_class={})
    ms = 1e-3
    d = ct.DeferredWeightGradients(micro=np.array([0.0, 0.0, 2.0, 2.0]) * ms,
                                   whole=np.array([0.0, 0.0, 5.0, 5.0]) * ms, nodes=np.array([0, 0, 2, 2]))
    pred = ct.pipeline(_profile(d), [1, 3], 16, 0, "1f1b", 8, cluster, device)
    assert pred.step_time_s == pytest.approx((108.0 if on else 134.0) * ms)
    assert pred.breakdown["deferred_tail_s"] == pytest.approx((6.0 if on else 0.0) * ms)
    plain = ct.pipeline(_profile(None), [1, 3], 16, 0, "1f1b", 8, cluster, device)
    assert plain.step_time_s == pytest.approx(134.0 * ms)  # a plan that does not defer: as before
