"""cost.training rule 1 on TVM ranks: the Conv-form weight gradient at the forward conv's class
(``TVM_CONV_WGRAD_AS_CONV``) and the channels-last im2col Concat as one copy at the copy
bandwidth (``TVM_IM2COL_AS_COPY``); ONNX Runtime ranks and the knobs off keep the old prices."""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx
import onnx_ir as ir
import pytest

from partitioner.cluster import cpu_cluster
from partitioner.cost import training as ct
from partitioner.cost.ops import nbytes
from partitioner.training import SGD, build_training_graph
from tests.training.test_training_cost import _two_convs

CLASSES = {"conv": 0.9, "conv_train": 0.8, "conv_backward": 0.2, "gemm": 1.0, "data_movement": 1.0,
           "data_movement_large": 0.25}


def _device(runtime: str = "tvm"):
    return dataclasses.replace(cpu_cluster(1).devices[0], runtime=runtime, efficiency_by_class=dict(CLASSES))


def _graph(model: onnx.ModelProto) -> ir.Graph:
    step = build_training_graph(model, loss="mse", optimizer=SGD(lr=0.1))
    return (step if isinstance(step, ir.Model) else ir.serde.deserialize_model(step)).graph


def _stem() -> onnx.ModelProto:
    """x [2, 3, 16, 16] -> Conv 7x7 (8 channels, pad 3): 49 offsets, over ``GEMM_MAX_OFFSETS``, so
    its weight gradient keeps the Conv form (a Conv whose kernel is the output gradient)."""
    from onnx import TensorProto, helper, numpy_helper

    w = numpy_helper.from_array((np.random.default_rng(0).standard_normal((8, 3, 7, 7)) * 0.1).astype(np.float32), "w")
    node = helper.make_node("Conv", ["x", "w"], ["y"], name="stem", pads=[3, 3, 3, 3])
    g = helper.make_graph([node], "stem", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 16, 16])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 8, 16, 16])], [w])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])


def test_conv_form_weight_gradient_runs_at_the_forward_conv_class_on_tvm(monkeypatch) -> None:
    """The stem's weight gradient (a backward Conv over a computed kernel) is ``conv_train`` on a
    TVM rank, ``conv_backward`` on ONNX Runtime and with the knob off. Fails without the rule."""
    step = _graph(_stem())
    wgrad = [n for n in step if n.op_type == "Conv" and n.metadata_props.get(ct.FORWARD_NODE_KEY) == "stem"]
    assert len(wgrad) == 1
    node = wgrad[0]
    assert ct.node_class(_device(), node, True) == "conv_train"
    assert ct.node_class(_device("onnxruntime"), node, True) == "conv_backward"
    monkeypatch.setattr(ct, "TVM_CONV_WGRAD_AS_CONV", False)
    assert ct.node_class(_device(), node, True) == "conv_backward"


def test_channels_last_im2col_concat_is_one_copy_on_tvm(monkeypatch) -> None:
    """conv2's weight gradient in the channels-last form (``rules.linear`` "NHWC im2col"): its
    Concat on the channel axis costs its output bytes plus its padded source's bytes at the
    device's memory bandwidth (plus a launch) on a TVM rank; on ONNX Runtime, and with the knob
    off, it is the data-movement roofline price (here larger). Fails without the rule."""
    step = _graph(_two_convs(4, 32, 16))
    concats = [n for n in step if n.op_type == "Concat" and n.attributes["axis"].as_int() in (-1, 3)
               and n.metadata_props.get(ct.FORWARD_NODE_KEY) == "conv2"]
    assert len(concats) == 1
    cat = concats[0]
    source = cat.inputs[0].producer().inputs[0]  # the padded [N, H+2, W+2, C] map the slices read
    assert list(source.shape) == [4, 18, 18, 32]
    dev = _device()
    expected = (nbytes(cat.outputs[0]) + nbytes(source)) / dev.memory_bandwidth + dev.launch_overhead_s
    assert ct.tvm_im2col_copy_bytes(dev, cat) == nbytes(cat.outputs[0]) + nbytes(source)

    def price(device) -> float:
        return {id(n): t for n, _k, t in ct.priced_step_nodes(step, device)}[id(cat)]

    assert price(dev) == pytest.approx(expected, rel=1e-9)
    ort = price(_device("onnxruntime"))
    monkeypatch.setattr(ct, "TVM_IM2COL_AS_COPY", False)
    assert price(dev) == pytest.approx(ort, rel=1e-9) and ort > expected
