"""cost.training.TVM_CONV_TRANSPOSE_AS_CONV: a TVM rank's stride-1 ConvTranspose of a weight (the
conv's input gradient, which the TVM step runs as a Conv of the flipped weight) is priced at the
forward conv's class; ONNX Runtime ranks and strided ConvTransposes keep ``conv_backward``."""

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
def test_tvm_prices_stride_one_conv_transpose_as_its_conv(monkeypatch, on) -> None:
    monkeypatch.setattr(ct, "TVM_CONV_TRANSPOSE_AS_CONV", on)
    for n in _conv_transposes():
        assert ct.node_class(_device("tvm"), n, backward=True) == ("conv_train" if on else "conv_backward")
        assert ct.node_class(_device("onnxruntime"), n, backward=True) == "conv_backward"


def test_strided_conv_transpose_keeps_its_backward_class() -> None:
    n = _conv_transposes()[0]
    n.attributes["strides"] = ir.AttrInt64s("strides", [2, 2])
    assert ct.node_class(_device("tvm"), n, backward=True) == "conv_backward"
