"""The 16-register (AVX2) GEMM tile: 6 rows x 2 vectors with A packed into 6-row panels.

``backends/tvm/schedules/gemm_packed.py`` (:func:`micro_tile` rule 6, ``PACK_A_16_REGISTERS``):
on an AVX2 target a matrix product takes the 6 x 16 tile (12 accumulators), its rows padded to
a multiple of 6, and for K >= ``PACK_A_MIN_K`` reads A from a copy packed as
``Ap[.., i // 6, k, i % 6]``. Each case is compared with numpy (float64) on seeded inputs
(rtol 1e-4, atol 1e-5 * sqrt(K)); the AVX-512 (``znver4``) schedule must not change.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
import pytest
import tvm
from onnx import TensorProto, helper, numpy_helper
from tvm import relax

from backends.tvm.lower import lower_program
from backends.tvm.pipeline import run_pipeline
from backends.tvm.schedules import gemm_packed
from backends.tvm.schedules.gemm_packed import _a_block_tiles, _pack_a_plan, _register_tile
from tvm_build_check import ZNVER3, ZNVER4, host_has

F = TensorProto.FLOAT


def _matmul(m: int, k: int, n: int, lead: tuple[int, ...] = (), const_b: bool = True, epilogue: bool = False) -> onnx.ModelProto:
    rng = np.random.default_rng(m * 7 + k * 3 + n)
    inputs = [helper.make_tensor_value_info("x", F, [*lead, m, k])]
    inits = []
    if const_b:
        inits.append(numpy_helper.from_array((rng.standard_normal((k, n)) * 0.2).astype(np.float32), "w"))
    else:
        inputs.append(helper.make_tensor_value_info("w", F, [*lead, k, n]))
    nodes = [helper.make_node("MatMul", ["x", "w"], ["mm" if epilogue else "y"])]
    if epilogue:  # bias + relu fused into the padded tile's write-back
        inits.append(numpy_helper.from_array((rng.standard_normal(n) * 0.2).astype(np.float32), "b"))
        nodes += [helper.make_node("Add", ["mm", "b"], ["a"]), helper.make_node("Relu", ["a"], ["y"])]
    g = helper.make_graph(nodes, "pack_a", inputs, [helper.make_tensor_value_info("y", F, None)], initializer=inits)
    return onnx.shape_inference.infer_shapes(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]))


def _scheduled(model: onnx.ModelProto, spec: dict) -> Any:
    target = tvm.target.Target(spec)
    return target, run_pipeline(lower_program(model).mod, "scheduled", target)


def _gemm_script(mod: Any) -> str:
    return "\n".join(f.script() for gv, f in mod.functions_items()
                     if isinstance(f, tvm.tirx.PrimFunc) and "vectorized" in f.script() and "k in range" in f.script())


def _run_and_check(model: onnx.ModelProto, spec: dict) -> Any:
    target, mod = _scheduled(model, spec)
    rng = np.random.default_rng(0)
    feeds = {}
    for v in model.graph.input:
        shape = [d.dim_value for d in v.type.tensor_type.shape.dim]
        feeds[v.name] = rng.standard_normal(shape).astype(np.float32)
    inits = {t.name: numpy_helper.to_array(t).astype(np.float64) for t in model.graph.initializer}
    x, w = feeds["x"].astype(np.float64), feeds["w"].astype(np.float64) if "w" in feeds else inits["w"]
    ref = x @ w
    if "b" in inits:
        ref = np.maximum(ref + inits["b"], 0.0)
    vm = relax.VirtualMachine(tvm.compile(mod, target), tvm.cpu())
    res = vm["main"](*[tvm.runtime.tensor(feeds[v.name]) for v in model.graph.input])
    got = res.numpy() if isinstance(res, tvm.runtime.Tensor) else res[0].numpy()
    k = feeds["x"].shape[-1]
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-5 * np.sqrt(k))
    return mod


@pytest.fixture(params=["packed", "in-place"])
def pack_mode(request, monkeypatch):
    """Packed A at every K (the K >= PACK_A_MIN_K path, on shapes small enough to test fast) or
    A read in place (the default below PACK_A_MIN_K and PACK_A_MIN_N, when 6 divides M)."""
    monkeypatch.setattr(gemm_packed, "PACK_A_MIN_K", 16 if request.param == "packed" else 1 << 30)
    monkeypatch.setattr(gemm_packed, "PACK_A_MIN_N", 1 << 30)
    return request.param


@pytest.mark.skipif(not host_has("avx2"), reason="built for AVX2; this CPU cannot run it")
@pytest.mark.parametrize("m,k,n", [(6, 64, 32), (7, 48, 32), (64, 96, 48), (100, 64, 40), (512, 128, 128), (100, 37, 64)],
                         ids=["m6", "m7", "m64", "m100-n40", "m512", "m100-k37"])
def test_avx2_matmul_matches_numpy(m, k, n, pack_mode):
    mod = _run_and_check(_matmul(m, k, n), ZNVER3)
    script = _gemm_script(mod)
    takes_tile = m >= gemm_packed.PACK_A_MIN[0] and -(-n // 8) * 8 % 16 == 0 and (pack_mode == "packed" or m % 6 == 0)
    assert "T.unroll(T.int64(6))" in script or not takes_tile, script
    assert ("// T.int64(6)" in script) == (takes_tile and pack_mode == "packed"), "A packed (or not) against the rule"


def _broadcast(x_shape: list[int], w_shape: list[int], const_w: bool) -> onnx.ModelProto:
    inputs = [helper.make_tensor_value_info("x", F, x_shape)]
    w = (np.random.default_rng(5).standard_normal(w_shape) * 0.2).astype(np.float32)
    inits = [numpy_helper.from_array(w, "w")] if const_w else []
    inputs += [] if const_w else [helper.make_tensor_value_info("w", F, w_shape)]
    g = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "bcast", inputs,
                          [helper.make_tensor_value_info("y", F, None)], initializer=inits)
    return onnx.shape_inference.infer_shapes(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]))


CASES = {"bias-relu-m100": lambda: _matmul(100, 64, 48, epilogue=True),
         "batched-activation-b": lambda: _matmul(50, 32, 64, lead=(3,), const_b=False),
         "broadcast-a": lambda: _broadcast([50, 32], [3, 32, 64], const_w=False),
         "broadcast-const-b": lambda: _broadcast([3, 50, 32], [32, 64], const_w=True),
         "4d": lambda: _broadcast([2, 2, 50, 32], [2, 2, 32, 64], const_w=False)}


@pytest.mark.skipif(not host_has("avx2"), reason="built for AVX2; this CPU cannot run it")
@pytest.mark.parametrize("case", list(CASES))
def test_avx2_packed_a_epilogue_and_batched(case, pack_mode):
    _run_and_check(CASES[case](), ZNVER3)


@pytest.mark.skipif(not host_has("avx2"), reason="built for AVX2; this CPU cannot run it")
def test_avx2_m_blocked_order_matches_numpy(monkeypatch):
    # B too large for rows-outer: M blocks of packed A (rule 6's MC), each streamed past every B panel
    monkeypatch.setattr(gemm_packed, "PACK_A_MIN_K", 16)
    monkeypatch.setattr(gemm_packed, "ROWS_OUTER_B_BYTES", 1024)
    monkeypatch.setattr(gemm_packed, "PACK_A_BLOCK_BYTES", 6 * 4 * 64 * 4)
    assert _a_block_tiles(22, 64) is not None
    _run_and_check(_matmul(130, 64, 64), ZNVER3)


def test_tile_per_target():
    avx2, avx512 = tvm.target.Target(ZNVER3), tvm.target.Target(ZNVER4)
    exts = [512, 512, 512]
    assert _pack_a_plan(avx2, _register_tile(avx2, exts, 2), exts, 2, None)[1:3] == (6, 16)
    # AVX-512: unchanged (4 x 4 vectors, no packed A)
    assert _register_tile(avx512, exts, 2)[:3] == (16, 4, 64)
    assert _pack_a_plan(avx512, _register_tile(avx512, exts, 2), exts, 2, None) is None
    _, mod = _scheduled(_matmul(512, 1024, 128), ZNVER4)
    assert "T.int64(6))" not in _gemm_script(mod)
    # 1x1 convolutions (several reductions) and N = 8 (one vector) keep micro_tile's tile
    assert _pack_a_plan(avx2, _register_tile(avx2, [64, 64, 1, 1, 32], 2), [64, 64, 1, 1, 32], 2, None) is None
    assert _pack_a_plan(avx2, _register_tile(avx2, [64, 8, 64], 2), [64, 8, 64], 2, None) is None


def test_knob_off_keeps_the_old_tile(monkeypatch):
    exts = [512, 1024, 512]
    avx2 = tvm.target.Target(ZNVER3)
    plan = _register_tile(avx2, exts, 2)
    monkeypatch.setattr(gemm_packed, "PACK_A_16_REGISTERS", False)
    assert _pack_a_plan(avx2, plan, exts, 2, None) is None
    _, mod = _scheduled(_matmul(96, 1024, 64), ZNVER3)
    assert "// T.int64(6)" not in _gemm_script(mod)


def test_default_packs_a_from_min_k_or_min_n():
    for m, k, n in ((100, gemm_packed.PACK_A_MIN_K, 64), (100, 64, gemm_packed.PACK_A_MIN_N)):
        _, mod = _scheduled(_matmul(m, k, n), ZNVER3)
        assert "// T.int64(6)" in _gemm_script(mod), (m, k, n)
    _, mod = _scheduled(_matmul(96, 256, 64), ZNVER3)  # A in place, 6 | M
    script = _gemm_script(mod)
    assert "// T.int64(6)" not in script and "T.unroll(T.int64(6))" in script
    _, mod = _scheduled(_matmul(100, 256, 64), ZNVER3)  # 6 does not divide M: the old tile
    assert "T.unroll(T.int64(6))" not in _gemm_script(mod)
