"""Epilogues that use the GEMM's result twice fold into the packed kernel's write-back.

``backends/tvm/schedules/gemm_packed.py`` (:func:`_inline_epilogue_chain`): exact GELU as
bert/gpt export it, ``y = x * (erf(x / sqrt 2) + 1) * 0.5`` with ``x = A @ W + b``, and SiLU,
``y = x * sigmoid(x)``. The result must match ONNX Runtime (seeded inputs, rtol 1e-4, atol
1e-5, host and AVX2 targets), and the scheduled kernel must hold no intermediate M x N buffer
(the epilogue computed on the accumulator tile, not in separate passes over memory). Without
the rule the GELU kernel kept four such buffers (divide, erf, add, multiply).
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
from backends.tvm.pipeline import run_pipeline
from backends.tvm.target import detect_host_target

F = TensorProto.FLOAT
RTOL, ATOL = 1e-4, 1e-5
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
    feeds = models_zoo.sample_inputs(model, 0)
    ref = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    mod = run_pipeline(lower_program(model).mod, "scheduled", target)
    res = relax.VirtualMachine(tvm.compile(mod, target), tvm.cpu())["main"](tvm.runtime.tensor(feeds["x"]))
    got = res.numpy() if isinstance(res, tvm.runtime.Tensor) else res[0].numpy()
    np.testing.assert_allclose(got, ref, rtol=RTOL, atol=ATOL)
    kernels = {gv.name_hint: f.script() for gv, f in mod.functions_items()
               if isinstance(f, tvm.tirx.PrimFunc) and gv.name_hint.endswith("_prepacked")}
    assert len(kernels) == 1, list(kernels)
    body = next(iter(kernels.values()))
    # the only buffer the kernel allocates is its accumulator tile ("local"); an unfused epilogue
    # allocates global M x N intermediates (T_divide, T_fast_erf, ...)
    allocs = [line for line in body.splitlines() if "sblock_alloc_buffer" in line]
    assert allocs and all('scope="local"' in line for line in allocs), allocs
