"""cost.training rule 10 (``PRICE_STEP_CONSTANTS``): a TVM pipeline stage's convs over its weights
run without their per-call weight work (hoist rules 5 and 7), which runs once per step, and the
buffers that work leaves (the hoisted filters, the lifted packed copies) are in the stage's memory."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np
import onnx_ir as ir
import pytest

from partitioner.cluster import cpu_cluster
from partitioner.cost import training as ct
from partitioner.training import SGD, build_training_graph
from tests.training.test_training_cost import _two_convs

B, C, HW = 4, 32, 16
CONV_FLOPS = 2 * B * C * C * 9 * HW * HW  # one 3x3 conv of C -> C channels on HW x HW maps, batch B
W_BYTES = C * C * 9 * 4


def _two_conv_step() -> ir.Model:
    """x -> Conv(w1) -> Conv(w2) -> y, MSE, SGD: conv1's input is data (no input gradient), conv2's
    input gradient is a stride-1 ConvTranspose of w2 (TVM runs it as a Conv of the flipped w2)."""
    step = build_training_graph(_two_convs(B, C, HW), loss="mse", optimizer=SGD(lr=0.1))
    return step if isinstance(step, ir.Model) else ir.serde.deserialize_model(step)


def _tvm_device(e: float = 0.5):
    """A TVM rank whose weight-as-input convs (``conv_train``) run at half its constant-weight
    convs' efficiency; no small-map probes (every conv at its class value)."""
    return dataclasses.replace(cpu_cluster(1).devices[0], runtime="tvm",
                               efficiency_by_class={"conv": e, "conv_train": e / 2, "gemm": e})


@pytest.mark.parametrize("lift", [0.0, float("inf")])
def test_weight_work_is_the_weight_input_probe_beyond_the_constant_one(lift) -> None:
    """conv1: its forward conv's work is its time at ``conv_train`` (e/2) minus at ``conv`` (e):
    one conv's FLOPs at e. conv2: the same for its forward conv and for its input gradient (a
    Conv of the flipped weight, same FLOPs): twice that. Held: each conv's filter (hoisted), and
    its packed copy too when the weight is lifted (``lift`` bytes or more)."""
    dev = _tvm_device()
    step = _two_conv_step()
    c = ct.step_constant_prices(step.graph, dev, ["conv1", "conv2"], lift)
    one = CONV_FLOPS / (dev.peak("float32") * 0.5)
    assert c.work == pytest.approx([one, 2 * one], rel=1e-6)
    per = 2 if lift == 0.0 else 1
    assert c.held.tolist() == [per * W_BYTES, 2 * per * W_BYTES]


def test_onnxruntime_input_gradient_is_not_a_conv_over_the_weight() -> None:
    """On an ONNX Runtime rank the ConvTranspose stays one (no hoist rule runs there): only the
    forward convs count."""
    dev = dataclasses.replace(_tvm_device(), runtime="onnxruntime")
    c = ct.step_constant_prices(_two_conv_step().graph, dev, ["conv1", "conv2"], 0.0)
    assert c.held.tolist() == [2 * W_BYTES, 2 * W_BYTES]


def _profile(constants: ct.StepConstants | None) -> ct._Profile:
    """Four forward nodes, two per stage; seconds chosen by hand, no weights (no accumulation)."""
    ms = 1e-3
    return ct._Profile(forward=np.array([1.0, 1.0, 2.0, 2.0]) * ms, backward=np.array([2.0, 2.0, 6.0, 6.0]) * ms,
                       activation=np.zeros(4), weight=np.zeros(4), names=["a", "b", "c", "d"],
                       graph=SimpleNamespace(inputs=[]), weight_tensors=np.zeros(4), optimizer_s=0.0,
                       constants=constants)


@pytest.mark.parametrize("on", [True, False])
def test_pipeline_pays_the_weight_work_once_a_step(monkeypatch, on) -> None:
    """Stage 0 = a, b: 6 ms a micro-batch, 1 ms of it weight work; stage 1 = c, d: 16 ms, 3 of it.
    1F1B x8, free sends. Without the rule: 6 + 16 + 7 x 16 = 134 ms. With it: 5 + 13 + 7 x 13 =
    109 ms, plus the head: stage 0's 1 ms delays the fill, stage 1's 3 ms runs beside stage 0's
    first forward (2 ms) and delays it by 1 ms: 110 ms. Memory: each stage's held bytes."""
    monkeypatch.setattr(ct, "PRICE_STEP_CONSTANTS", on)
    monkeypatch.setattr(ct, "cut_bytes", lambda graph, end: 0.0)
    monkeypatch.setattr("partitioner.cost.comm.collective_time", lambda *a, **k: SimpleNamespace(seconds=0.0))
    device = SimpleNamespace(memory_bandwidth=1e10, efficiency_by_class={})
    ms = 1e-3
    c = ct.StepConstants(work=np.array([0.5, 0.5, 1.5, 1.5]) * ms, held=np.array([1.0, 0.0, 4.0, 6.0]))
    pred = ct.pipeline(_profile(c), [1, 3], 16, 0, "1f1b", 8, SimpleNamespace(), device)
    assert pred.step_time_s == pytest.approx((110.0 if on else 134.0) * ms)
    assert pred.breakdown["step_constants_head_s"] == pytest.approx((1.0 if on else 0.0) * ms)
    assert pred.memory_per_rank == ([1.0, 10.0] if on else [0.0, 0.0])
    plain = ct.pipeline(_profile(None), [1, 3], 16, 0, "1f1b", 8, SimpleNamespace(), device)
    assert plain.step_time_s == pytest.approx(134.0 * ms)  # a plan without the rule's prices: as before


def test_planner_prices_only_hoisting_tvm_stages(monkeypatch) -> None:
    """plan._step_constants: None with one micro-batch or with hoist rule 5 off (nothing hoisted);
    with rule 7 off (``LIFT_STEP_CONSTANTS``) the filters are held once, not with a packed copy."""
    from partitioner.training import hoist, plan

    step = _two_conv_step()
    graph = ir.Graph([], [], nodes=[], name="g")
    monkeypatch.setattr(ct, "step_constant_prices", lambda s, d, names, lift: lift)
    assert plan._step_constants(graph, step, 1, _tvm_device()) is None
    assert plan._step_constants(graph, step, 8, _tvm_device()) == hoist.LIFT_MIN_BYTES
    monkeypatch.setattr(hoist, "LIFT_STEP_CONSTANTS", False)
    assert plan._step_constants(graph, step, 8, _tvm_device()) == float("inf")
    monkeypatch.setattr(hoist, "HWIO_CONV_WEIGHTS", False)
    assert plan._step_constants(graph, step, 8, _tvm_device()) is None


def test_tvm_im2col_slices_are_priced_inside_their_concat(monkeypatch) -> None:
    """Rule 1 (``TVM_FUSED_IM2COL_SLICES``): the weight gradient's im2col of conv2 (9 Slices of the
    padded map into one Concat, through Unsqueezes when channels first) costs nothing beyond its Concat on a TVM
    rank; with the knob off, or on ONNX Runtime, each Slice is its own pass. Fails with the knob off
    (the TVM prices then equal the knob-off ones)."""
    step = _two_conv_step().graph
    # channels first: each Slice through an Unsqueeze; channels last (linear.IM2COL_NHWC, the
    # default): each Slice straight into the channel-axis Concat
    slices = [n for n in step if n.op_type == "Slice"
              and all(u.op_type in ("Unsqueeze", "Concat") for o in n.outputs for u, _ in o.uses())]
    assert len(slices) >= 9
    dev = _tvm_device()

    monkeypatch.setattr(ct, "TVM_IM2COL_AS_COPY", False)  # the Concat's own rule, tested below

    def priced(on: bool, device) -> dict:
        monkeypatch.setattr(ct, "TVM_FUSED_IM2COL_SLICES", on)
        return {id(n): t for n, _k, t in ct.priced_step_nodes(step, device)}

    on, off = priced(True, dev), priced(False, dev)
    assert all(on[id(n)] == 0.0 and off[id(n)] > 0.0 for n in slices)
    others = [n for n in step if n not in slices]
    assert all(on[id(n)] == off[id(n)] for n in others)
    ort = priced(True, dataclasses.replace(dev, runtime="onnxruntime"))
    assert all(ort[id(n)] > 0.0 for n in slices)
