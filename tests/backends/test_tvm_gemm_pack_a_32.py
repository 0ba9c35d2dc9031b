"""The 32-register, full-width 512-bit FMA GEMM tile: 12 rows x 2 vectors with A packed in 12-row panels.

``backends/tvm/schedules/gemm_packed.py`` (:func:`micro_tile` rule 7, ``PACK_A_32_REGISTERS``):
on an AVX-512 target whose 512-bit FMA runs at full width (not ``vector.HALF_WIDTH_AVX512_CPUS``), a
matrix product whose packed B does not fit ``ROWS_OUTER_B_BYTES`` takes the 12 x 32 tile (24
accumulators), its rows padded to a multiple of 12, A read from a per-call copy packed as
``Ap[.., i // 12, k, i % 12]``. The shapes are small (``ROWS_OUTER_B_BYTES`` and the packing
thresholds lowered so that the rule applies); each case is compared with numpy (float64) on
seeded inputs (rtol 1e-4, atol 1e-5 * sqrt(K)). The Zen 4 and Zen 3 tiles must not change.
"""

from __future__ import annotations

import re

import pytest
import tvm

from backends.tvm.schedules import gemm_packed
from backends.tvm.schedules.gemm_packed import _pack_a_plan, _register_tile
from test_tvm_gemm_pack_a import _broadcast, _gemm_script, _matmul, _run_and_check, _scheduled
from tvm_build_check import ZNVER3, ZNVER4, ZNVER5, host_has, host_runs_znver5

# an AVX-512 target any AVX-512 host runs (Intel server cores have two 512-bit FMA units)
SKX = {"kind": "llvm", "mcpu": "skylake-avx512"}
needs_avx512 = pytest.mark.skipif(not host_has("avx512f"), reason="built for AVX-512; this CPU cannot run it")


@pytest.fixture(params=["packed", "in-place"])
def panels_outer(request, monkeypatch):
    """Every B counts as too large for rows-outer (rule 7 applies); A packed at every K, or (when
    12 divides M) read in place (K, N under the packing thresholds)."""
    monkeypatch.setattr(gemm_packed, "ROWS_OUTER_B_BYTES", 1024)
    monkeypatch.setattr(gemm_packed, "PACK_A_MIN_K", 16 if request.param == "packed" else 1 << 30)
    monkeypatch.setattr(gemm_packed, "PACK_A_MIN_N", 1 << 30)
    return request.param


@needs_avx512
@pytest.mark.parametrize("m,k,n", [(12, 64, 32), (13, 48, 32), (100, 64, 64), (130, 37, 96), (64, 96, 40), (24, 80, 160)],
                         ids=["m12", "m13", "m100", "m130-k37", "n40", "m24-n160"])
def test_matmul_matches_numpy(m, k, n, panels_outer):
    mod = _run_and_check(_matmul(m, k, n), SKX)
    script = _gemm_script(mod)
    takes_tile = n % 32 == 0 and m >= 12 and (panels_outer == "packed" or m % 12 == 0)
    assert ("T.unroll(T.int64(12))" in script) == takes_tile, script
    assert _packs_a(script) == (takes_tile and panels_outer == "packed"), "A packed (or not) against the rule"


CASES = {"bias-relu-m100": lambda: _matmul(100, 64, 64, epilogue=True),
         "batched-activation-b": lambda: _matmul(50, 32, 64, lead=(3,), const_b=False),
         "broadcast-a": lambda: _broadcast([50, 32], [3, 32, 64], const_w=False),
         "broadcast-const-b": lambda: _broadcast([3, 50, 32], [32, 64], const_w=True),
         "4d": lambda: _broadcast([2, 2, 50, 32], [2, 2, 32, 64], const_w=False)}


@needs_avx512
@pytest.mark.parametrize("case", list(CASES))
def test_epilogue_and_batched(case, panels_outer):
    _run_and_check(CASES[case](), SKX)


@needs_avx512
def test_m_blocked_order_matches_numpy(monkeypatch):
    # M blocks of packed A (the MC of rule 6, sized with 12-row tiles), each streamed past every B panel
    monkeypatch.setattr(gemm_packed, "ROWS_OUTER_B_BYTES", 1024)
    monkeypatch.setattr(gemm_packed, "PACK_A_MIN_K", 16)
    monkeypatch.setattr(gemm_packed, "PACK_A_BLOCK_BYTES", 12 * 4 * 64 * 4)
    assert gemm_packed._a_block_tiles(12, 64, 12) == 6  # M = 140: 12 tiles of 12 rows, 2 blocks
    mod = _run_and_check(_matmul(140, 64, 64), SKX)
    assert _packs_a(_gemm_script(mod))


def test_tile_per_target():
    skx, zen4, zen3 = (tvm.target.Target(t) for t in (SKX, ZNVER4, ZNVER3))
    big, l2 = [1024, 1024, 1024], [512, 512, 512]  # B 4 MiB: panels outer; B 1 MiB: rows outer
    assert _pack_a_plan(skx, _register_tile(skx, big, 2), big, 2, None)[1:3] == (12, 32)
    assert _pack_a_plan(skx, _register_tile(skx, l2, 2), l2, 2, None) is None
    # Zen 4 (512-bit FMA as two 256-bit halves) keeps its 4 x 4-vector tile with A in place
    assert _register_tile(zen4, big, 2)[:3] == (16, 4, 64)
    assert _pack_a_plan(zen4, _register_tile(zen4, big, 2), big, 2, None) is None
    # Zen 3 (AVX2) keeps rule 6
    assert _pack_a_plan(zen3, _register_tile(zen3, big, 2), big, 2, None)[1:3] == (6, 16)
    # 1x1 convolutions (several reductions) keep micro_tile's tile
    conv = [64, 64, 1, 1, 2048]
    assert _pack_a_plan(skx, _register_tile(skx, conv, 2), conv, 2, None) is None


can_run_znver5 = pytest.mark.skipif(not host_runs_znver5(), reason="built for znver5; this CPU cannot run it")


def test_zen5_keeps_the_4x4_tile_with_panels_outer():
    """Zen 5 (two full 512-bit FMA pipes): rule 7 off (``PACK_A_32_BY_CPU``), products whose B
    exceeds 512 KiB panels outer (``ROWS_OUTER_B_BYTES_BY_CPU``), so 512^3 no longer runs rows outer."""
    zen5 = tvm.target.Target(ZNVER5)
    for shape in ([1024, 1024, 1024], [512, 512, 512]):
        assert _register_tile(zen5, shape, 2)[:3] == (16, 4, 64)
        assert _pack_a_plan(zen5, _register_tile(zen5, shape, 2), shape, 2, None) is None
    mib = 1 << 20  # 512^3's B: panels outer on Zen 5 (half its L2 is the bound), rows outer elsewhere
    assert not gemm_packed._rows_outer(mib, zen5) and gemm_packed._rows_outer(mib, tvm.target.Target(SKX))
    assert gemm_packed._rows_outer(mib // 2, zen5)
    assert gemm_packed._rows_outer(mib)  # no target: the general bound


@pytest.mark.parametrize("how", ["tables emptied", "PARTITIONER_SCHEDULE_BY_CPU=0"])
def test_zen5_settings_off_give_the_intel_rules(monkeypatch, how):
    from backends.tvm.schedules import vector

    if how == "tables emptied":
        monkeypatch.setattr(gemm_packed, "PACK_A_32_BY_CPU", {})
        monkeypatch.setattr(gemm_packed, "ROWS_OUTER_B_BYTES_BY_CPU", {})
    else:
        monkeypatch.setattr(vector, "SCHEDULE_BY_CPU", False)
    zen5, big = tvm.target.Target(ZNVER5), [1024, 1024, 1024]
    assert _pack_a_plan(zen5, _register_tile(zen5, big, 2), big, 2, None)[1:3] == (12, 32)
    assert gemm_packed._rows_outer(4 * 512 * 512, zen5)


def test_rule7_switch_turns_it_off_on_every_cpu(monkeypatch):
    monkeypatch.setattr(gemm_packed, "PACK_A_32_BY_CPU", {})
    monkeypatch.setattr(gemm_packed, "PACK_A_32_REGISTERS", False)
    for spec in (ZNVER5, SKX):
        t, big = tvm.target.Target(spec), [1024, 1024, 1024]
        assert _pack_a_plan(t, _register_tile(t, big, 2), big, 2, None) is None


@can_run_znver5
@pytest.mark.parametrize("m,k,n", [(100, 64, 64), (130, 37, 96), (64, 96, 40)],
                         ids=["m100", "m130-k37", "n40"])
def test_zen5_matmul_matches_numpy(m, k, n):
    script = _gemm_script(_run_and_check(_matmul(m, k, n), ZNVER5))
    assert "T.int64(12))" not in script


def test_zen4_schedule_unchanged(monkeypatch):
    monkeypatch.setattr(gemm_packed, "ROWS_OUTER_B_BYTES", 1024)
    _, mod = _scheduled(_matmul(96, 1024, 128), ZNVER4)
    script = _gemm_script(mod)
    assert "T.int64(12))" not in script and "T.unroll(T.int64(4))" in script


def test_knob_off_keeps_the_old_tile(monkeypatch):
    skx = tvm.target.Target(SKX)
    big = [1024, 1024, 1024]
    monkeypatch.setattr(gemm_packed, "PACK_A_32_REGISTERS", False)
    assert _pack_a_plan(skx, _register_tile(skx, big, 2), big, 2, None) is None
    monkeypatch.setattr(gemm_packed, "ROWS_OUTER_B_BYTES", 1024)
    _, mod = _scheduled(_matmul(96, 1024, 64), SKX)
    assert not _packs_a(_gemm_script(mod))


@needs_avx512
def test_spills_none_in_the_k_loop():
    """The 12 x 2-vector k loop holds 24 accumulators + 2 B vectors + broadcasts in registers."""
    target, mod = _scheduled(_matmul(48, 2048, 1024), SKX)  # B 8 MiB: panels outer
    ex = tvm.compile(mod, target)
    asm = next(src for lib in [ex.mod, *getattr(ex.mod, "imports", [])]
               for src in [_asm(lib)] if "vfmadd231ps" in src)
    loops = [body.split("\n\tj", 1)[0] for body in re.split(r"\n\.LBB\S+:\n", asm)]  # label to first jump
    loops = [body for body in loops if body.count("vfmadd231ps\t%zmm") >= 24]
    assert loops, "no 24-FMA k loop"
    assert not re.search(r"\(%rsp\)", loops[0]), loops[0]


def _packs_a(script: str) -> bool:
    """Whether the kernel allocates a 12-row packed A (``Ap[.., i // 12, k, i % 12]``)."""
    return re.search(r"sblock_alloc_buffer\(\((?:T\.int64\(\d+\), )+T\.int64\(12\)\)\)", script) is not None


def _asm(lib) -> str:
    try:
        return lib.inspect_source("s")
    except Exception:  # noqa: BLE001 - a module without assembly
        return ""
