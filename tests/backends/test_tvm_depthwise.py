"""The depthwise rule (backends/tvm/schedules/depthwise.py) and the clamp rewrite
(backends/tvm/clip_as_max_min.py) keep numerics and fuse the layer into one kernel.

Each case is a depthwise ``Conv`` (groups = channels) -> ``BatchNormalization`` -> ReLU6
(``Clip`` with constant bounds) -> a 1x1 ``Conv``, compiled through the ``scheduled`` pipeline
for the host and for an AVX2 target, compared with ONNX Runtime on seeded inputs (rtol 1e-4,
atol 1e-5). The structure checks: the depthwise conv, its batch norm and the clamp are one
kernel (``fused_conv2d_..._maximum_minimum``: no NCHW round trip around ReLU6), and that kernel
was scheduled by the depthwise rule (its (n, h) row loop) with the padding inlined into its loads
(no padded copy); with inlining off, the padded rows are inside the row loop exactly when the
rule's recopy bound says so. Maps of 3 or more column tiles run their first and last tile in
loops of their own (``SPLIT_BORDER``; on both targets, borders wider than a tile included). A NaN
input stays NaN through the fused clamp, as in ONNX Runtime.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import tvm
from onnx import TensorProto, helper, numpy_helper
from tvm import relax

from backends.tvm.lower import lower_program
from backends.tvm.pipeline import run_pipeline
from backends.tvm.schedules.depthwise import MAX_PAD_RECOPY, Depthwise, row_tile
from backends.tvm.target import detect_host_target

RTOL, ATOL = 1e-4, 1e-5
TARGETS = {"host": None, "avx2": {"kind": "llvm", "mcpu": "haswell"}}


def _model(n: int, c: int, hw: int, k: int, s: int, dil: int = 1) -> onnx.ModelProto:
    rng = np.random.default_rng(c * 100 + hw * 10 + k + s)
    p = (k - 1) // 2 * dil
    f32 = np.float32
    inits = [numpy_helper.from_array((rng.standard_normal((c, 1, k, k)) * 0.4).astype(f32), "w"),
             numpy_helper.from_array(rng.uniform(0.5, 1.5, c).astype(f32), "scale"),
             numpy_helper.from_array((rng.standard_normal(c) * 0.3).astype(f32), "shift"),
             numpy_helper.from_array((rng.standard_normal(c) * 0.1).astype(f32), "mean"),
             numpy_helper.from_array(rng.uniform(0.5, 1.5, c).astype(f32), "var"),
             numpy_helper.from_array(np.array(0, f32), "lo"), numpy_helper.from_array(np.array(6, f32), "hi"),
             numpy_helper.from_array((rng.standard_normal((16, c, 1, 1)) * 0.2).astype(f32), "w2")]
    nodes = [helper.make_node("Conv", ["x", "w"], ["dw"], group=c, kernel_shape=[k, k], strides=[s, s],
                              pads=[p] * 4, dilations=[dil, dil]),
             helper.make_node("BatchNormalization", ["dw", "scale", "shift", "mean", "var"], ["bn"]),
             helper.make_node("Clip", ["bn", "lo", "hi"], ["r6"]),
             helper.make_node("Conv", ["r6", "w2"], ["y"], kernel_shape=[1, 1])]
    g = helper.make_graph(nodes, "dw", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [n, c, hw, hw])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], initializer=inits)
    return onnx.shape_inference.infer_shapes(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]))


def _run(m: onnx.ModelProto, target_name: str, x: np.ndarray) -> tuple[np.ndarray, np.ndarray, dict[str, str]]:
    spec = TARGETS[target_name]
    target = tvm.target.Target(spec if spec is not None else detect_host_target())
    ref = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    mod = run_pipeline(lower_program(m).mod, "scheduled", target)
    funcs = {gv.name_hint: f.script() for gv, f in mod.functions_items() if isinstance(f, tvm.tirx.PrimFunc)}
    vm = relax.VirtualMachine(tvm.compile(mod, target), tvm.cpu())
    res = vm["main"](tvm.runtime.tensor(x))
    got = res.numpy() if isinstance(res, tvm.runtime.Tensor) else res[0].numpy()
    return got, ref, funcs


@pytest.mark.parametrize("target_name", list(TARGETS))
@pytest.mark.parametrize(
    "n,c,hw,k,s,dil",
    [(1, 32, 16, 3, 1, 1),    # MobileNet 3x3 stride 1
     (2, 48, 15, 5, 2, 1),    # 5x5 stride 2, odd size, batch 2
     (1, 32, 14, 3, 2, 1),    # 3x3 stride 2: padded rows per output row
     (1, 24, 7, 3, 1, 1),     # channels a multiple of 8 only, prime width (row tile 7)
     (1, 16, 12, 3, 1, 2)],   # dilation 2
    ids=["3x3s1", "5x5s2-b2", "3x3s2", "c24-w7", "dil2"],
)
def test_depthwise_bn_relu6_matches_ort(n: int, c: int, hw: int, k: int, s: int, dil: int, target_name: str) -> None:
    m = _model(n, c, hw, k, s, dil)
    x = np.random.default_rng(0).standard_normal((n, c, hw, hw)).astype(np.float32)
    got, ref, funcs = _run(m, target_name, x)
    np.testing.assert_allclose(got, ref, rtol=RTOL, atol=ATOL)
    fused = [name for name in funcs if name.startswith("fused_conv2d") and "maximum_minimum" in name]
    assert fused, f"depthwise conv, BN and ReLU6 are not one kernel: {sorted(funcs)}"
    assert not any("transpose" in name and "maximum" in name for name in funcs), sorted(funcs)
    # the depthwise rule's mark: the (n, h) row loop; stride 1, dilation 1: the padded input per
    # kernel row of each tile (TILE_INPUT), else no padded copy (the pad is inlined)
    body = funcs[fused[0]]
    assert "for nn_yy_fused" in body, "not scheduled by the depthwise rule"
    if s == 1 and dil == 1:
        assert body.index('T.sblock("pad_temp")') > body.index("for ry in"), "input not tiled per kernel row"
    else:
        assert 'T.sblock("pad_temp")' not in body, "the padding was not inlined into the conv"


@pytest.mark.parametrize("k,s", [(3, 1), (3, 2)], ids=["3x3s1", "3x3s2"])
def test_padded_copy_when_inlining_is_off(k: int, s: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """PAD_INLINE off: the padded rows are computed inside the row loop exactly when the rule's
    recopy bound says so (stride 2), else once before it; both still match ORT."""
    import backends.tvm.schedules.depthwise as dmod

    monkeypatch.setattr(dmod, "PAD_INLINE", False)
    monkeypatch.setattr(dmod, "TILE_INPUT", False)
    m = _model(1, 32, 14, k, s)
    x = np.random.default_rng(2).standard_normal((1, 32, 14, 14)).astype(np.float32)
    got, ref, funcs = _run(m, "host", x)
    np.testing.assert_allclose(got, ref, rtol=RTOL, atol=ATOL)
    body = funcs[next(n for n in funcs if n.startswith("fused_conv2d") and "maximum_minimum" in n)]
    per_row = body.index('T.sblock("pad_temp")') > body.index("for nn_yy_fused")
    assert per_row == (k / s <= MAX_PAD_RECOPY), f"padding per row: {per_row} for k={k}, stride={s}"


def test_nan_stays_nan_through_the_fused_clamp() -> None:
    m = _model(1, 32, 8, 3, 1)
    x = np.random.default_rng(1).standard_normal((1, 32, 8, 8)).astype(np.float32)
    x[0, 3, 4, 4] = np.nan
    got, ref, _ = _run(m, "host", x)
    assert np.array_equal(np.isnan(got), np.isnan(ref)) and np.isnan(ref).any()
    np.testing.assert_allclose(got, ref, rtol=RTOL, atol=ATOL)


def test_row_tile() -> None:
    assert [row_tile(w) for w in (112, 56, 28, 14, 7, 13, 1)] == [8, 8, 7, 7, 7, 1, 1]
    assert Depthwise() is not None


@pytest.mark.parametrize("target_name", list(TARGETS))
@pytest.mark.parametrize(
    "n,c,hw,k,s,dil,tiles",
    [(1, 32, 28, 3, 1, 1, 4),    # MobileNet 28x28: 4 tiles of 7
     (2, 16, 24, 5, 1, 1, 3),    # 5x5, pad 2: the border is 2 of the tile's 8 columns
     (1, 16, 56, 3, 2, 1, 4),    # stride 2, 56 -> 28
     (1, 16, 26, 3, 1, 2, 13),   # dilation 2 (pad 2) on tiles of 2 columns
     (1, 16, 13, 5, 1, 1, 13)],  # tiles of 1 column, a 2-column border: the second tile keeps its check
    ids=["3x3s1-28", "5x5-b2", "3x3s2-56", "dil2-26", "5x5-w13"],
)
def test_border_tiles_split_from_the_interior(n: int, c: int, hw: int, k: int, s: int, dil: int, tiles: int,
                                              target_name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """SPLIT_BORDER: the column-tile loop runs as [0, 1), [1, tiles - 1), [tiles - 1, tiles);
    the result matches ORT (also where the border is wider than one tile); off: one loop."""
    import backends.tvm.schedules.depthwise as dmod

    monkeypatch.setattr(dmod, "TILE_INPUT", False)  # the split is for the inlined padding
    m = _model(n, c, hw, k, s, dil)
    x = np.random.default_rng(3).standard_normal((n, c, hw, hw)).astype(np.float32)
    interior = f"in range(T.int64(1), T.int64({tiles - 1})):"
    for split in (True, False):
        monkeypatch.setattr(dmod, "SPLIT_BORDER", split)
        got, ref, funcs = _run(m, target_name, x)
        np.testing.assert_allclose(got, ref, rtol=RTOL, atol=ATOL)
        body = funcs[next(name for name in funcs if name.startswith("fused_conv2d") and "maximum_minimum" in name)]
        assert (interior in body) == split, f"split={split}: interior loop {interior!r} present: {interior in body}"


@pytest.mark.parametrize(
    "c,hw,parallel",
    [(32, 56, True),     # MobileNet's 32 on 56x56: 1.8 MFLOP, ~30 us on one thread
     (192, 14, False)],  # 0.68 MFLOP, ~10 us: under the scaled threshold, stays on one thread
    ids=["32c-56", "192c-14"],
)
def test_depthwise_thread_threshold_scaled_by_its_rate(c: int, hw: int, parallel: bool,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """PARALLEL_PEAK_FRACTION: a depthwise layer's FLOP threshold for the thread pool is scaled by
    the share of the FMA peak it runs at, so a 1.8 MFLOP layer (under the 2 MFLOP GEMM threshold)
    gets a parallel row loop and a 0.68 MFLOP one does not; with the fraction at 1.0 (the GEMM
    threshold as is) neither does. Both builds match ORT."""
    import backends.tvm.schedules.depthwise as dmod
    from backends.tvm.schedules import threads

    monkeypatch.delenv(threads.ENV, raising=False)
    monkeypatch.setattr(threads, "_configured", None)
    m = _model(1, c, hw, 3, 1)
    x = np.random.default_rng(4).standard_normal((1, c, hw, hw)).astype(np.float32)
    for fraction, expect in ((dmod.PARALLEL_PEAK_FRACTION, parallel), (1.0, False)):
        monkeypatch.setattr(dmod, "PARALLEL_PEAK_FRACTION", fraction)
        got, ref, funcs = _run(m, "host", x)
        np.testing.assert_allclose(got, ref, rtol=RTOL, atol=ATOL)
        body = funcs[next(name for name in funcs if name.startswith("fused_conv2d") and "maximum_minimum" in name)]
        assert "for nn_yy_fused" in body, "not scheduled by the depthwise rule"
        assert ("for nn_yy_fused in T.parallel" in body) == expect, f"fraction {fraction}: parallel row loop"


@pytest.mark.parametrize("target_name", list(TARGETS))
@pytest.mark.parametrize(
    "n,c,hw,k,parallel",
    [(8, 144, 28, 3, True),   # MobileNet b8's 144 on 28x28: parallel row loop, row tile 7
     (2, 32, 24, 5, True),    # 5x5: a 12-vector window (row tile 8)
     (1, 24, 14, 3, False)],  # 24 channels: 8 lanes on both targets; under the thread threshold
    ids=["144c-28-b8", "5x5-b2", "c24-serial"],
)
def test_input_tiled_per_kernel_row(n: int, c: int, hw: int, k: int, parallel: bool, target_name: str,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """TILE_INPUT (stride 1): the padded input vectors one kernel row of a register tile reads are
    computed once into a stack buffer inside the ``ry`` loop, the ``rx`` taps unrolled, and the
    kernel allocates no workspace (accumulators and window under TVM's 1 KiB stack limit), also in
    a parallel row loop; matches ORT. Off: the padding is inlined and the kernel allocates its
    accumulators from the workspace pool (a whole output row of them for a split map)."""
    import backends.tvm.schedules.depthwise as dmod
    from backends.tvm.schedules import threads

    monkeypatch.delenv(threads.ENV, raising=False)
    monkeypatch.setattr(threads, "_configured", None)
    m = _model(n, c, hw, k, 1)
    x = np.random.default_rng(5).standard_normal((n, c, hw, hw)).astype(np.float32)
    got, ref, funcs = _run(m, target_name, x)
    np.testing.assert_allclose(got, ref, rtol=RTOL, atol=ATOL)
    name = next(name for name in funcs if name.startswith("fused_conv2d") and "maximum_minimum" in name)
    body = funcs[name]
    assert ("for nn_yy_fused in T.parallel" in body) == parallel
    assert body.index("for ry in") < body.index('T.sblock("pad_temp")') < body.index("for rx in T.unroll"), \
        "the padded input is not computed per kernel row of the tile"
    assert "TVMBackendAllocWorkspace" not in _kernel_llvm(m, name, target_name), "a workspace in the kernel"


def _kernel_llvm(m: onnx.ModelProto, name: str, target_name: str) -> str:
    """The LLVM IR of the model's kernel ``name`` compiled alone (its calls, not the VM's)."""
    spec = TARGETS[target_name]
    target = tvm.target.Target(spec if spec is not None else detect_host_target())
    mod = run_pipeline(lower_program(m).mod, "scheduled", target)
    func = next(f for gv, f in mod.functions_items() if gv.name_hint == name)
    lib = tvm.compile(func.with_attr("global_symbol", "main"), target)
    src = lib.mod.imports[0] if lib.mod.imports else lib.mod
    return "\n".join(line for line in src.inspect_source("ll").splitlines() if " call " in line)
