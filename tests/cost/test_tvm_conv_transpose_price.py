"""cost.training.TVM_CONV_TRANSPOSE_AS_CONV: a TVM rank's ConvTranspose of a weight (the conv's
input gradient, which the TVM step runs as a Conv: of the flipped weight at stride 1, hoist rule
4's phase form at stride 2) is priced at the forward conv's class and the multiply-adds of the
form it runs as; ONNX Runtime ranks keep ``conv_backward``."""

from __future__ import annotations

from types import SimpleNamespace

import onnx_ir as ir
import pytest

from partitioner.cost import training as ct
from partitioner.training import SGD, build_training_graph

from tests.training.test_pipeline_hoist import _conv_net


def _conv_transposes() -> list:
    step = build_training_graph(_conv_net(), optimizer=SGD(lr=0.1))
    model = step if isinstance(step, ir.Model) else ir.serde.deserialize_model(step)
    nodes = [n for n in model.graph if n.op_type == "ConvTranspose"]
    assert nodes, "the case must have an input gradient as ConvTranspose"
    return nodes


def _device(runtime: str) -> SimpleNamespace:
    return SimpleNamespace(runtime=runtime, efficiency_by_class={"conv": 0.8, "conv_backward": 0.2, "conv_train": 0.6})


@pytest.mark.parametrize("on", [True, False])
@pytest.mark.parametrize("stride", [1, 2])
def test_tvm_prices_conv_transpose_as_its_conv(monkeypatch, on, stride) -> None:
    monkeypatch.setattr(ct, "TVM_CONV_TRANSPOSE_AS_CONV", on)
    for n in _conv_transposes():
        if stride > 1:
            n.attributes["strides"] = ir.AttrInt64s("strides", [stride, stride])
        assert ct.node_class(_device("tvm"), n, backward=True) == ("conv_train" if on else "conv_backward")
        assert ct.node_class(_device("onnxruntime"), n, backward=True) == "conv_backward"


def test_phase_form_multiply_adds() -> None:
    """A 3x3 pads-1 stride-2 input gradient runs 2x2 taps over 4 phases: 16/9 of its multiply-adds
    (4 output phases x 4 taps, against 9 kernel taps); a 1x1 stride-2 one 4 (one phase has a tap)."""
    n = _conv_transposes()[0]
    assert ct.tvm_conv_flops_ratio(n) == 1.0
    n.attributes["strides"] = ir.AttrInt64s("strides", [2, 2])
    assert ct.tvm_conv_flops_ratio(n) == pytest.approx(16 / 9)
    n.inputs[1].shape = ir.Shape([*n.inputs[1].shape[:2], 1, 1])
    n.attributes["pads"] = ir.AttrInt64s("pads", [0, 0, 0, 0])
    assert ct.tvm_conv_flops_ratio(n) == pytest.approx(4.0)
