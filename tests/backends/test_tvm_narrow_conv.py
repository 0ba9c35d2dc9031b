"""Narrow-map convolutions (backends/tvm/schedules/contraction.py, ``_narrow_tile``) and RGB stems
(injective.py, ``SHORT_INNER``; contraction.py, ``_stem_vectors``): a direct
conv whose output width is below ``NARROW_ROWS`` gets a register tile over two spatial axes and
more channel vectors; every build matches ONNX Runtime (rtol 1e-4, atol 1e-5, random weights).

The spec checks come from the rule's docstring (4 pixels x 4 vectors on a 2x2 map with AVX-512's
32 registers; the accumulators stay within MAX_ACCUMULATORS and the register file), and the
outer axis is used only when the weights do not depend on it (a batched matmul's batch does).
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import tvm
from onnx import TensorProto, helper
from tvm import relax

from backends.tvm.lower import lower_program
from backends.tvm.pipeline import run_pipeline
from backends.tvm.schedules import contraction as C
from backends.tvm.target import detect_host_target
from models_zoo.conv_layers import single_conv_model


def _conv(ci: int, hw: int, co: int, k: int, s: int, batch: int) -> onnx.ModelProto:
    return single_conv_model(ci, hw, co, k, s, batch, seed=ci + hw + co + k + s + batch)


def _batched_matmul(batch: int, m: int, k: int, n: int) -> onnx.ModelProto:
    g = helper.make_graph([helper.make_node("MatMul", ["a", "b"], ["y"])], "bmm",
                          [helper.make_tensor_value_info("a", TensorProto.FLOAT, [batch, m, k]),
                           helper.make_tensor_value_info("b", TensorProto.FLOAT, [batch, k, n])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    return onnx.shape_inference.infer_shapes(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]))


def _check(m: onnx.ModelProto) -> None:
    rng = np.random.default_rng(0)
    feeds = {i.name: rng.standard_normal([d.dim_value for d in i.type.tensor_type.shape.dim]).astype(np.float32)
             for i in m.graph.input}
    ref = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    target = tvm.target.Target(detect_host_target())
    mod = run_pipeline(lower_program(m).mod, "scheduled", target)
    vm = relax.VirtualMachine(tvm.compile(mod, target), tvm.cpu())
    res = vm["main"](*[tvm.runtime.tensor(feeds[i.name]) for i in m.graph.input])
    got = (res if isinstance(res, tvm.runtime.Tensor) else res[0]).numpy()
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("ci,hw,co,k,s,batch", [
    (64, 2, 64, 3, 1, 1),    # 2x2 map: 2 x 2 pixels
    (32, 4, 96, 3, 1, 2),    # 4x4 map, 6 vectors of 16 (or 12 of 8), batch 2
    (48, 8, 64, 3, 2, 1),    # stride 2 onto a 4x4 map
    (16, 3, 48, 3, 1, 1),    # 3x3 map: odd rows
    (24, 5, 32, 3, 1, 3),    # 5x5 map, batch 3: no outer rows fit (2 x 5 > 8), wider vectors only
], ids=["2x2", "4x4-b2", "s2", "3x3", "5x5"])
def test_narrow_convs_match_ort(ci: int, hw: int, co: int, k: int, s: int, batch: int) -> None:
    _check(_conv(ci, hw, co, k, s, batch))


def test_small_batched_matmul_matches_ort() -> None:
    _check(_batched_matmul(6, 2, 24, 32))


def test_narrow_tile_rule() -> None:
    # extents of a 3x3 conv (n, oh, ow, co, kh, kw, ci) on a 2x2 map, 512 channels, AVX-512
    exts = [1, 2, 2, 512, 3, 3, 512]
    s_idx = [0, 1, 2, 3]
    assert C._narrow_tile(exts, s_idx, 1, 2, 16, 32) == (2, 4)
    # no shareable outer axis: widen the channel vectors only
    hi, nj = C._narrow_tile(exts, s_idx, None, 2, 16, 32)
    assert hi == 1 and nj > 2
    for ni in (1, 2, 3, 4, 5):
        for regs in (16, 32):
            hi, nj = C._narrow_tile([1, 4, ni, 256, 3, 3, 64], s_idx, 1, ni, 16 if regs == 32 else 8, regs)
            acc = hi * ni * nj
            assert acc <= C.MAX_ACCUMULATORS and acc + nj + 1 <= regs and hi * ni <= 8


def test_outer_axis_only_when_weights_are_shared() -> None:
    from tvm import s_tir

    target = tvm.target.Target(detect_host_target())
    for m, shared in ((_conv(16, 2, 32, 3, 1, 2), True), (_batched_matmul(6, 2, 24, 32), False)):
        from backends.tvm import pipeline as P

        mod = P.pre_legalize(lower_program(m).mod, target)
        with target:
            mod = tvm.transform.Sequential(P.legalize_passes(target))(mod)
        func = next(f for gv, f in mod.functions_items()
                    if isinstance(f, tvm.tirx.PrimFunc) and ("conv2d" in gv.name_hint or "matmul" in gv.name_hint))
        sch = s_tir.Schedule(func)
        _root, _red, stmt, loops, s_idx, _r, vec_pos = C.Contraction._match(sch)
        exts = [int(sch.get(lp).extent) for lp in loops]
        row_pos = next(i for i in reversed(s_idx[:-1]) if exts[i] > 1)
        col = C._shared_outer_axis(stmt, C.ivs_of(stmt), s_idx, row_pos, vec_pos, exts)
        assert (col is not None) == shared


@pytest.mark.parametrize("batch,k,s", [(1, 3, 2), (2, 7, 2), (1, 3, 1)], ids=["3x3s2", "7x7s2-b2", "3x3s1"])
def test_rgb_stem_matches_ort(batch: int, k: int, s: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """3 input channels: with the row-split pad copy off (injective.SPLIT_PAD_COPY, tested in
    test_tvm_split_pad_copy.py), the pad's channel loop is unrolled outside the parallel loop
    (injective.SHORT_INNER); the build still matches ORT."""
    from backends.tvm.schedules import injective

    monkeypatch.setattr(injective, "SPLIT_PAD_COPY", False)
    m = _conv(3, 40, 32, k, s, batch)
    _check(m)
    target = tvm.target.Target(detect_host_target())
    mod = run_pipeline(lower_program(m).mod, "scheduled", target)
    conv = next(f.script() for gv, f in mod.functions_items()
                if isinstance(f, tvm.tirx.PrimFunc) and "conv2d" in gv.name_hint)
    assert "T.unroll(T.int64(3))" in conv


def test_rgb_transpose_matches_ort() -> None:
    g = helper.make_graph([helper.make_node("Transpose", ["x"], ["y"], perm=[0, 2, 3, 1])], "t",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 24, 40])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    _check(onnx.shape_inference.infer_shapes(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])))


def test_rgb_stem_takes_one_channel_vector(monkeypatch: pytest.MonkeyPatch) -> None:
    """contraction._stem_vectors: a 7x7 stride-2 3 -> 64 stem on a 32x32 output map gets one
    channel vector per tile (the loop inside the vector lanes has extent 1); off: two."""
    from tvm import s_tir

    def vectors_per_tile() -> int:
        m = _conv(3, 64, 64, 7, 2, 1)
        _check(m)
        target = tvm.target.Target(detect_host_target())
        mod = run_pipeline(lower_program(m).mod, "scheduled", target)
        func = next(f for f in mod.functions.values()
                    if isinstance(f, tvm.tirx.PrimFunc) and "conv2d_nhwc_update" in f.script())
        sch = s_tir.Schedule(func)
        loops = sch.get_loops(sch.get_sblock("conv2d_nhwc_update"))
        return int(sch.get(loops[-2]).extent)

    assert vectors_per_tile() == 1
    monkeypatch.setattr(C, "STEM_ONE_VECTOR", False)
    assert vectors_per_tile() == 2


def test_small_stem_keeps_two_vectors() -> None:
    """A 3x3 stem's weight panel (3x3x3x32 floats, 3.4 KiB) is under STEM_PANEL_BYTES: the rule
    leaves its 2 vectors (one vector measured 1.58x slower on MobileNet's stem)."""
    exts = [1, 56, 56, 64, 3, 3, 3]
    assert C._stem_vectors(exts, [4, 5, 6], 16, 2) == 2
    assert C._stem_vectors([1, 56, 56, 64, 7, 7, 3], [4, 5, 6], 16, 2) == 1
