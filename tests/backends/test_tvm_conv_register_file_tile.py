"""Direct convolutions whose default register tile overflows a 16-register file
(backends/tvm/schedules/contraction.py rule 1, ``REGISTER_FILE_TILE``), and batched RGB stems
run image by image on 16 registers (rule 2, ``STEM_IMAGES_OUTER``).

On AVX2 (16 ymm) the default tile of a 3x3 conv on a 7-, 14-, 28- or 56-wide map is 7 or 8 pixels
x 2 vectors: 14-16 accumulators + 2 weight vectors + 1 broadcast, so LLVM kept one accumulator on
the stack (a store and a reload per FMA step). Rule 1 takes the best tile that fits instead (on a
7x7 map at batch 4k, 4 images x 2 vectors: ``REGISTER_FILE_TILE_IMAGES``). The tests check the
choice per shape, that a ``znver4`` (AVX-512, 32 registers) build never takes the
rule, that the ``znver3`` kernel has no ymm spills, and that the ``znver3`` builds match ONNX
Runtime (rtol 1e-4, atol 1e-5) on the affected shapes at batch 1-2.
"""

from __future__ import annotations

import re

import numpy as np
import onnxruntime as ort
import pytest
import tvm
from tvm import relax

from backends.tvm.lower import lower_program
from backends.tvm.pipeline import run_pipeline
from backends.tvm.schedules import contraction as C
from models_zoo.conv_layers import single_conv_model
from tvm_build_check import ZNVER3, ZNVER4, host_has, spy_returns

RTOL, ATOL = 1e-4, 1e-5


def _build(m, spec: dict):
    target = tvm.target.Target(spec)
    mod = run_pipeline(lower_program(m).mod, "scheduled", target, conv_algorithm="direct")
    return tvm.compile(mod, target)


def _spy(monkeypatch) -> list:
    return spy_returns(monkeypatch, C, "_register_file_tile")


@pytest.mark.parametrize("batch,hw,co,tile", [(1, 14, 128, (2, 2, 2, 1)), (1, 7, 256, (7, 1, 1, None)),
                                              (1, 28, 64, (4, 1, 2, None)), (1, 56, 64, (4, 1, 2, None)),
                                              (8, 7, 256, (1, 4, 2, 0)), (2, 7, 256, (7, 1, 1, None)),
                                              (8, 14, 128, (2, 2, 2, 1))])
def test_tile_choice_on_16_registers(batch, hw, co, tile):
    exts = [batch, hw, hw, co, 3, 3, co]
    assert C._register_file_tile(exts, [0, 1, 2, 3], 2, 1, 8, 16, 0 if batch > 1 else None) == tile
    ni, hi, nj, _ = tile
    assert ni * hi * nj + nj + 1 <= 16


def test_avx512_build_keeps_its_tile(monkeypatch):
    """32 registers: the default 7 x 2 tile fits, rule 1 never runs."""
    calls = _spy(monkeypatch)
    _build(single_conv_model(32, 14, 32, 3, 1, 1, seed=3), ZNVER4)
    assert calls == []
    _build(single_conv_model(32, 14, 32, 3, 1, 1, seed=3), ZNVER3)
    assert calls == [(2, 2, 2, 1)]


def test_knob_off_keeps_the_default(monkeypatch):
    calls = _spy(monkeypatch)
    monkeypatch.setattr(C, "REGISTER_FILE_TILE", False)
    _build(single_conv_model(32, 14, 32, 3, 1, 1, seed=3), ZNVER3)
    assert calls == []


def _kernel_asm(ex) -> str:
    for lib in [ex.mod, *getattr(ex.mod, "imports", [])]:
        try:
            src = lib.inspect_source("s")
        except Exception:  # noqa: BLE001 - a module without assembly
            continue
        if "vfmadd" in src:
            return src
    raise AssertionError("no FMA code found")


def test_avx2_conv_has_no_ymm_spills():
    """With the knob off this kernel stored an accumulator to the stack 26 times."""
    asm = _kernel_asm(_build(single_conv_model(64, 14, 64, 3, 1, 1, seed=4), ZNVER3))
    spills = re.findall(r"vmovup[sd]\s+%ymm\d+, -?\d*\(%rsp\)", asm)
    assert len(spills) <= 2, spills


@pytest.mark.skipif(not host_has("avx2"), reason="built for AVX2; this CPU cannot run it")
@pytest.mark.parametrize("ci,hw,co,batch", [(32, 14, 64, 1), (64, 7, 32, 2), (16, 28, 32, 1), (24, 7, 48, 1),
                                                   (32, 7, 32, 4)],
                         ids=["14x14", "7x7-b2", "28x28", "7x7-6vec", "7x7-b4-images"])
def test_matches_onnxruntime(ci, hw, co, batch):
    m = single_conv_model(ci, hw, co, 3, 1, batch, seed=ci + hw + co)
    x = np.random.default_rng(0).standard_normal((batch, ci, hw, hw)).astype(np.float32)
    sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    ref = sess.run(None, {"x": x})[0]
    res = relax.VirtualMachine(_build(m, ZNVER3), tvm.cpu())["main"](tvm.runtime.tensor(x))
    got = (res if isinstance(res, tvm.runtime.Tensor) else res[0]).numpy()
    np.testing.assert_allclose(got, ref, rtol=RTOL, atol=ATOL)


def test_batched_stem_runs_images_outermost_on_16_registers():
    """contraction.py rule 2 (``STEM_IMAGES_OUTER``): AVX2 only; batch 1 and AVX-512 keep their order."""
    exts = [2, 56, 56, 64, 7, 7, 3]  # n, oh, ow, co, kh, kw, ci of ResNet's 7x7 stride-2 stem
    spatial = ["n", "h", "w"]
    assert C._parallel_order("v", spatial, exts, [4, 5, 6], 3, True) == ["n", "v", "h", "w"]
    assert C._parallel_order("v", spatial, exts, [4, 5, 6], 3, False) == ["v", "n", "h", "w"]
    assert C._parallel_order("v", spatial, [1, *exts[1:]], [4, 5, 6], 3, True) == ["v", "n", "h", "w"]


@pytest.mark.skipif(not host_has("avx2"), reason="built for AVX2; this CPU cannot run it")
def test_batched_stem_matches_onnxruntime():
    m = single_conv_model(3, 32, 16, 7, 2, 2, seed=5)
    x = np.random.default_rng(0).standard_normal((2, 3, 32, 32)).astype(np.float32)
    sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    ref = sess.run(None, {"x": x})[0]
    res = relax.VirtualMachine(_build(m, ZNVER3), tvm.cpu())["main"](tvm.runtime.tensor(x))
    got = (res if isinstance(res, tvm.runtime.Tensor) else res[0]).numpy()
    np.testing.assert_allclose(got, ref, rtol=RTOL, atol=ATOL)


def test_seven_high_map_takes_four_images(monkeypatch):
    """``REGISTER_FILE_TILE_IMAGES``: 7x7 at batch 4 spans 4 images x 2 vectors; off, 7 pixels x 1."""
    calls = _spy(monkeypatch)
    m = single_conv_model(32, 7, 32, 3, 1, 4, seed=6)
    _build(m, ZNVER3)
    monkeypatch.setattr(C, "REGISTER_FILE_TILE_IMAGES", False)
    _build(m, ZNVER3)
    assert calls == [(1, 4, 2, 0), (7, 1, 1, None)]
