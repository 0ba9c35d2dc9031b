"""A batch-1 padded direct convolution reads its input directly, the padding inlined as bounds
checks, with the first / last column tile (and, in a serial build, row) in loops of their own
(backends/tvm/schedules/contraction.py, ``_inline_border_pad`` / ``_split_border_tiles``, knob
``SPLIT_PAD_BORDER``). Every build matches ONNX Runtime (``tvm_build_check.build_and_compare``:
seeded random weights and input, rtol 1e-4, atol 1e-5), at batch 1 and 8, strides 1 and 2. With
the knob off TOPI's whole padded copy (``pad_temp``) comes back, so the structural checks fail."""

from __future__ import annotations

import pytest
import tvm
from tvm import s_tir

from backends.tvm.schedules import contraction as C
from backends.tvm.schedules import threads
from test_tvm_pad_per_image import conv3x3_relu
from tvm_build_check import build_and_compare


def _conv_func(mod: tvm.IRModule) -> tvm.tirx.PrimFunc:
    [f] = [f for f in mod.functions.values()
           if isinstance(f, tvm.tirx.PrimFunc) and "conv2d_nhwc_update" in f.script()]
    return f


def _checked_updates(f: tvm.tirx.PrimFunc) -> list[bool]:
    """Per copy of the conv's update statement after TVM's block lowering and simplification:
    whether its input read still carries a bounds check (``if_then_else``)."""
    seq = tvm.transform.Sequential([s_tir.transform.LowerInitBlock(), s_tir.transform.ConvertBlocksToOpaque(),
                                    s_tir.transform.CompactBufferAllocation(), s_tir.transform.LowerOpaqueBlock(),
                                    tvm.tirx.transform.StmtSimplify()])
    src = seq(tvm.IRModule({"main": f}))["main"].script()
    stores = [ln for ln in src.splitlines() if "conv2d_nhwc_intermediate_local[" in ln and " * param_0" in ln]
    return ["if_then_else" in ln for ln in stores]


SHAPES = [(16, 16, 40, 1), (16, 32, 80, 2)]  # ci, co, map, stride: 5 column tiles of 8 pixels


@pytest.mark.parametrize("ci,co,hw,stride", SHAPES, ids=["stride1", "stride2"])
def test_batch1_reads_the_input_directly(ci: int, co: int, hw: int, stride: int) -> None:
    with threads.building_for(1):
        f = _conv_func(build_and_compare(conv3x3_relu(1, ci, co, hw, stride)))
    assert 'sblock("pad_temp")' not in f.script(), "the whole padded input is still copied"
    checked = _checked_updates(f)
    # 3 row ranges x 3 column ranges (row-major): the top-left tile keeps its checks, the interior
    # (middle rows, middle column tiles) has none; at stride 2 the last row and column may need none
    assert len(checked) == 9 and checked[0] and not checked[4], checked


@pytest.mark.parametrize("ci,co,hw,stride", SHAPES, ids=["stride1", "stride2"])
def test_batch8_matches_ort(ci: int, co: int, hw: int, stride: int) -> None:
    build_and_compare(conv3x3_relu(8, ci, co, hw, stride))


def test_parallel_build_splits_columns_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(threads.ENV, raising=False)
    threads.set_parallel_min_flops(0.0)
    try:
        f = _conv_func(build_and_compare(conv3x3_relu(1, 16, 16, 40, 1)))
    finally:
        threads.set_parallel_min_flops(None)
    assert 'sblock("pad_temp")' not in f.script()
    assert "T.parallel" in f.script() and len(_checked_updates(f)) == 3


def test_knob_off_copies_the_padded_input(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(C, "SPLIT_PAD_BORDER", False)
    with threads.building_for(1):
        f = _conv_func(build_and_compare(conv3x3_relu(1, 16, 16, 40, 1)))
    assert 'sblock("pad_temp")' in f.script()


def test_narrow_maps_keep_the_copy() -> None:
    """16x16 output: 2 column tiles of 8 (AVX-512) or 4 of 4 (AVX2, contraction rule 1), under
    SPLIT_PAD_MIN_TILES, half of them border tiles. (32x32 on AVX2 has 8 tiles of 4 and is inlined.)"""
    assert 16 // 4 < C.SPLIT_PAD_MIN_TILES
    with threads.building_for(1):
        f = _conv_func(build_and_compare(conv3x3_relu(1, 16, 16, 16, 1)))
    assert 'sblock("pad_temp")' in f.script()
