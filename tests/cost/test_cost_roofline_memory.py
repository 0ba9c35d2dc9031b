"""Roofline op time and the memory formulas against hand arithmetic."""

from __future__ import annotations

import pytest

from partitioner.cluster import Device
from partitioner.cost.memory import activation_copies, device_memory, training_memory_bytes
from partitioner.cost.ops import OpCost
from partitioner.cost.roofline import is_compute_bound, op_time

DEV = Device("d", "cpu", {"float32": 1e9, "float16": 4e9}, 1e9, 1e9, 0.5, 1e-6)


def test_compute_bound_op():
    c = OpCost(flops=1e6, bytes_read=1e5, bytes_written=1e5, depth=1)
    # compute 1e6 / (1e9·0.5) = 2 ms; memory 2e5 / (1e9·0.5) = 0.4 ms; + 1 µs launch
    assert op_time(c, DEV) == pytest.approx(2e-3 + 1e-6)
    assert op_time(c, DEV, "float16") == pytest.approx(max(1e6 / 2e9, 4e-4) + 1e-6)
    assert op_time(c, DEV, "int4") == pytest.approx(2e-3 + 1e-6)  # unknown dtype -> float32
    assert is_compute_bound(c, DEV)


def test_memory_bound_and_free_ops():
    c = OpCost(flops=1e3, bytes_read=1e6, bytes_written=1e6, depth=1)
    assert op_time(c, DEV) == pytest.approx(2e6 / 5e8 + 1e-6)
    assert not is_compute_bound(c, DEV)
    assert op_time(OpCost(0, 0, 0, 0), DEV) == 0.0  # views launch nothing


def test_memory_formulas():
    m = device_memory(weight_bytes=100, activation_bytes=50, microbatches=2, comm_buffer_bytes=10)
    assert (m.weights, m.activations, m.comm_buffers, m.total) == (100, 100, 10, 210)
    assert m.fits(DEV)
    # fill-drain: a stage holds one micro-batch per stage at most, all of them when training
    assert activation_copies(8, num_stages=2) == 2
    assert activation_copies(8, num_stages=4) == 4
    assert activation_copies(3, num_stages=4) == 3
    assert activation_copies(8, num_stages=4, training=True) == 8
    assert activation_copies(8, num_stages=1) == 1
    # ZeRO: (2 + 2 + 12)·Ψ; stage 3 over 8 shards divides all three terms
    assert training_memory_bytes(1e9) == 16e9
    assert training_memory_bytes(1e9, shards=8, zero_stage=1) == 4e9 + 1.5e9
    assert training_memory_bytes(1e9, shards=8, zero_stage=3) == 2e9
