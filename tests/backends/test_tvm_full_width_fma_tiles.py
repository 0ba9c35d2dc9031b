"""Register tiles for targets with full-width 512-bit FMA units (Intel AVX-512 server cores, Zen 5):
backends/tvm/schedules/contraction.py rules 3 (``FULL_WIDTH_NARROW_TILE``: batch-1 convs on maps
narrower than 6 pixels take up to 16 pixels per weight vector; on Zen 5 at least 2 channel vectors,
``NARROW_MIN_VECTORS``) and 4 (``FULL_WIDTH_FEW_VECTORS``: convs whose default tile has fewer than
16 full-width accumulators, e.g. 48 output channels, take
more channel vectors), keyed on ``vector.full_width_fma``.

Checked: the datapath table (``znver4`` is half width, Intel AVX-512 CPUs full width, AVX2 neither);
the tile each rule picks per shape; that ``znver4`` / ``znver3`` builds never reach the rules
(their choices stay as the session-17 tests pin them); and, where this host can run a
``sapphirerapids`` build, that the builds the rules change match ONNX Runtime (rtol 1e-4,
atol 1e-5; seeded random He-scaled weights, seeded input) on odd map sizes, strides, padding and
residual epilogues.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import tvm
from onnx import TensorProto, helper, numpy_helper

from backends.tvm.lower import lower_program
from backends.tvm.pipeline import run_pipeline
from backends.tvm.schedules import contraction as C
from backends.tvm.schedules import vector as V
from tvm_build_check import ZNVER3, ZNVER4, ZNVER5, build_and_compare, host_has, host_runs_znver5, spy_returns

SAPPHIRERAPIDS = {"kind": "llvm", "mcpu": "sapphirerapids"}
SKYLAKE_AVX512 = {"kind": "llvm", "mcpu": "skylake-avx512"}
CAN_RUN_SPR = host_has("avx512f") and host_has("amx_tile") and host_has("avx512_fp16")


def _model(ci: int, co: int, hw: int, k: int, stride: int, batch: int, residual: bool = False) -> onnx.ModelProto:
    """Conv k x k (same padding, ``stride``) + bias [+ the conv's own output added again through a
    1x1 conv when ``residual``: a two-input add epilogue] -> Relu; seeded He-scaled weights."""
    rng = np.random.default_rng(ci * 131 + co * 7 + hw * 3 + k + stride + batch)
    w = (rng.standard_normal((co, ci, k, k)) * np.sqrt(2.0 / (ci * k * k))).astype(np.float32)
    b = (rng.standard_normal(co) * 0.1).astype(np.float32)
    p = (k - 1) // 2
    inits = [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")]
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], kernel_shape=[k, k], strides=[stride, stride],
                              pads=[p] * 4)]
    last = "c"
    if residual:  # a skip branch: 1x1 conv of the input to the same shape, added to the conv
        w2 = (rng.standard_normal((co, ci, 1, 1)) * np.sqrt(2.0 / ci)).astype(np.float32)
        inits.append(numpy_helper.from_array(w2, "w2"))
        nodes += [helper.make_node("Conv", ["x", "w2"], ["s"], kernel_shape=[1, 1], strides=[stride, stride]),
                  helper.make_node("Add", ["c", "s"], ["a"])]
        last = "a"
    nodes.append(helper.make_node("Relu", [last], ["y"]))
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, ci, hw, hw])
    g = helper.make_graph(nodes, "conv", [x], [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    return onnx.shape_inference.infer_shapes(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]))


def _spy(monkeypatch: pytest.MonkeyPatch) -> list:
    return spy_returns(monkeypatch, C, "_full_width_tile")


def _schedule(m: onnx.ModelProto, spec: dict) -> tvm.IRModule:
    return run_pipeline(lower_program(m).mod, "scheduled", tvm.target.Target(spec), conv_algorithm="direct")


def test_datapath_table() -> None:
    assert not V.full_width_fma(tvm.target.Target(ZNVER4))  # 512-bit ops on 256-bit pipes
    assert not V.full_width_fma(tvm.target.Target(ZNVER3))  # AVX2
    assert V.fma_datapath_bits(tvm.target.Target(ZNVER4)) == 256
    for spec in (SAPPHIRERAPIDS, SKYLAKE_AVX512, {"kind": "llvm", "mcpu": "icelake-server"}):
        assert V.full_width_fma(tvm.target.Target(spec)), spec
        assert V.full_width_fma(spec), spec  # a plain dict target too


def test_datapath_knob_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(V, "FULL_WIDTH_FMA", False)
    assert not V.full_width_fma(tvm.target.Target(SAPPHIRERAPIDS))


@pytest.mark.parametrize("exts,ni,max_pixels,min_vectors,tile", [
    ([1, 4, 4, 512, 3, 3, 512], 4, 16, 1, (4, 1)),   # resnet18's 512 -> 512 on 4x4: 16 pixels x 1 vector
    ([1, 4, 4, 256, 3, 3, 256], 4, 16, 1, (4, 1)),
    ([1, 2, 2, 512, 3, 3, 512], 2, 16, 1, (2, 4)),   # 2x2: as _narrow_tile (4 pixels x 4 vectors)
    ([1, 3, 3, 64, 3, 3, 64], 3, 16, 1, (3, 2)),     # odd 3x3 map: 9 pixels x 2 vectors
    ([1, 5, 5, 32, 3, 3, 32], 5, 16, 1, (1, 2)),     # 5x5: no row block fits 16 pixels
    ([1, 32, 32, 48, 3, 3, 32], 8, 8, 1, (1, 3)),    # rule 4: 48 channels, 8 pixels x 3 vectors
    ([1, 64, 64, 16, 3, 3, 16], 8, 8, 1, (1, 1)),    # rule 4 leaves one-vector outputs as they were
    ([1, 4, 4, 512, 3, 3, 512], 4, 16, 2, (2, 2)),   # Zen 5: 8 pixels x 2 vectors on 4x4
    ([1, 2, 2, 512, 3, 3, 512], 2, 16, 2, (2, 4)),   # ... 2x2 and 3x3 maps as elsewhere
    ([1, 3, 3, 64, 3, 3, 64], 3, 16, 2, (3, 2)),
    ([1, 4, 4, 16, 3, 3, 16], 4, 16, 2, (4, 1)),     # ... one-vector outputs keep one vector
])
def test_tile_choice(exts: list, ni: int, max_pixels: int, min_vectors: int, tile: tuple) -> None:
    hi, nj = C._full_width_tile(exts, [0, 1, 2, 3], 1, ni, 16, 32, max_pixels, min_vectors)
    assert (hi, nj) == tile
    assert hi * ni * nj <= C.MAX_ACCUMULATORS and hi * ni * nj + nj + 1 <= 32


def _rule_calls(monkeypatch: pytest.MonkeyPatch, spec: dict) -> list:
    """The rules' tile choices while scheduling one conv of each rule's shape (rule 3: 256->256
    on a 4x4 map at batch 1; rule 4: 32->48 on 16x16) for ``spec``."""
    calls = _spy(monkeypatch)
    _schedule(_model(256, 256, 4, 3, 1, 1), spec)
    _schedule(_model(32, 48, 16, 3, 1, 1), spec)
    return calls


@pytest.mark.parametrize("spec", [ZNVER4, ZNVER3], ids=["znver4", "znver3"])
def test_amd_targets_never_take_the_rules(monkeypatch: pytest.MonkeyPatch, spec: dict) -> None:
    assert _rule_calls(monkeypatch, spec) == []


def test_intel_target_takes_both_rules(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _rule_calls(monkeypatch, SAPPHIRERAPIDS) == [(4, 1), (1, 3)]


def test_zen5_takes_both_rules_with_two_vectors_on_narrow_maps(monkeypatch: pytest.MonkeyPatch) -> None:
    """Zen 5 (two 512-bit FMA pipes) is full width; rule 3's tile there spans 2 channel vectors."""
    assert V.full_width_fma(tvm.target.Target(ZNVER5))
    assert _rule_calls(monkeypatch, ZNVER5) == [(2, 2), (1, 3)]
    monkeypatch.setattr(V, "SCHEDULE_BY_CPU", False)  # PARTITIONER_SCHEDULE_BY_CPU=0: the general tile
    assert _rule_calls(monkeypatch, ZNVER5)[-2:] == [(4, 1), (1, 3)]
    monkeypatch.setattr(V, "SCHEDULE_BY_CPU", True)
    monkeypatch.setattr(C, "NARROW_MIN_VECTORS", {})
    assert _rule_calls(monkeypatch, ZNVER5)[-2:] == [(4, 1), (1, 3)]


def test_rules_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(C, "FULL_WIDTH_NARROW_TILE", False)
    monkeypatch.setattr(C, "FULL_WIDTH_FEW_VECTORS", False)
    assert _rule_calls(monkeypatch, SAPPHIRERAPIDS) == []


def test_unmeasured_shapes_keep_their_tiles(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rule 4 only takes one-vector tiles (64 channels on a 6x6 map keep 6 pixels x 2 vectors);
    rule 3 no stems (3 input channels onto a 4x4 map)."""
    calls = _spy(monkeypatch)
    _schedule(_model(64, 64, 6, 3, 1, 2), SAPPHIRERAPIDS)
    _schedule(_model(3, 64, 8, 3, 2, 1), SAPPHIRERAPIDS)
    assert calls == []


def test_batched_narrow_map_keeps_its_tile(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rule 3 is for batch 1 only (at batch 8 the 16-pixel tile measured 1.00x)."""
    calls = _spy(monkeypatch)
    _schedule(_model(256, 256, 4, 3, 1, 2), SAPPHIRERAPIDS)
    assert calls == []


@pytest.mark.skipif(not CAN_RUN_SPR, reason="needs a CPU that runs sapphirerapids builds (AVX-512 + AMX)")
@pytest.mark.parametrize("ci,co,hw,k,stride,batch,residual", [
    (256, 256, 4, 3, 1, 1, True),    # rule 3: 16 pixels x 1 vector, residual add + relu epilogue
    (128, 256, 8, 3, 2, 1, False),   # rule 3: stride 2 onto a 4x4 map
    (64, 64, 3, 3, 1, 1, False),     # rule 3: odd 3x3 map, 9 pixels x 2 vectors
    (32, 32, 5, 3, 1, 1, True),      # rule 3: 5x5 map
    (64, 32, 5, 5, 1, 1, False),     # rule 3: 5x5 kernel on a 5x5 map (padding 2)
    (32, 48, 16, 3, 1, 1, True),     # rule 4: 48 channels, 8 pixels x 3 vectors
    (24, 48, 15, 3, 2, 2, False),    # rule 4: stride 2, odd input, batch 2
    (48, 48, 8, 5, 1, 1, False),     # rule 4: 5x5 kernel
])
def test_rule_builds_match_ort(monkeypatch: pytest.MonkeyPatch, ci: int, co: int, hw: int, k: int, stride: int,
                               batch: int, residual: bool) -> None:
    calls = _spy(monkeypatch)
    build_and_compare(_model(ci, co, hw, k, stride, batch, residual), tvm.target.Target(SAPPHIRERAPIDS))
    assert calls, "the rule did not take this shape"


@pytest.mark.skipif(not host_runs_znver5(), reason="needs a CPU that runs znver5 builds")
@pytest.mark.parametrize("ci,co,hw,k,stride,batch,residual", [
    (256, 256, 4, 3, 1, 1, True),    # rule 3 on Zen 5: 8 pixels x 2 vectors, residual add + relu epilogue
    (128, 256, 8, 3, 2, 1, False),   # stride 2 onto a 4x4 map
    (64, 64, 3, 3, 1, 1, False),     # odd 3x3 map: 9 pixels x 2 vectors, as elsewhere
])
def test_zen5_rule_builds_match_ort(monkeypatch: pytest.MonkeyPatch, ci: int, co: int, hw: int, k: int,
                                    stride: int, batch: int, residual: bool) -> None:
    calls = _spy(monkeypatch)
    build_and_compare(_model(ci, co, hw, k, stride, batch, residual), tvm.target.Target(ZNVER5))
    assert calls and all(nj >= 2 for _, nj in calls), calls
