"""Epilogues that use the GEMM's result twice fold into the packed kernel's write-back.

``backends/tvm/schedules/contraction.py`` (:func:`inline_epilogue_chain`, used by the packed GEMM,
Contraction and Depthwise rules): exact GELU as
bert/gpt export it, ``y = x * (erf(x / sqrt 2) + 1) * 0.5`` with ``x = A @ W + b``, and SiLU,
``y = x * sigmoid(x)``. The result must match ONNX Runtime (seeded inputs, rtol 1e-4, atol
1e-5, host and AVX2 targets), and the scheduled kernel must hold no intermediate M x N buffer
(the epilogue computed on the accumulator tile, not in separate passes over memory). Without
the rule the GELU kernel kept four such buffers (divide, erf, add, multiply).
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import tvm
from onnx import TensorProto, helper, numpy_helper

from backends.tvm.target import detect_host_target
from tvm_build_check import build_and_compare

F = TensorProto.FLOAT
TARGETS = {"host": None, "avx2": {"kind": "llvm", "mcpu": "haswell"}}


def _gemm_with(act: str, m: int, k: int, n: int, lead: tuple[int, ...]) -> onnx.ModelProto:
    rng = np.random.default_rng(m + 7 * k + 13 * n)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["mm"]), helper.make_node("Add", ["mm", "b"], ["h"])]
    inits = [numpy_helper.from_array((rng.standard_normal((k, n)) * 0.2).astype(np.float32), "w"),
             numpy_helper.from_array((rng.standard_normal(n) * 0.2).astype(np.float32), "b")]
    if act == "gelu":  # the erf form of the zoo's bert/gpt fc1
        inits += [numpy_helper.from_array(np.array(np.sqrt(2.0), np.float32), "sqrt2"),
                  numpy_helper.from_array(np.array(1.0, np.float32), "one"),
                  numpy_helper.from_array(np.array(0.5, np.float32), "half")]
        nodes += [helper.make_node("Div", ["h", "sqrt2"], ["d"]), helper.make_node("Erf", ["d"], ["e"]),
                  helper.make_node("Add", ["e", "one"], ["e1"]), helper.make_node("Mul", ["h", "e1"], ["g"]),
                  helper.make_node("Mul", ["g", "half"], ["y"])]
    else:  # silu
        nodes += [helper.make_node("Sigmoid", ["h"], ["s"]), helper.make_node("Mul", ["h", "s"], ["y"])]
    g = helper.make_graph(nodes, act, [helper.make_tensor_value_info("x", F, [*lead, m, k])],
                          [helper.make_tensor_value_info("y", F, None)], initializer=inits)
    return onnx.shape_inference.infer_shapes(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]))


@pytest.mark.parametrize("target_name", list(TARGETS))
@pytest.mark.parametrize("act,m,k,n,lead", [("gelu", 64, 128, 512, (2,)), ("gelu", 37, 40, 64, ()),
                                            ("silu", 48, 64, 96, ())],
                         ids=["gelu-bert-fc1", "gelu-odd-mk", "silu"])
def test_two_use_epilogue_is_fused_and_matches_ort(act, m, k, n, lead, target_name):
    model = _gemm_with(act, m, k, n, lead)
    spec = TARGETS[target_name]
    target = tvm.target.Target(spec if spec is not None else detect_host_target())
    mod = build_and_compare(model, target)
    kernels = {gv.name_hint: f.script() for gv, f in mod.functions_items()
               if isinstance(f, tvm.tirx.PrimFunc) and gv.name_hint.endswith("_prepacked")}
    assert len(kernels) == 1, list(kernels)
    body = next(iter(kernels.values()))
    # the only buffer the kernel allocates is its accumulator tile ("local"), besides A packed into
    # 6-row panels on AVX2 (gemm_packed.micro_tile rule 6: shape (.., M / 6, K, 6)); an unfused
    # epilogue allocates global M x N intermediates (T_divide, T_fast_erf, ...)
    allocs = [line for line in body.splitlines() if "sblock_alloc_buffer" in line and "T.int64(6)))" not in line]
    assert allocs and all('scope="local"' in line for line in allocs), allocs


def _conv_with(act: str, depthwise: bool) -> onnx.ModelProto:
    rng = np.random.default_rng(3 if depthwise else 4)
    c_in, c_out = (32, 32) if depthwise else (16, 48)
    w = (rng.standard_normal((c_out, 1 if depthwise else c_in, 3, 3)) * 0.2).astype(np.float32)
    inits = [numpy_helper.from_array(w, "w"), numpy_helper.from_array((rng.standard_normal(c_out) * 0.2).astype(np.float32), "b")]
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["h"], pads=[1, 1, 1, 1], group=c_in if depthwise else 1)]
    if act == "hardswish":  # x * clip(x + 3, 0, 6) / 6, as PP-LCNet / MobileNetV3 exports write it
        inits += [numpy_helper.from_array(np.array(v, np.float32), n) for v, n in
                  ((3.0, "three"), (0.0, "zero"), (6.0, "six"))]
        nodes += [helper.make_node("Add", ["h", "three"], ["h3"]), helper.make_node("Clip", ["h3", "zero", "six"], ["r"]),
                  helper.make_node("Mul", ["h", "r"], ["hr"]), helper.make_node("Div", ["hr", "six"], ["y"])]
    else:
        nodes += [helper.make_node("Sigmoid", ["h"], ["s"]), helper.make_node("Mul", ["h", "s"], ["y"])]
    g = helper.make_graph(nodes, act, [helper.make_tensor_value_info("x", F, [2, c_in, 12, 12])],
                          [helper.make_tensor_value_info("y", F, None)], initializer=inits)
    return onnx.shape_inference.infer_shapes(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]))


@pytest.mark.parametrize("act,depthwise", [("silu", False), ("hardswish", True), ("silu", True)],
                         ids=["conv3x3-silu", "depthwise-hardswish", "depthwise-silu"])
def test_two_use_epilogue_of_a_conv_is_fused_and_matches_ort(act, depthwise):
    """The same folding for the Contraction (3x3 conv) and Depthwise rules: no intermediate
    buffer of the output's shape is left in the conv kernel."""
    model = _conv_with(act, depthwise)
    mod = build_and_compare(model)
    convs = [f.script() for gv, f in mod.functions_items()
             if isinstance(f, tvm.tirx.PrimFunc) and "conv2d" in gv.name_hint and "weight_prepack" not in gv.name_hint]
    assert convs, [gv.name_hint for gv, _ in mod.functions_items()]
    out_shape = f"(T.int64(2), T.int64(12), T.int64(12), T.int64({model.graph.initializer[0].dims[0]}))"
    for body in convs:
        # the depthwise rule's stride-1 accumulators are global scope so that TVM puts their one
        # register tile on the stack (depthwise.TILE_INPUT): the conv's own, not an epilogue's
        left = [ln for ln in body.splitlines() if "sblock_alloc_buffer" in ln and out_shape in ln
                and 'scope="local"' not in ln and not ln.strip().startswith("group_conv2d_nhwc_intermediate_global =")]
        assert not left, left
