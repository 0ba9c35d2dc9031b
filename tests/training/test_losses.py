"""cross_entropy on an output that is already probabilities (a Softmax over the class axis) is
``-log p[label]``, read from the Softmax's logits; other Softmaxes and losses are left alone."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
from onnx import TensorProto, helper, numpy_helper

from partitioner.training import SGD, build_training_graph
from partitioner.training.losses import loss_input
from partitioner.training.runner import StepRunner

W = np.random.default_rng(0).standard_normal((4, 5)).astype(np.float32)


def _model(softmax_axis: int | None, out_shape=(3, 5)) -> onnx.ModelProto:
    nodes = [helper.make_node("MatMul", ["x", "w"], ["z"])]
    out = "z"
    if softmax_axis is not None:
        nodes.append(helper.make_node("Softmax", ["z"], ["p"], axis=softmax_axis))
        out = "p"
    graph = helper.make_graph(nodes, "m", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 4])],
                              [helper.make_tensor_value_info(out, TensorProto.FLOAT, list(out_shape))],
                              initializer=[numpy_helper.from_array(W, "w")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_softmax_output_takes_minus_log_p_of_the_label() -> None:
    x = np.random.default_rng(1).standard_normal((3, 4)).astype(np.float32)
    labels = np.array([0, 3, 4], dtype=np.int64)
    z = (x @ W).astype(np.float64)
    p = np.exp(z - z.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    expected = -np.mean(np.log(p[np.arange(3), labels]))
    def first_loss(model: onnx.ModelProto) -> float:
        return StepRunner(build_training_graph(model, loss="cross_entropy", optimizer=SGD(0.1))).step({"x": x}, labels)

    loss = first_loss(_model(-1))
    np.testing.assert_allclose(loss, expected, rtol=1e-5)
    # the same model without its Softmax gives the same loss: the logits are what both read
    plain = first_loss(_model(None))
    np.testing.assert_allclose(loss, plain, rtol=1e-6)


def test_other_softmaxes_and_losses_read_the_output() -> None:
    over_batch = ir.serde.deserialize_model(_model(0)).graph  # a Softmax over axis 0: not the classes
    assert loss_input("cross_entropy", over_batch.outputs[0]).name == "p"
    model = ir.serde.deserialize_model(_model(-1)).graph
    assert loss_input("cross_entropy", model.outputs[0]).name == "z"
    assert loss_input("mse", model.outputs[0]).name == "p"
