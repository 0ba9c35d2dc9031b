"""GEMMs whose N no vector width divides take the packed kernel with N padded.

``backends/tvm/schedules/gemm_packed.py`` (:func:`_padded_n`, ``PAD_N``): B is packed with zero
columns up to the padded N (at build time for a constant weight), the register tile computes the
padded columns, and only the real ones are written. Each case is compared with ONNX Runtime on
seeded inputs (rtol 1e-4, atol 1e-5) for the host and an AVX2 target, and the constant-weight
cases must build a ``*_prepacked`` kernel (without the rule they went to the Contraction rule,
which has no packed weights: those assertions fail with ``PAD_N = False``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import tvm
from onnx import TensorProto, helper, numpy_helper
from tvm import relax

import models_zoo
from backends.tvm.lower import lower_program
from backends.tvm.pipeline import run_pipeline
from backends.tvm.schedules.gemm_packed import _padded_n
from backends.tvm.target import detect_host_target

F = TensorProto.FLOAT
RTOL, ATOL = 1e-4, 1e-5
TARGETS = {"host": None, "avx2": {"kind": "llvm", "mcpu": "haswell"}}


def _build_and_check(m: onnx.ModelProto, target_name: str, expect_prepacked: bool) -> Any:
    spec = TARGETS[target_name]
    target = tvm.target.Target(spec if spec is not None else detect_host_target())
    feeds = models_zoo.sample_inputs(m, 0)
    ref = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    mod = run_pipeline(lower_program(m).mod, "scheduled", target)
    names = [gv.name_hint for gv, f in mod.functions_items() if isinstance(f, tvm.tirx.PrimFunc)]
    vm = relax.VirtualMachine(tvm.compile(mod, target), tvm.cpu())
    res = vm["main"](*[tvm.runtime.tensor(feeds[v.name]) for v in m.graph.input])
    got = res.numpy() if isinstance(res, tvm.runtime.Tensor) else res[0].numpy()
    assert got.shape == ref.shape
    np.testing.assert_allclose(got, ref, rtol=RTOL, atol=ATOL)
    if expect_prepacked:
        assert any(n.endswith("_prepacked") for n in names), f"weight not packed at build time: {names}"
    return mod


def _model(nodes, inputs, inits=()) -> onnx.ModelProto:
    g = helper.make_graph(nodes, "pad_n", inputs, [helper.make_tensor_value_info("y", F, None)], initializer=list(inits))
    return onnx.shape_inference.infer_shapes(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]))


def _w(rng, *shape):
    return (rng.standard_normal(shape) * 0.2).astype(np.float32)


@pytest.mark.parametrize("target_name", list(TARGETS))
@pytest.mark.parametrize("m,k,n,lead", [(64, 96, 1002, ()), (40, 37, 113, ()), (24, 64, 10, ()), (16, 48, 50, (3,)),
                                        (1, 640, 100, ()), (1, 200, 48, ())],
                         ids=["n1002", "n113-odd-mk", "n10", "n50-3d", "gemv-n100", "gemv-n48"])
def test_matmul_with_odd_n_is_packed_and_matches_ort(m, k, n, lead, target_name):
    rng = np.random.default_rng(n)
    model = _model([helper.make_node("MatMul", ["x", "w"], ["y"])], [helper.make_tensor_value_info("x", F, [*lead, m, k])],
                   [numpy_helper.from_array(_w(rng, k, n), "w")])
    _build_and_check(model, target_name, expect_prepacked=True)


@pytest.mark.parametrize("target_name", list(TARGETS))
def test_gemm_transb_bias_gelu_with_odd_n(target_name):
    # a classifier head as exported (Gemm, transB = 1, bias) with an epilogue on the padded tile
    rng = np.random.default_rng(3)
    n, k = 210, 64
    inits = [numpy_helper.from_array(_w(rng, n, k), "w"), numpy_helper.from_array(_w(rng, n), "b"),
             numpy_helper.from_array(np.array(np.sqrt(2.0), np.float32), "s2"),
             numpy_helper.from_array(np.array(1.0, np.float32), "one")]
    nodes = [helper.make_node("Gemm", ["x", "w", "b"], ["h"], transB=1), helper.make_node("Div", ["h", "s2"], ["d"]),
             helper.make_node("Erf", ["d"], ["e"]), helper.make_node("Add", ["e", "one"], ["e1"]),
             helper.make_node("Mul", ["h", "e1"], ["y"])]
    _build_and_check(_model(nodes, [helper.make_tensor_value_info("x", F, [33, k])], inits), target_name, True)


@pytest.mark.parametrize("target_name", list(TARGETS))
def test_batched_activation_matmul_with_odd_n(target_name):
    # both operands activations (attention-like, N = 20): B padded per call
    nodes = [helper.make_node("MatMul", ["p", "v"], ["y"])]
    model = _model(nodes, [helper.make_tensor_value_info("p", F, [2, 3, 24, 20]),
                           helper.make_tensor_value_info("v", F, [2, 3, 20, 20])])
    mod = _build_and_check(model, target_name, expect_prepacked=False)
    # the packed kernel with its padded output tile (pad_einsum: matmul_pad), not the Contraction rule
    assert any("matmul_pad" in f.script() for _, f in mod.functions_items() if isinstance(f, tvm.tirx.PrimFunc))


@pytest.mark.parametrize("lanes", [8, 16])
@pytest.mark.parametrize("n", [10, 20, 50, 113, 210, 1002, 8210])
def test_padded_n_rule(lanes, n):
    n_pad = _padded_n(lanes, n)
    step = lanes // 2 if lanes >= 16 else lanes
    assert n_pad >= n and n_pad % step == 0 and n_pad - n < 4 * lanes
    if n >= 16 * 4 * lanes:  # large N: whole 4-vector panels, at most N/16 wasted
        assert n_pad % (4 * lanes) == 0 and (n_pad - n) * 16 <= n


@pytest.mark.parametrize("target_name", list(TARGETS))
@pytest.mark.parametrize("cout,hw,stride", [(255, 10, 1), (21, 2, 1), (100, 9, 2)],
                         ids=["yolo-head-255", "21-on-2x2", "100-stride2"])
def test_pointwise_conv_with_odd_channels_is_packed(cout, hw, stride, target_name):
    """A 1x1 convolution is a GEMM with N = output channels: a detector head's 255 channels
    (3 x (80 + 5)), 21 or 100 classes take the padded packed kernel (input read through a
    reindexed copy for pad_einsum, inlined back), bias + sigmoid fused."""
    rng = np.random.default_rng(cout)
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], strides=[stride, stride]),
             helper.make_node("Sigmoid", ["c"], ["y"])]
    model = _model(nodes, [helper.make_tensor_value_info("x", F, [2, 32, hw, hw])],
                   [numpy_helper.from_array(_w(rng, cout, 32, 1, 1), "w"),
                    numpy_helper.from_array(_w(rng, cout), "b")])
    _build_and_check(model, target_name, expect_prepacked=True)
