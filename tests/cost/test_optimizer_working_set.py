"""cost.training rule 2, OPTIMIZER_WORKING_SET: the optimizer formula's pass over the weights runs
at the roofline's working-set efficiency of an elementwise op of its bytes (rule 7), not at the
full DRAM bandwidth. The large-weights case fails with the knob off (checked: the pass is then
priced at efficiency 1). Hand-written efficiency table, no timing."""

from __future__ import annotations

import pytest

from partitioner.cluster import Device
from partitioner.cost import training as ct
from partitioner.cost.roofline import MEMORY_PROBE_BYTES

BW = 2.5e10
DEV = Device("d", "cpu", {"float32": 1e11}, 1e9, BW, 1.0, 0.0, {"elementwise": 2.0, "elementwise_large": 0.3})


@pytest.mark.parametrize("on", [True, False])
def test_large_weights_stream_at_the_large_probe_rate(monkeypatch, on) -> None:
    """45 MiB of SGD weights: read W and g, write W (135 MiB moved, beyond the large probe's
    48 MiB): the ``elementwise_large`` value."""
    monkeypatch.setattr(ct, "OPTIMIZER_WORKING_SET", on)
    w = 45 * 2**20
    assert ct._optimizer_time(w, 0, DEV) == pytest.approx(3 * w / (BW * (0.3 if on else 1.0)), rel=1e-9)


def test_adam_moves_the_state_copies_too() -> None:
    w = 45 * 2**20
    assert ct._optimizer_time(w, 2, DEV) == pytest.approx(7 * w / (BW * 0.3), rel=1e-9)


def test_in_cache_weights_keep_the_class_value() -> None:
    """A pass no larger than the elementwise probe's bytes stays at the class value."""
    w = MEMORY_PROBE_BYTES["elementwise"] / 3
    assert ct._optimizer_time(w, 0, DEV) == pytest.approx(3 * w / (BW * 2.0), rel=1e-9)


def test_uncalibrated_device_keeps_full_bandwidth() -> None:
    dev = Device("d", "cpu", {"float32": 1e11}, 1e9, BW)
    assert ct._optimizer_time(1e8, 0, dev) == pytest.approx(3e8 / BW, rel=1e-9)
