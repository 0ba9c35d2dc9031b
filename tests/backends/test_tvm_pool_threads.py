"""Pooling stays on one thread where the pool's split does not pay (backends/tvm/schedules/
depthwise.py, ``POOL_PARALLEL_MIN_ELEMENTS`` / ``_rows_parallel``).

ResNet-18's max pool at batch 1 (3x3 stride 2, 112x112x64 -> 56x56x64, 3.6 MFLOP: above the
default 2 MFLOP threshold) is built without a parallel loop; with the knob at 0 it gets one, so
the test fails then. The same pool at batch 2 on a 128x128 map (524288 output elements) stays
parallel. Both builds match ONNX Runtime (``build_and_compare``: seeded input, rtol 1e-4,
atol 1e-5).
"""

from __future__ import annotations

import pytest
import tvm

from backends.tvm.schedules import depthwise as D
from backends.tvm.schedules import threads
from test_tvm_pooling_rule import _pool_model
from tvm_build_check import build_and_compare


def _pool_tir(batch: int, hw: int) -> str:
    mod = build_and_compare(_pool_model("MaxPool", 64, hw, 3, 2, 1, batch))
    return next(f.script() for gv, f in mod.functions_items()
                if isinstance(f, tvm.tirx.PrimFunc) and "pool" in gv.name_hint)


@pytest.fixture(autouse=True)
def default_threshold(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(threads.ENV, raising=False)
    threads.set_parallel_min_flops(None)


def test_resnet_pool_at_batch_1_is_serial() -> None:
    assert 2 * 56 * 56 * 64 * 9 >= threads.parallel_min_flops()  # the FLOP rule alone would fork
    assert "T.parallel" not in _pool_tir(1, 112)


def test_knob_off_makes_it_parallel(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(D, "POOL_PARALLEL_MIN_ELEMENTS", 0)
    assert "T.parallel" in _pool_tir(1, 112)


def test_large_pool_stays_parallel() -> None:
    assert "T.parallel" in _pool_tir(2, 128)
