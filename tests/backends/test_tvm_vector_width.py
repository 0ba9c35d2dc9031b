"""The vector width the CPU schedules size their tiles by (backends/tvm/schedules/vector.py rule 1).

TVM 0.27's ``llvm_get_vector_width`` answers 512 bits for every x86 CPU, so before rule 1 an AVX2
target got AVX-512 tiles (16 lanes, 32 registers): the packed GEMM's 32 accumulators spilled to the
stack on every k step. These tests pin the width per target, check that an AVX2 build of the packed
GEMM keeps its accumulators in registers (no ymm stores to the stack in the kernel), and compare
AVX2 builds (``znver3``: run here, any x86-64 with AVX2) with ONNX Runtime (rtol 1e-4, atol 1e-5);
the ``znver4`` (AVX-512) build is compiled and its tile checked, run only where the CPU has AVX-512.
"""

from __future__ import annotations

import re

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
from backends.tvm.schedules import vector
from backends.tvm.schedules.gemm_packed import _register_tile
from backends.tvm.schedules.vector import vector_lanes
from tvm_build_check import ZNVER3, ZNVER4, host_has

F = TensorProto.FLOAT
RTOL, ATOL = 1e-4, 1e-5


@pytest.mark.parametrize("mcpu,lanes", [("znver3", 8), ("haswell", 8), ("znver4", 16),
                                        ("skylake-avx512", 16), ("core2", 4)])
def test_lanes_follow_the_cpu_features(mcpu, lanes):
    t = tvm.target.Target({"kind": "llvm", "mcpu": mcpu})
    assert vector_lanes(t, 32) == lanes
    assert vector_lanes(t, 16) == 2 * lanes


def test_knob_off_is_tvms_answer(monkeypatch):
    from tvm.target.codegen import llvm_get_vector_width

    t = tvm.target.Target(ZNVER3)
    monkeypatch.setattr(vector, "VECTOR_WIDTH_FROM_FEATURES", False)
    assert vector_lanes(t, 32) == int(llvm_get_vector_width(t)) // 32


def test_avx2_gemm_tile_fits_16_registers():
    lanes, mr, nr, _ = _register_tile(tvm.target.Target(ZNVER3), [512, 512, 512], 2)
    assert lanes == 8 and mr * (nr // lanes) + nr // lanes + 1 <= 16, (lanes, mr, nr)
    lanes, mr, nr, _ = _register_tile(tvm.target.Target(ZNVER4), [512, 512, 512], 2)
    assert (lanes, mr, nr) == (16, 4, 64)


def _model(nodes, inputs, inits) -> onnx.ModelProto:
    g = helper.make_graph(nodes, "case", inputs, [helper.make_tensor_value_info("y", F, None)], initializer=inits)
    return onnx.shape_inference.infer_shapes(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]))


def _gemm_gelu(m=512, k=128, n=128) -> onnx.ModelProto:
    rng = np.random.default_rng(1)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["mm"]), helper.make_node("Add", ["mm", "b"], ["a"]),
             helper.make_node("Relu", ["a"], ["y"])]
    inits = [numpy_helper.from_array((rng.standard_normal((k, n)) * 0.1).astype(np.float32), "w"),
             numpy_helper.from_array((rng.standard_normal(n) * 0.1).astype(np.float32), "b")]
    return _model(nodes, [helper.make_tensor_value_info("x", F, [m, k])], inits)


def _conv3x3() -> onnx.ModelProto:
    rng = np.random.default_rng(2)
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1]), helper.make_node("Relu", ["c"], ["y"])]
    inits = [numpy_helper.from_array((rng.standard_normal((64, 32, 3, 3)) * 0.1).astype(np.float32), "w"),
             numpy_helper.from_array((rng.standard_normal(64) * 0.1).astype(np.float32), "b")]
    return _model(nodes, [helper.make_tensor_value_info("x", F, [2, 32, 8, 8])], inits)


def _build(m: onnx.ModelProto, spec: dict):
    target = tvm.target.Target(spec)
    return tvm.compile(run_pipeline(lower_program(m).mod, "scheduled", target), target)


def _kernel_asm(ex) -> str:
    for lib in [ex.mod, *getattr(ex.mod, "imports", [])]:
        try:
            src = lib.inspect_source("s")
        except Exception:
            continue
        if "vfmadd" in src:
            return src
    raise AssertionError("no FMA code found")


def test_avx2_gemm_keeps_accumulators_in_registers():
    """Before rule 1 the znver3 kernel stored ymm accumulators to the stack 53 times."""
    asm = _kernel_asm(_build(_gemm_gelu(), ZNVER3))
    assert "zmm" not in asm
    spills = re.findall(r"vmovup[sd]\s+%ymm\d+, -?\d*\(%rsp\)", asm)
    assert len(spills) <= 2, spills


@pytest.mark.parametrize("spec", [ZNVER3, ZNVER4], ids=["znver3", "znver4"])
@pytest.mark.parametrize("case", [_gemm_gelu, _conv3x3], ids=["gemm-bias-relu", "conv3x3"])
def test_matches_onnxruntime(spec, case):
    m = case()
    ex = _build(m, spec)
    if spec is ZNVER4 and not host_has("avx512f"):
        pytest.skip("built for AVX-512; this CPU cannot run it")
    if spec is ZNVER3 and not host_has("avx2"):
        pytest.skip("built for AVX2; this CPU cannot run it")
    feeds = models_zoo.sample_inputs(m, 0)
    ref = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    res = relax.VirtualMachine(ex, tvm.cpu())["main"](*[tvm.runtime.tensor(feeds[v.name]) for v in m.graph.input])
    got = res.numpy() if isinstance(res, tvm.runtime.Tensor) else res[0].numpy()
    np.testing.assert_allclose(got, ref[0], rtol=RTOL, atol=ATOL)


def test_tall_tile_on_16_registers(monkeypatch):
    """gemm_packed.micro_tile rule 5: on a tie, 16 registers take the tile with more rows."""
    from backends.tvm.schedules import gemm_packed as GP

    assert GP.micro_tile(8, 512, 512, 16) == (4, 16)
    assert GP.micro_tile(8, 48, 64, 16) == (6, 16)
    assert GP.micro_tile(16, 512, 512, 32) == (4, 64)  # AVX-512 unchanged
    monkeypatch.setattr(GP, "TALL_TILE_16_REGISTERS", False)
    assert GP.micro_tile(8, 512, 512, 16) == (2, 32)
