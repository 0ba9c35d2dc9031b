"""The packed GEMM rule (backends/tvm/schedules/gemm_packed.py) keeps numerics.

Each case compiles through the "scheduled" pipeline for the host and for an AVX2 target
(``haswell``: the 8-lane micro-tile), and is compared with ONNX Runtime on seeded inputs
(rtol 1e-4, atol 1e-5). Cases with a constant weight and N a multiple of the vector width also
check that the weight was packed at build time (a ``*_prepacked`` kernel exists), so a rule
that silently stops matching fails here. Odd shapes (M, K not multiples of the tile, M = 1,
N not a multiple of the vector width) must stay correct whichever rule takes them.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import tvm
from onnx import TensorProto, helper, numpy_helper
from tvm import relax

import models_zoo
from backends.tvm.lower import lower_program
from backends.tvm.peak import _fma_func, _triad_func
from backends.tvm.pipeline import run_pipeline
from backends.tvm.schedules.gemm_packed import _fuse_rows, _register_tile, micro_tile
from backends.tvm.target import detect_host_target

F = TensorProto.FLOAT
RTOL, ATOL = 1e-4, 1e-5
TARGETS = {"host": None, "avx2": {"kind": "llvm", "mcpu": "haswell"}}


def _model(nodes, inputs, inits=()) -> onnx.ModelProto:
    g = helper.make_graph(nodes, "case", inputs, [helper.make_tensor_value_info("y", F, None)], initializer=list(inits))
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    return onnx.shape_inference.infer_shapes(m)


def _w(rng, *shape):
    return (rng.standard_normal(shape) * 0.2).astype(np.float32)


def _check(m: onnx.ModelProto, target_name: str, expect_prepacked: bool) -> None:
    spec = TARGETS[target_name]
    target = tvm.target.Target(spec if spec is not None else detect_host_target())
    feeds = models_zoo.sample_inputs(m, 0)
    ref = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    mod = run_pipeline(lower_program(m).mod, "scheduled", target)
    names = [gv.name_hint for gv, f in mod.functions_items() if isinstance(f, tvm.tirx.PrimFunc)]
    vm = relax.VirtualMachine(tvm.compile(mod, target), tvm.cpu())
    res = vm["main"](*[tvm.runtime.tensor(feeds[v.name]) for v in m.graph.input])
    got = res.numpy() if isinstance(res, tvm.runtime.Tensor) else res[0].numpy()
    np.testing.assert_allclose(got, ref[0], rtol=RTOL, atol=ATOL)
    if expect_prepacked:
        assert any(n.endswith("_prepacked") for n in names), f"weight not packed at build time: {names}"


def _matmul_case(m: int, k: int, n: int, lead: tuple[int, ...] = (), epilogue: bool = False) -> onnx.ModelProto:
    rng = np.random.default_rng(m * 1000 + k * 10 + n)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["mm" if epilogue else "y"])]
    inits = [numpy_helper.from_array(_w(rng, k, n), "w")]
    if epilogue:
        nodes += [helper.make_node("Add", ["mm", "b"], ["a"]), helper.make_node("Relu", ["a"], ["y"])]
        inits.append(numpy_helper.from_array(_w(rng, n), "b"))
    return _model(nodes, [helper.make_tensor_value_info("x", F, [*lead, m, k])], inits)


@pytest.mark.parametrize("target_name", list(TARGETS))
@pytest.mark.parametrize(
    "m,k,n,lead,epilogue,packed",
    [
        (48, 64, 64, (), False, True),      # tile multiples
        (37, 45, 64, (), False, True),      # M prime, K odd
        (1, 33, 32, (), False, False),      # M = 1 (a GEMV: too small for a register tile)
        (30, 16, 48, (2,), True, True),     # 3-D input, bias + relu epilogue fused
        (20, 24, 50, (), True, False),      # N not a multiple of the vector width
        (16, 20, 40, (), False, True),      # N a multiple of 8 only (half-width vectors on AVX-512)
    ],
    ids=["multiples", "odd-mk", "m1", "3d-epilogue", "odd-n", "n-mult-8"],
)
def test_packed_matmul_matches_ort(m, k, n, lead, epilogue, packed, target_name):
    _check(_matmul_case(m, k, n, lead, epilogue), target_name, packed)


@pytest.mark.parametrize("target_name", list(TARGETS))
def test_gemm_transb_bias_matches_ort(target_name):
    rng = np.random.default_rng(7)
    nodes = [helper.make_node("Gemm", ["x", "w", "b"], ["y"], transB=1)]
    m = _model(nodes, [helper.make_tensor_value_info("x", F, [21, 40])],
               [numpy_helper.from_array(_w(rng, 64, 40), "w"), numpy_helper.from_array(_w(rng, 64), "b")])
    _check(m, target_name, expect_prepacked=True)


@pytest.mark.parametrize("target_name", list(TARGETS))
def test_batched_activation_matmul_matches_ort(target_name):
    # attention's PV: both operands are activations (packed per call, not at build time)
    nodes = [helper.make_node("MatMul", ["p", "v"], ["y"])]
    m = _model(nodes, [helper.make_tensor_value_info("p", F, [2, 3, 24, 20]),
                       helper.make_tensor_value_info("v", F, [2, 3, 20, 32])])
    _check(m, target_name, expect_prepacked=False)


@pytest.mark.parametrize("lanes,registers", [(8, 16), (16, 32), (8, 32)])
@pytest.mark.parametrize("m", [1, 7, 37, 64, 512, 1000])
@pytest.mark.parametrize("n", [32, 64, 1000])
def test_micro_tile_fits_registers_and_divides(lanes, registers, m, n):
    tile = micro_tile(lanes, m, n, registers)
    if n % lanes:
        assert tile is None
        return
    mr, nr = tile
    nv = nr // lanes
    assert n % nr == 0 and 1 <= nv <= 6
    assert mr * nv + nv + 1 <= registers  # accumulators + B vectors + one broadcast
    assert m % mr == 0 or mr == min(8, (registers - nv - 1) // nv)
    if m % mr == 0:
        vectors = n // lanes
        widest = max(d for d in range(1, 7) if vectors % d == 0)
        # enough FMAs in flight where the output allows (tiny M: all its rows x the widest NV)
        assert mr * nv >= min(8, m * vectors, m * widest)


@pytest.mark.parametrize("lanes,m,n,want", [(8, 1, 1000, (1, 40)), (16, 1, 2048, (1, 64)), (8, 2, 1000, (2, 40)),
                                            (16, 1, 1280, (1, 80))])
def test_tiny_m_takes_all_rows_not_a_partial_8_row_tile(lanes, m, n, want):
    """Rule 4: a batch-1 classifier head (M = 1) gets an M-row tile; before, rule 3 gave it 8 rows
    with 7 predicated off in the k loop (3x slower than the M-row tile, measured)."""
    assert micro_tile(lanes, m, n, 32) == want


@pytest.mark.parametrize("target_name", list(TARGETS))
@pytest.mark.parametrize("m,k,n", [(1, 512, 1000), (1, 96, 2048), (3, 40, 136)], ids=["gemv-1000", "gemv-2048", "m3"])
def test_tiny_m_matmul_matches_ort(m, k, n, target_name):
    _check(_matmul_case(m, k, n), target_name, expect_prepacked=True)


def test_peak_kernels_compute_what_they_claim():
    """The FMA loop and the triad are measured for speed; they must also compute their formulas
    (an FMA loop that LLVM folded away would report an impossible peak)."""
    target = tvm.target.Target(detect_host_target())
    u, v, n = 8, 16, 37
    fma = tvm.compile(tvm.IRModule({"fma": _fma_func(u, v)}), target=target)["fma"]
    a = np.random.default_rng(0).random((u, v), dtype=np.float32)
    mc = np.array([[0.999] * v, [0.001] * v], np.float32)
    out = tvm.runtime.tensor(np.zeros((u, v), np.float32))
    fma(tvm.runtime.tensor(a), tvm.runtime.tensor(mc), out, n)
    want = a.copy()
    for _ in range(n):
        want = want * mc[0] + mc[1]
    np.testing.assert_allclose(out.numpy(), want, rtol=1e-5)
    triad = tvm.compile(tvm.IRModule({"triad": _triad_func(4 * v, v)}), target=target)["triad"]
    x, y = np.arange(4 * v, dtype=np.float32).reshape(4, v), np.ones((4, v), np.float32)
    c = tvm.runtime.tensor(np.zeros((4, v), np.float32))
    triad(tvm.runtime.tensor(x), tvm.runtime.tensor(y), c, 0.5)
    np.testing.assert_allclose(c.numpy(), x + 0.5 * y)


@pytest.mark.parametrize("target_name", list(TARGETS))
@pytest.mark.parametrize("cin,cout,hw,stride,batch", [(24, 32, 14, 1, 2), (16, 64, 9, 2, 1), (20, 48, 7, 1, 1),
                                                      (64, 128, 2, 1, 2), (32, 64, 4, 2, 1), (48, 64, 3, 1, 1),
                                                      (40, 24, 28, 1, 1)],
                         ids=["1x1", "1x1-stride2", "1x1-w7", "1x1-2x2map", "1x1-stride2-to-2x2", "1x1-3x3map",
                              "1x1-n24-w28"])
def test_pointwise_conv_on_gemm_kernel_matches_ort(cin, cout, hw, stride, batch, target_name):
    """A 1x1 convolution (NHWC after the layout phase) is a GEMM over (n, h) x w rows (on narrow
    maps over (n) x (h, w) rows: the 2x2 / 3x3 / stride-2 cases): it takes the packed kernel
    (weights packed at build time) with its bias + relu fused."""
    rng = np.random.default_rng(cin + cout)
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], strides=[stride, stride]),
             helper.make_node("Relu", ["c"], ["y"])]
    m = _model(nodes, [helper.make_tensor_value_info("x", F, [batch, cin, hw, hw])],
               [numpy_helper.from_array(_w(rng, cout, cin, 1, 1), "w"), numpy_helper.from_array(_w(rng, cout), "b")])
    _check(m, target_name, expect_prepacked=True)


def test_rows_fuse_only_for_narrow_pointwise_convs():
    """(h, w) become the GEMM's rows when that gives a tile with more FMAs per load: a 2x2 map
    (2-row tiles otherwise), not a 16-wide one, never a matrix product without unit reductions."""
    target = tvm.target.Target({"kind": "llvm", "mcpu": "znver4"})  # 16 lanes, 32 registers

    def fused(exts: list[int], ns: int):
        plan = _register_tile(target, exts, ns)
        return _fuse_rows(target, exts, ns, plan)

    got = fused([1, 2, 2, 2048, 1, 1, 512], 4)  # (n, h, w, co, kh, kw, ci)
    assert got is not None and got[1] == 4, got  # 4 pixels x 4 vectors
    assert fused([8, 16, 16, 256, 1, 1, 64], 4) is None  # 16-wide rows already get 4 x 4
    assert fused([1, 28, 28, 24, 1, 1, 144], 4) is None  # 8-row tiles would straddle 28-wide rows
    assert fused([4, 2, 2, 256, 64], 4) is None  # a batched matmul: its batch axes index B


def test_unpadded_pointwise_conv_reads_its_input_directly():
    """TOPI's conv2d_nhwc builds ``pad_temp`` even without padding: a copy of the whole input.
    The packed rule inlines it, so the kernel has no ``pad_temp`` block (and still matches ORT)."""
    rng = np.random.default_rng(5)
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"]), helper.make_node("Relu", ["c"], ["y"])]
    m = _model(nodes, [helper.make_tensor_value_info("x", F, [2, 24, 8, 8])],
               [numpy_helper.from_array(_w(rng, 32, 24, 1, 1), "w"), numpy_helper.from_array(_w(rng, 32), "b")])
    _check(m, "host", expect_prepacked=True)
    target = tvm.target.Target(detect_host_target())
    mod = run_pipeline(lower_program(m).mod, "scheduled", target)
    kernels = {gv.name_hint: f.script() for gv, f in mod.functions_items()
               if isinstance(f, tvm.tirx.PrimFunc) and gv.name_hint.endswith("_prepacked")}
    assert kernels and not any('T.sblock("pad_temp")' in body for body in kernels.values()), list(kernels)


def test_prepacked_weight_beside_a_scatter_with_reduction():
    # TOPI writes ScatterElements with a reduction (a MaxPool gradient in a training graph) as one
    # opaque block under the root, which TVM 0.27's SplitLayoutRewritePreproc refuses; the
    # pipeline must still pack the weight of the GEMM beside it (and build the scatter as is)
    rng = np.random.default_rng(11)
    idx = rng.integers(0, 48 * 64, size=(4096,)).astype(np.int64)  # repeated positions: the adds accumulate
    nodes = [helper.make_node("MatMul", ["x", "w"], ["mm"]), helper.make_node("Reshape", ["mm", "flat"], ["v"]),
             helper.make_node("ScatterElements", ["v", "idx", "u"], ["y"], axis=0, reduction="add")]
    m = _model(nodes, [helper.make_tensor_value_info("x", F, [48, 64]), helper.make_tensor_value_info("u", F, [4096])],
               [numpy_helper.from_array(_w(rng, 64, 64), "w"), numpy_helper.from_array(idx, "idx"),
                numpy_helper.from_array(np.array([-1], np.int64), "flat")])
    _check(m, "host", expect_prepacked=True)
