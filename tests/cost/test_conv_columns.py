"""The roofline's conv output-pixels rule (partitioner/cost/roofline.py rule 6).

The tests that price a small-map conv fail without the rule (``CONV_COLUMNS`` off, or before it
existed: every conv was priced at its class value whatever its map size). Inference convs
(class ``conv``) have no small-map term."""

from __future__ import annotations

import math

import onnx_ir as ir
import pytest
from onnx import TensorProto, helper

from partitioner.cluster import Device
from partitioner.cost import roofline
from partitioner.cost.ops import OpCost, op_cost
from partitioner.cost.roofline import CONV_REF_COLUMNS, op_efficiency

TABLE = {"conv": 1.0, "conv_train": 1.0, "conv_train_px16": 0.8, "conv_train_px4": 0.5, "conv_backward": 0.9,
         "conv_backward_px16": 0.6, "conv_backward_px4": 0.25}
DEV = Device("d", "cpu", {"float32": 1e11}, 1e9, 2.5e10, 1.0, 0.0, dict(TABLE))


def conv_node(op: str, c: int, hw: int, batch: int = 2) -> ir.Node:
    w = [c, c, 3, 3]
    out = [batch, c, hw, hw]
    g = helper.make_graph([helper.make_node(op, ["x", "w"], ["y"], pads=[1, 1, 1, 1])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, c, hw, hw]),
                           helper.make_tensor_value_info("w", TensorProto.FLOAT, w)],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, out)])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    return next(iter(ir.serde.deserialize_model(model).graph))


def cost_with(columns: float) -> OpCost:
    return OpCost(1e9, 1e6, 1e6, 1.0, 0.0, columns)


def test_conv_rules_record_the_per_image_columns():
    assert op_cost(conv_node("Conv", 8, 2)).columns == 4  # a 2x2 output map
    assert op_cost(conv_node("ConvTranspose", 8, 4)).columns == 16  # its input's 4x4 map


def test_small_maps_run_at_their_probes():
    assert op_efficiency(cost_with(4), DEV, "float32", "conv_train") == pytest.approx(0.5)
    assert op_efficiency(cost_with(16), DEV, "float32", "conv_train") == pytest.approx(0.8)
    assert op_efficiency(cost_with(1), DEV, "float32", "conv_train") == pytest.approx(0.5)  # clamped
    assert op_efficiency(cost_with(4), DEV, "float32", "conv_backward") == pytest.approx(0.25)
    # between the 4x4 probe and the class's smallest map (7x7): log-linear in the columns
    mid = math.sqrt(16 * CONV_REF_COLUMNS)
    assert op_efficiency(cost_with(mid), DEV, "float32", "conv_backward") == pytest.approx(math.sqrt(0.6 * 0.9))
    # the real node: a ConvTranspose on 2x2 maps prices at the 2x2 probe
    node = op_cost(conv_node("ConvTranspose", 512, 2))
    assert roofline.op_time(node, DEV, "float32", "conv_backward") == pytest.approx(
        max(node.flops / (1e11 * 0.25), node.bytes / (2.5e10 * 0.25)))


def test_large_maps_inference_off_or_unprobed_keep_the_class_value(monkeypatch):
    assert op_efficiency(cost_with(49), DEV, "float32", "conv_train") == 1.0
    assert op_efficiency(cost_with(0), DEV, "float32", "conv_train") == 1.0  # no columns (a fallback cost)
    assert op_efficiency(cost_with(4), DEV, "float32", "conv") == 1.0  # inference convs: no small-map term
    bare = Device("d", "cpu", {"float32": 1e11}, 1e9, 2.5e10, 1.0, 0.0, {"conv_backward": 0.9})
    assert op_efficiency(cost_with(4), bare, "float32", "conv_backward") == 0.9
    monkeypatch.setattr(roofline, "CONV_COLUMNS", False)
    assert op_efficiency(cost_with(4), DEV, "float32", "conv_backward") == pytest.approx(0.9)
