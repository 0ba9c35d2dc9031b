"""The roofline's working-set rule for elementwise and data-movement ops (partitioner/cost/
roofline.py rule 7), applied to a training step's nodes only.

The tests that price a large map fail without the rule (``MEMORY_WORKING_SET`` off: every such
op at its class value, as before the out-of-cache probes)."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from partitioner.cluster import Device
from partitioner.cost.ops import OpCost
from partitioner.cost.roofline import MEMORY_LARGE_BYTES, MEMORY_PROBE_BYTES, op_time

TABLE = {"elementwise": 3.0, "elementwise_large": 0.75, "data_movement": 2.0, "data_movement_large": 0.5}
BW = 2.5e10
DEV = Device("d", "cpu", {"float32": 1e11}, 1e9, BW, 1.0, 0.0, dict(TABLE))


def mem_op(nbytes: float) -> OpCost:
    """A memory-bound op of ``nbytes`` operand bytes (one FLOP per 12 bytes)."""
    return OpCost(nbytes / 12, nbytes * 2 / 3, nbytes / 3, 1.0)


def test_large_maps_run_between_the_in_cache_and_the_out_of_cache_probe() -> None:
    """At or below the class probe's bytes: the class value; at the large probe's bytes and
    beyond: ``<class>_large``; half way in log bytes: their geometric mean. Only with
    ``working_set`` (a training step's node)."""
    for cls in ("elementwise", "data_movement"):
        lo, hi = MEMORY_PROBE_BYTES[cls], MEMORY_LARGE_BYTES[cls]
        small, big, mid = TABLE[cls], TABLE[f"{cls}_large"], math.sqrt(TABLE[cls] * TABLE[f"{cls}_large"])
        for nbytes, eff in ((lo / 4, small), (lo, small), (math.sqrt(lo * hi), mid), (hi, big), (4 * hi, big)):
            assert op_time(mem_op(nbytes), DEV, "float32", cls, working_set=True) == \
                pytest.approx(nbytes / (BW * eff), rel=1e-9), (cls, nbytes)
        # inference (no working_set): the class value at every size
        assert op_time(mem_op(hi), DEV, "float32", cls) == pytest.approx(hi / (BW * small), rel=1e-9)


def test_fused_compute_bound_and_uncalibrated_ops_keep_their_price() -> None:
    """A fused elementwise op pays its compute roof only; a compute-bound op, another class and
    a device without the large probes keep the class value."""
    hi = MEMORY_LARGE_BYTES["elementwise"]
    op = mem_op(hi)
    assert op_time(op, DEV, "float32", "elementwise", fused=True, working_set=True) == \
        pytest.approx(op.flops / (1e11 * 3.0), rel=1e-9)  # the class value, no working-set term
    heavy = OpCost(1e12, hi * 2 / 3, hi / 3, 1.0)
    assert op_time(heavy, DEV, "float32", "elementwise", working_set=True) == pytest.approx(1e12 / (1e11 * 3.0))
    norm = dataclasses.replace(DEV, efficiency_by_class={**TABLE, "norm": 0.5})
    assert op_time(op, norm, "float32", "norm", working_set=True) == pytest.approx(hi / (BW * 0.5), rel=1e-9)
    bare = dataclasses.replace(DEV, efficiency_by_class={"elementwise": 3.0})
    assert op_time(op, bare, "float32", "elementwise", working_set=True) == pytest.approx(hi / (BW * 3.0), rel=1e-9)


def _add_of_maps(batch: int, c: int = 64, hw: int = 64):
    """x -> Add(x, x) -> Conv(w, 1x1, 8 channels out) -> y: the step's Add runs on
    [batch, c, hw, hw] maps, its loss on an eighth of that (under the in-cache probe's bytes)."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    w = numpy_helper.from_array((rng.standard_normal((8, c, 1, 1)) * 0.1).astype(np.float32), "w")
    nodes = [helper.make_node("Add", ["x", "x"], ["h"], name="double"),
             helper.make_node("Conv", ["h", "w"], ["y"], name="conv")]
    g = helper.make_graph(nodes, "res", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, c, hw, hw])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, 8, hw, hw])], [w])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])


def test_training_step_prices_its_large_maps_out_of_cache() -> None:
    """Cost rule 1 with roofline rule 7: the forward Add on 4 MiB maps (12 MiB of operands:
    between the probes) costs more when ``elementwise_large`` is lower, by exactly its
    interpolated memory time; the same model's inference node (plain ``graph_op_times``) does not
    change."""
    from partitioner.cluster import cpu_cluster, replicate
    from partitioner.cost.roofline import graph_op_times
    from partitioner.training.plan import predict_training
    from partitioner.training.step import _load

    base = cpu_cluster(1)
    table = {"elementwise": 3.0, "conv": 1.0, "gemm": 1.0, "data_movement": 2.0}
    fast = dataclasses.replace(base.devices[0], efficiency_by_class={**table, "elementwise_large": 3.0})
    slow = dataclasses.replace(base.devices[0], efficiency_by_class={**table, "elementwise_large": 0.75})
    a, b = (predict_training(_add_of_maps(4), "single", 1, batch=4, loss="mse",
                             cluster=replicate(dataclasses.replace(base, devices=[d]), 1)) for d in (fast, slow))
    nbytes = 3 * 4.0 * 4 * 64 * 64 * 64
    lo, hi = MEMORY_PROBE_BYTES["elementwise"], MEMORY_LARGE_BYTES["elementwise"]
    t = math.log(nbytes / lo) / math.log(hi / lo)
    eff = math.exp((1 - t) * math.log(3.0) + t * math.log(0.75))
    bw = base.devices[0].memory_bandwidth
    assert b.breakdown["forward_s"] - a.breakdown["forward_s"] == pytest.approx(nbytes / bw * (1 / eff - 1 / 3.0),
                                                                                rel=1e-6)
    graph = _load(_add_of_maps(4), 4).graph
    assert graph_op_times(graph, fast) == graph_op_times(graph, slow)


def test_large_probes_have_the_bytes_rule_7_interpolates_to() -> None:
    """Calibration has one out-of-cache probe per class, on maps of 16 MiB (beyond a core's L2),
    and the roofline prices each at exactly ``MEMORY_LARGE_BYTES`` of operands (one formula for
    calibrating and predicting). Fails with ``LARGE_MAP_PROBES`` off (no such probes)."""
    from partitioner.calibrate import kernel_model, kernel_roof, micro_kernels

    probes = {k.op_class: k for k in micro_kernels(quick=True) if k.op_class in ("elementwise_large",
                                                                               "data_movement_large")}
    assert set(probes) == {"elementwise_large", "data_movement_large"}
    dev = Device("probe", "cpu", {"float32": 1e15}, 1e9, 1e9)  # compute free: memory bound
    for cls, k in probes.items():
        assert all(4 * math.prod(shape) >= 16 * 2**20 for _, shape in k.inputs)
        roof, launches = kernel_roof(kernel_model(k), dev)
        assert roof == pytest.approx(MEMORY_LARGE_BYTES[cls[:-len("_large")]] / 1e9, rel=1e-9)
        assert launches == 1
