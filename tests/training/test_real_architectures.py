"""onnx's nine real architectures (``models_zoo.light``: AlexNet, DenseNet-121, Inception v1/v2,
ResNet-50, ShuffleNet, SqueezeNet, VGG-19, ZFNet; exported by other tools, their weights constant)
as training inputs: every op they hold has a gradient rule (AlexNet, GoogLeNet and ZFNet need LRN's),
and SqueezeNet's ``[N, 1000, 1, 1]`` head is read with its classes on axis 1."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

import models_zoo
from models_zoo.light import light_names
from partitioner.training import SGD, build_training_graph, signature
from partitioner.training.runner import StepRunner
from tests.training.gradcheck import assert_same_descending_losses

#: the step builds take 7-30 s for these (large fully connected weights); slow-marked
SLOW = {"light_bvlc_alexnet", "light_vgg19", "light_zfnet512"}


def _data(model) -> dict[str, np.ndarray]:
    inits = {t.name for t in model.graph.initializer}
    vi = next(v for v in model.graph.input if v.name not in inits)
    shape = [d.dim_value for d in vi.type.tensor_type.shape.dim]
    return {vi.name: np.random.default_rng(0).standard_normal(shape).astype(np.float32)}


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n for n in light_names()])
def test_every_real_architecture_builds_a_training_step(name: str) -> None:
    step = build_training_graph(models_zoo.build(name, batch=1), loss="cross_entropy", optimizer=SGD(0.01))
    assert signature(step).weights  # something to train


def test_unit_spatial_softmax_head_has_its_classes_on_axis_1() -> None:
    """The step's loss is cross-entropy over the 1000 classes of axis 1, not over the last axis's
    single class (always 0); the head is a Softmax, so it is ``-log p[label]`` of the forward
    model's own output (computed here by numpy), not log_softmax over those probabilities."""
    model = models_zoo.build("light_squeezenet", batch=1)
    out = model.graph.output[0]
    assert [d.dim_value for d in out.type.tensor_type.shape.dim] == [1, 1000, 1, 1]
    step = build_training_graph(model, loss="cross_entropy", optimizer=SGD(0.01))
    data, labels = _data(model), np.array([417], dtype=np.int64)
    probs = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, data)[0]
    p = probs.reshape(1, 1000).astype(np.float64)
    assert abs(p.sum() - 1) < 1e-5  # probabilities
    expected = -np.log(p[0, 417])
    loss = StepRunner(step, backend="onnxruntime").step(data, labels)
    np.testing.assert_allclose(loss, expected, rtol=1e-5)
    squashed = -np.log(np.exp(p[0, 417]) / np.exp(p).sum())  # log_softmax over the probabilities
    assert abs(expected - squashed) > 1e-3 * expected  # the two readings differ on this input


@pytest.mark.slow
def test_lrn_architecture_trains_with_the_same_loss_on_ort_and_tvm(tmp_path) -> None:
    """GoogLeNet (inception_v1: LRN after its stem, a Softmax head), 3 SGD steps: the same loss
    within 1e-4 on both backends, going down (lr 1e-4: at 1e-2 one sample is learnt in one step)."""
    model = models_zoo.build("light_inception_v1", batch=1)
    step = build_training_graph(model, loss="cross_entropy", optimizer=SGD(1e-4))
    assert_same_descending_losses(step, _data(model), np.array([3], dtype=np.int64), tmp_path)
