"""The roofline's GEMM working-set rule (partitioner/cost/roofline.py rule 5).

Each test fails without the rule (``GEMM_WORKING_SET`` off, or before it existed): a GEMM was then
priced at its class value whatever its size."""

from __future__ import annotations

import math

import pytest

from partitioner.cluster import Cluster, Device, cpu_cluster
from partitioner.cost import roofline
from partitioner.cost.ops import OpCost
from partitioner.cost.roofline import GEMM_LARGE_PROBE, GEMM_PROBE, gemm_probe_bytes, op_efficiency, op_time

PEAK, BW = 1e11, 2.5e10  # ridge point 4 FLOP/byte
TABLE = {"gemm": 1.1, "gemm_large": 0.88, "gemm_backward": 1.05}
DEV = Device("d", "cpu", {"float32": PEAK}, 1e9, BW, 1.0, 1e-6, dict(TABLE))


def matmul_cost(m: int, k: int, n: int) -> OpCost:
    """A float32 ``M x K @ K x N``: 2MKN FLOPs, A and B read, C written (the MatMul rule)."""
    return OpCost(2.0 * m * k * n, 4.0 * (m * k + k * n), 4.0 * m * n, 1.0)


def test_probe_working_sets_straddle_l2():
    # the in-cache probe's operands fit a 1 MiB L2, the large one's do not (rule 5's premise)
    assert gemm_probe_bytes(GEMM_PROBE) <= 2**20 < 4 * 2**20 <= gemm_probe_bytes(GEMM_LARGE_PROBE)


def test_compute_bound_gemm_interpolates_by_working_set():
    small, large = matmul_cost(*GEMM_PROBE), matmul_cost(*GEMM_LARGE_PROBE)
    assert op_efficiency(small, DEV, "float32", "gemm") == pytest.approx(1.1)
    assert op_efficiency(large, DEV, "float32", "gemm") == pytest.approx(0.88)
    # the zoo mlp's 1024^3 layer (12 MiB): beyond the large probe, clamped to it
    mlp = matmul_cost(1024, 1024, 1024)
    assert op_efficiency(mlp, DEV, "float32", "gemm") == pytest.approx(0.88)
    assert op_time(mlp, DEV, "float32", "gemm") == pytest.approx(mlp.flops / (PEAK * 0.88) + 1e-6)
    # a working set at the probes' geometric midpoint: the geometric mean of their efficiencies
    mid = math.sqrt(gemm_probe_bytes(GEMM_PROBE) * gemm_probe_bytes(GEMM_LARGE_PROBE))
    cost = OpCost(1e9, mid, 0.0, 1.0)
    assert op_efficiency(cost, DEV, "float32", "gemm") == pytest.approx(math.sqrt(1.1 * 0.88))
    # smaller than the in-cache probe: clamped to it
    assert op_efficiency(matmul_cost(64, 64, 64), DEV, "float32", "gemm") == pytest.approx(1.1)


def test_memory_bound_gemm_keeps_the_class_value():
    gemv = matmul_cost(1, 1024, 1024)  # 2 MFLOP over 4 MiB: far below the ridge
    assert op_efficiency(gemv, DEV, "float32", "gemm") == pytest.approx(1.1)
    assert op_time(gemv, DEV, "float32", "gemm") == pytest.approx(gemv.bytes / (BW * 1.1) + 1e-6)


def test_backward_gemm_interpolates_from_its_probe_to_the_large_one():
    mlp = matmul_cost(1024, 1024, 1024)
    assert op_efficiency(mlp, DEV, "float32", "gemm_backward") == pytest.approx(0.88)
    assert op_efficiency(matmul_cost(*GEMM_PROBE), DEV, "float32", "gemm_backward") == pytest.approx(1.05)
    mid = math.sqrt(gemm_probe_bytes(GEMM_PROBE) * gemm_probe_bytes(GEMM_LARGE_PROBE))
    cost = OpCost(1e9, mid, 0.0, 1.0)
    assert op_efficiency(cost, DEV, "float32", "gemm_backward") == pytest.approx(math.sqrt(1.05 * 0.88))
    assert op_efficiency(mlp, DEV, "float32", "conv") == 1.0  # other classes: untouched


def test_off_or_without_the_large_probe_the_class_value_is_used(monkeypatch):
    mlp = matmul_cost(1024, 1024, 1024)
    old = Device("d", "cpu", {"float32": PEAK}, 1e9, BW, 1.0, 1e-6, {"gemm": 1.33})
    assert op_efficiency(mlp, old, "float32", "gemm") == pytest.approx(1.33)
    monkeypatch.setattr(roofline, "GEMM_WORKING_SET", False)
    assert op_efficiency(mlp, DEV, "float32", "gemm") == pytest.approx(1.1)


def test_calibration_probes_and_cluster_files_carry_the_size_classes():
    from partitioner.calibrate import micro_kernels

    classes = {k.name: k.op_class for k in micro_kernels(quick=True)}
    assert classes["gemm_128x256x256"] == "gemm" and classes["gemv_1x256x512"] == "gemm"
    assert classes["gemm_256x1024x1024"] == "gemm_large"
    doc = cpu_cluster(1).to_json()
    doc["devices"][0]["efficiency_by_class"] = dict(TABLE)
    assert Cluster.from_json(doc).devices[0].class_efficiency("gemm_large") == 0.88
