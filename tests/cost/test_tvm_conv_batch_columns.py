"""cost.training.TVM_CONV_BATCH_COLUMNS: a TVM rank's step conv takes the roofline's small-map
term (rule 6) at its batch's pixels over the probes' batch, since TVM's small-map cost is a
per-call weight repacking; ONNX Runtime ranks keep the per-image columns.

The batch-16 2x2-map case fails without the rule (the knob off: it is priced at the batch-4
2x2 probe's efficiency, ``conv_train_px4``). Hand-built nodes and a hand-written efficiency
table: no timing."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from partitioner.cluster import Device
from partitioner.cost import training as ct
from partitioner.cost.roofline import op_time
from partitioner.cost.workdepth import constant_values, node_costs

from tests.cost.test_conv_columns import conv_node

TABLE = {"conv_train": 0.8, "conv_train_px16": 0.4, "conv_train_px4": 0.1}


def _device(runtime: str) -> Device:
    return replace(Device("d", "cpu", {"float32": 1e11}, 1e9, 2.5e10, 1.0, 0.0, dict(TABLE)), runtime=runtime)


def _priced(runtime: str, c: int, hw: int, batch: int) -> tuple[float, float]:
    """(the step's forward time of a one-Conv graph, that conv's FLOPs at efficiency 1 in s)."""
    node = conv_node("Conv", c, hw, batch)
    graph = node.graph
    fwd, _ = ct.step_times(graph, _device(runtime), [node.name], np.zeros(1), np.zeros(1))
    cost = node_costs(graph, constant_values(graph))[0]
    return float(fwd[0]), cost.flops / 1e11


@pytest.mark.parametrize("on", [True, False])
def test_tvm_batch16_2x2_conv_priced_at_the_batch_pixels(monkeypatch, on) -> None:
    """16 images of 2x2 = 64 pixels a call: 16 per probe image, the 4x4 probe's point (0.4);
    per image (4 columns) it is the 2x2 probe's (0.1)."""
    monkeypatch.setattr(ct, "TVM_CONV_BATCH_COLUMNS", on)
    t, ideal = _priced("tvm", 512, 2, 16)
    assert t == pytest.approx(ideal / (0.4 if on else 0.1), rel=1e-6)


def test_tvm_probe_batch_keeps_the_probe_point() -> None:
    """At the probes' own batch (4) the columns are the per-image ones: the 2x2 probe's value."""
    t, ideal = _priced("tvm", 512, 2, ct.CONV_PROBE_BATCH)
    assert t == pytest.approx(ideal / 0.1, rel=1e-6)


def test_tvm_large_batch_reaches_the_class_value() -> None:
    """64 images of 2x2 = 64 pixels per probe image, above the reference 49: the class value."""
    t, ideal = _priced("tvm", 64, 2, 64)
    assert t == pytest.approx(ideal / 0.8, rel=1e-6)


def test_onnxruntime_keeps_per_image_columns() -> None:
    """ONNX Runtime's small-map loss is per image: batch 16 of 2x2 maps stays at the 2x2 point."""
    t, ideal = _priced("onnxruntime", 512, 2, 16)
    assert t == pytest.approx(ideal / 0.1, rel=1e-6)


def test_op_time_of_the_rule_columns_matches() -> None:
    """The rule only rescales ``columns``: op_time with the rescaled cost is the step's price."""
    node = conv_node("Conv", 256, 4, 8)
    cost = node_costs(node.graph, constant_values(node.graph))[0]
    cols = ct.tvm_batch_columns(_device("tvm"), node, "conv_train", cost.columns)
    assert cols == 16 * 8 / ct.CONV_PROBE_BATCH
    assert ct.tvm_batch_columns(_device("tvm"), node, "conv", cost.columns) == cost.columns
    t, _ = _priced("tvm", 256, 4, 8)
    assert t == pytest.approx(op_time(replace(cost, columns=cols), _device("tvm"), "float32", "conv_train",
                                      False, working_set=True), rel=1e-9)
