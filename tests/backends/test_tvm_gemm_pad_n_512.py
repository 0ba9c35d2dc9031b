"""Matrix products whose N is not a multiple of 16 pad N to full 16-lane vectors on full-width 512-bit FMA targets.

``backends/tvm/schedules/gemm_packed.py`` (``PAD_N_FULL_WIDTH_512``, :func:`_pads_to_full_vectors`):
on an AVX-512 target whose 512-bit FMA runs at full width (not Zen 4) such a product takes
16-lane vectors with zero columns up to the next whole vector (or :func:`_padded_n`'s width)
instead of 8-lane vectors, which run at half the FMA peak there. Each case is compared with
numpy (float64) on seeded inputs (rtol 1e-4, atol 1e-5 * sqrt(K)); Zen 4 keeps its half-width
vectors, and 1x1 convolutions keep theirs on every target.
"""

from __future__ import annotations

import pytest
import tvm

from backends.tvm.schedules import gemm_packed
from backends.tvm.schedules.gemm_packed import _plan
from test_tvm_gemm_pack_a import _broadcast, _gemm_script, _matmul, _run_and_check
from tvm_build_check import ZNVER4, host_has

SKX = {"kind": "llvm", "mcpu": "skylake-avx512"}
needs_avx512 = pytest.mark.skipif(not host_has("avx512f"), reason="built for AVX-512; this CPU cannot run it")


@needs_avx512
@pytest.mark.parametrize("m,k,n", [(64, 128, 1000), (8, 64, 1000), (50, 64, 113), (64, 96, 40), (96, 80, 24), (3, 32, 10)],
                         ids=["n1000", "m8-n1000", "n113", "n40", "n24", "m3-n10"])
def test_matmul_matches_numpy_with_16_lanes(m, k, n):
    mod = _run_and_check(_matmul(m, k, n), SKX)
    script = _gemm_script(mod)
    assert "T.vectorized(T.int64(16))" in script and "T.vectorized(T.int64(8))" not in script, script


CASES = {"bias-relu-n40": lambda: _matmul(100, 64, 40, epilogue=True),
         "batched-activation-b-n24": lambda: _matmul(50, 32, 24, lead=(3,), const_b=False),
         "broadcast-const-b-n113": lambda: _broadcast([3, 50, 32], [32, 113], const_w=True)}


@needs_avx512
@pytest.mark.parametrize("case", list(CASES))
def test_epilogue_and_batched(case):
    _run_and_check(CASES[case](), SKX)


def test_plan_per_target(monkeypatch):
    skx, zen4 = tvm.target.Target(SKX), tvm.target.Target(ZNVER4)
    head = [512, 1000, 128]  # gpt's head at batch 8: M, N, K
    assert _plan(skx, head, 2)[0][0] == 16 and _plan(skx, head, 2)[1] == 1024
    assert _plan(skx, [512, 24, 768], 2)[1] == 32  # the next whole vector, not a 64-wide panel
    # Zen 4: 512-bit FMA as two 256-bit halves, 8-lane vectors as fast per cycle: unchanged
    assert _plan(zen4, head, 2) == ((8, 4, 40, 2.0 * 512 * 1000 * 128), None)
    # 1x1 convolutions (unit reductions) keep half-width vectors on every target
    conv = [64, 24, 1, 1, 32]
    assert _plan(skx, conv, 2)[0][0] == 8
    monkeypatch.setattr(gemm_packed, "PAD_N_FULL_WIDTH_512", False)
    assert _plan(skx, head, 2)[0][0] == 8
