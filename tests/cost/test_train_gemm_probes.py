"""cost.training.TRAIN_GEMM_PROBES: a training step's forward products whose weight is a graph
input (the step's state, which ONNX Runtime packs on every call; a constant it prepacks once)
are priced on the calibrated ``gemm_train`` / ``gemm_large_train`` pair, not on the ``gemm`` /
``gemm_large`` probes' constant-weight values. Hand-built step and efficiency table: no timing.
Fails with the knob off (the forward products at the constant-weight values)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from partitioner.cluster import Device
from partitioner.cost import training as ct

from tests.cost.test_deferred_wgrad_price import _two_layer_step

TABLE = {"gemm": 1.0, "gemm_large": 1.0, "gemm_train": 0.5, "gemm_large_train": 0.5, "gemm_backward": 1.0}


def _device(table: dict[str, float]) -> Device:
    return replace(Device("d", "cpu", {"float32": 1e11}, 1e9, 2.5e10, 1.0, 0.0, dict(table)), runtime="onnxruntime")


@pytest.mark.parametrize("on", [True, False])
def test_forward_products_of_the_state_at_the_train_pair(monkeypatch, on) -> None:
    """fc1 and fc2 read their weights w1, w2 (graph inputs of the step): half the efficiency, twice
    the time with the rule; the backward products keep ``gemm_backward``."""
    monkeypatch.setattr(ct, "TRAIN_GEMM_PROBES", on)
    step = _two_layer_step()
    with_pair = {n.name: t for n, _, t in ct.priced_step_nodes(step.graph, _device(TABLE))}
    constant = {n.name: t for n, _, t in ct.priced_step_nodes(
        step.graph, _device({k: v for k, v in TABLE.items() if not k.endswith("_train")}))}
    for name in ("fc1", "fc2"):
        assert with_pair[name] == pytest.approx(constant[name] * (2.0 if on else 1.0), rel=1e-9)
    backward = [n.name for n in step.graph if n.op_type == "MatMul" and n.metadata_props.get(ct.FORWARD_NODE_KEY)]
    assert backward and all(with_pair[b] == pytest.approx(constant[b], rel=1e-9) for b in backward)


def test_a_product_of_activations_is_not_the_state() -> None:
    """A MatMul whose second operand a node computes (here fc2's input gradient, dy x W2^T's
    transposed weight) is not a state product: the device is returned as it is."""
    step = _two_layer_step()
    device = _device(TABLE)
    computed = [n for n in step.graph if n.op_type == "MatMul" and n.inputs[1].producer() is not None]
    assert computed
    assert all(ct.train_gemm_device(device, n, "gemm") is device for n in computed)
    fc1 = next(n for n in step.graph if n.name == "fc1")
    assert ct.train_gemm_device(device, fc1, "gemm").efficiency_by_class["gemm"] == 0.5


def test_training_gemm_probes_take_the_weight_as_an_input() -> None:
    """The calibration's ``gemm_train`` / ``gemm_large_train`` MatMuls and ``gemm_backward``'s
    input-gradient Gemm take the weight as a graph input (no constant weights), as the step does;
    fails with ``GEMM_TRAIN_PROBES`` or ``DGRAD_WEIGHT_INPUT`` off."""
    from partitioner.calibrate import backward_kernels

    kernels = backward_kernels()
    by_class = {k.op_class: k for k in kernels if k.op_class in ("gemm_train", "gemm_large_train")}
    assert sorted(by_class) == ["gemm_large_train", "gemm_train"]
    dgrad = [k for k in kernels if k.name.startswith("gemm_dgrad")]
    for k in (*by_class.values(), *dgrad):
        assert not k.weights and "w" in dict(k.inputs), k.name
    assert dgrad
