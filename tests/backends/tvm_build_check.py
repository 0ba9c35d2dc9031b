"""Shared by the schedule-rule tests: build a one-input ONNX model through the TVM backend's
scheduled pipeline, run it, and compare with ONNX Runtime (seeded input, rtol 1e-4, atol 1e-5)."""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import tvm
from tvm import relax

from backends.tvm import parallel_scope
from backends.tvm.lower import lower_program
from backends.tvm.pipeline import run_pipeline
from backends.tvm.target import detect_host_target

#: build targets for the AVX2 (16 vector registers) and AVX-512 (32) schedule rules
ZNVER3 = {"kind": "llvm", "mcpu": "znver3"}
ZNVER4 = {"kind": "llvm", "mcpu": "znver4"}
ZNVER5 = {"kind": "llvm", "mcpu": "znver5"}


def host_has(flag: str) -> bool:
    """Whether this CPU lists ``flag`` (e.g. "avx2", "avx512f") in /proc/cpuinfo, so a build for
    that ISA can run here."""
    try:
        return flag in open("/proc/cpuinfo").read().split()
    except OSError:
        return False


def host_runs_znver5() -> bool:
    """Whether this CPU runs a ``znver5`` build (AVX-512 with VP2INTERSECT and AVX-VNNI: Zen 5)."""
    return all(host_has(f) for f in ("avx512f", "avx512_vp2intersect", "avx512_bf16", "avx_vnni"))


def build_and_compare(m: onnx.ModelProto, target: Any = None) -> Any:
    """The scheduled Relax module of ``m`` for ``target`` (default: this host), after checking its
    output against ORT's."""
    x = np.random.default_rng(0).standard_normal(
        [d.dim_value for d in m.graph.input[0].type.tensor_type.shape.dim]).astype(np.float32)
    ref = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    target = target or tvm.target.Target(detect_host_target())
    mod = run_pipeline(lower_program(m).mod, "scheduled", target)
    res = relax.VirtualMachine(parallel_scope.compile(mod, target), tvm.cpu())["main"](tvm.runtime.tensor(x))
    got = (res if isinstance(res, tvm.runtime.Tensor) else res[0]).numpy()
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-5)
    return mod


def conv3x3_register_tile(mod: tvm.IRModule) -> list[int]:
    """Extents of the unrolled loops (pixels, channel vectors) around the 3x3 conv's update block
    of a scheduled module (the register tile the contraction rules chose), sorted."""
    from tvm import s_tir

    unrolled = int(tvm.tirx.ForKind.UNROLLED)
    for gv, f in mod.functions.items():
        if not isinstance(f, tvm.tirx.PrimFunc) or "conv2d" not in gv.name_hint:
            continue
        if "conv2d_nhwc_update" not in f.script():
            continue
        sch = s_tir.Schedule(f)
        loops = [sch.get(lp) for lp in sch.get_loops(sch.get_sblock("conv2d_nhwc_update"))]
        if sum(1 for lp in loops if int(lp.extent) == 3 and int(lp.kind) != unrolled) >= 2:  # ry, rx: the 3x3
            return sorted(int(lp.extent) for lp in loops if int(lp.kind) == unrolled)
    raise AssertionError("no 3x3 conv update block found")


def spy_returns(monkeypatch: Any, module: Any, name: str) -> list:
    """Replace ``module.name`` by a wrapper that records each return value (in call order)."""
    calls: list = []
    real = getattr(module, name)

    def spy(*args: Any, **kwargs: Any) -> Any:
        calls.append(real(*args, **kwargs))
        return calls[-1]

    monkeypatch.setattr(module, name, spy)
    return calls
