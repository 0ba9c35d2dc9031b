"""Whole-model checks on the zoo: gradients against float64 finite differences, and the
training step on ONNX Runtime and on TVM (one device) giving the same loss within 1e-4 with the
loss going down over 3 steps on a fixed seeded batch.

Models are small instances (a few layers, small images/sequences). mlp (and bert's gradient check) are in the
fast suite; the others are slow-marked (each TVM build of a training step takes tens of seconds).
"""

from __future__ import annotations

import numpy as np
import pytest

import models_zoo
from benchmarks.heldout_models import HELDOUT, TINY
from partitioner.training import SGD, build_training_graph, signature
from partitioner.training.runner import StepRunner
from tests.training.gradcheck import assert_same_descending_losses, finite_differences, gradients, to_float64

# name -> (builder kwargs, loss, learning rate)
ZOO = {
    "mlp": ({"batch": 4, "hidden": 32, "in_features": 16}, "cross_entropy", 0.1),
    "bert": ({"batch": 2, "seq": 8, "hidden": 32, "heads": 2, "layers": 1, "vocab": 50}, "mse", 0.5),
    "gpt": ({"batch": 2, "seq": 8, "hidden": 32, "heads": 2, "layers": 1, "vocab": 50}, "cross_entropy", 0.5),
    "resnet": ({"batch": 16, "image": 32, "width": 8, "classes": 10}, "cross_entropy", 0.01),
    "inception": ({"batch": 2, "image": 32, "blocks": 1, "classes": 10}, "cross_entropy", 0.01),
    "unet": ({"batch": 2, "image": 32}, "mse", 0.01),
    "mobilenet": ({"batch": 8, "image": 64, "width_mult": 0.25, "classes": 10}, "cross_entropy", 0.001),
}
FAST = {"mlp", "bert"}
#: smaller instances for the float64 finite differences (ORT has no float64 Conv: onnx.reference runs them)
FD_KWARGS = {"resnet": {"batch": 2, "image": 32, "width": 4, "classes": 10}}


def _batch(model, loss: str, seed: int = 0) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """Seeded data for the model's inputs and labels for ``loss``."""
    rng = np.random.default_rng(seed)
    data = {}
    for vi in model.graph.input:
        if vi.name in {t.name for t in model.graph.initializer}:
            continue
        shape = [d.dim_value for d in vi.type.tensor_type.shape.dim]
        if vi.type.tensor_type.elem_type == 7:  # int64 token ids
            data[vi.name] = rng.integers(0, 50, shape).astype(np.int64)
        else:
            data[vi.name] = rng.standard_normal(shape).astype(np.float32)
    out = model.graph.output[0]
    oshape = [d.dim_value for d in out.type.tensor_type.shape.dim]
    labels = (rng.integers(0, oshape[-1], oshape[:-1]).astype(np.int64) if loss == "cross_entropy"
              else rng.standard_normal(oshape).astype(np.float32))
    return data, labels


def _params(names, fast=frozenset(FAST)):
    return [n if n in fast else pytest.param(n, marks=pytest.mark.slow) for n in names]


@pytest.mark.parametrize("name", _params(["mlp", "bert", "gpt", "resnet"]))
def test_zoo_gradients_match_finite_differences(name: str) -> None:
    kwargs, loss, _ = ZOO[name]
    model = to_float64(models_zoo.build(name, **FD_KWARGS.get(name, kwargs)))
    data, labels = _batch(model, loss)
    data = {k: (v.astype(np.float64) if v.dtype == np.float32 else v) for k, v in data.items()}
    feeds = {**data, "labels": labels.astype(np.float64) if loss == "mse" else labels}
    value, grads, prog, weights = gradients(model, feeds, loss)
    assert np.isfinite(value)
    # two entries of each of up to 8 weights spread over the depth of the model
    names = sorted(weights)
    picked = {n: weights[n] for n in names[:: max(1, len(names) // 8)]}
    bad = finite_differences(prog, {**feeds, **{k: v for k, v in weights.items() if k not in picked}}, picked,
                             grads, per_weight=2, rtol=1e-4, atol=1e-7)
    assert not bad, "; ".join(bad[:5])


#: Models whose 3-step trajectory is ill-conditioned in float32: under ONNX Runtime alone, a 1e-6
#: relative perturbation of the start weights moves the third loss of the zoo mobilenet by 5e-3
#: (batch 8, image 64, lr 1e-3; measured with ORT, BN over small batches of ReLU6-clipped
#: channels). Two float32 backends cannot agree to 1e-4 there, so only the first step's loss is
#: compared to 1e-4, and the loss must go down over 3 steps on both backends.
ILL_CONDITIONED = {"mobilenet"}


@pytest.mark.parametrize("name", _params(list(ZOO), fast=frozenset({"mlp"})))
def test_zoo_step_same_loss_on_ort_and_tvm_and_loss_goes_down(name: str, tmp_path) -> None:
    kwargs, loss, lr = ZOO[name]
    model = models_zoo.build(name, **kwargs)
    step = build_training_graph(model, loss=loss, optimizer=SGD(lr))
    data, labels = _batch(model, loss)
    assert_same_descending_losses(step, data, labels, tmp_path, compared=1 if name in ILL_CONDITIONED else 3)
    assert set(signature(step).weights) <= set(StepRunner(step, backend="onnxruntime").weights())


#: non-zoo builders (benchmarks/heldout_models.py) at their TINY sizes, batch 4: loss and learning
#: rate. heldout_mbv2's last stages are 1x1 maps whose BatchNorms normalise 4 values per channel:
#: its gradient's squared norm is about 1e5 (float64, checked against finite differences), so at
#: lr 1e-2 or 1e-3 one step overshoots (the loss rises under ONNX Runtime alone) and a 1e-6
#: relative perturbation of the start weights moves its third loss by 5e-2; at 1e-6 it descends
#: and the backends agree to 1e-5.
HELDOUT_LOSS = {"heldout_unet": ("mse", 0.01), "heldout_vit": ("cross_entropy", 0.01),
                "heldout_mbv2": ("cross_entropy", 1e-6), "heldout_inception": ("cross_entropy", 0.01)}


@pytest.mark.parametrize("name", _params(sorted(HELDOUT_LOSS), fast=frozenset({"heldout_unet"})))
def test_heldout_step_same_loss_on_ort_and_tvm_and_loss_goes_down(name: str, tmp_path) -> None:
    """Models the rules were not written for: heldout_unet's bilinear Resize (linear rule),
    heldout_vit's class-token Gather on axis 1, mbv2's depthwise convs and ReLU6 (Clip)."""
    model = HELDOUT[name](batch=4, seed=0, **TINY[name])
    loss, lr = HELDOUT_LOSS[name]
    step = build_training_graph(model, loss=loss, optimizer=SGD(lr))
    data, labels = _batch(model, loss)
    assert_same_descending_losses(step, data, labels, tmp_path)


@pytest.mark.slow
def test_zoo_mlp_gradients_match_relax_gradient() -> None:
    """The whole zoo mlp (MatMul, Add, Relu, Gemm) against TVM Relax's relax.transform.Gradient
    of the same float64 forward model + MSE loss (the other zoo models hold ops Relax cannot
    differentiate: take/erf in bert and gpt, max_pool2d with padding in resnet)."""
    from tests.training.gradcheck import relax_gradients, with_mse_loss

    kwargs, _, _ = ZOO["mlp"]
    model = to_float64(models_zoo.build("mlp", **kwargs))
    data, _ = _batch(model, "mse")
    data = {k: v.astype(np.float64) for k, v in data.items()}
    labels = np.random.default_rng(2).standard_normal((4, 10))
    value, grads, _, weights = gradients(model, {**data, "labels": labels}, "mse")
    rloss, rgrads = relax_gradients(with_mse_loss(model, model.graph.output[0].name), {**data, "labels": labels},
                                    weights)
    assert abs(rloss - value) <= 1e-9 + 1e-6 * abs(value)
    for name, g in grads.items():
        np.testing.assert_allclose(g, rgrads[name], rtol=1e-6, atol=1e-9, err_msg=name)
