"""Parallel chunks with no-alias pointers, accumulators on the stack (backends/tvm/parallel_scope.py).

Rule 1: the pass wraps the body of each outermost parallel loop in a ``compute_scope`` (and leaves a
parallel loop nested in another, or an already wrapped one, alone). Built with it, the LLVM
module of a conv model (3x3 conv + ReLU, depthwise 3x3) and of a GEMM model (MatMul + Softmax),
built for 2 threads so their kernels have parallel loops, has (``NOALIAS_PARALLEL_BODY`` on; it
is off by default, measured no gain once rule 2 holds) one ``*_par_body*`` function per
wrapped loop whose pointer arguments are all ``noalias``, and the model's output still matches
ONNX Runtime (seeded input, rtol 1e-4, atol 1e-5, ``build_and_compare``). With
``NOALIAS_PARALLEL_BODY`` off there is no such function (the knob is what adds them), and
``backends.tvm.build.build`` writes a library without them.

Rule 2: a small constant-size "local" buffer gets the stack annotation (a large one does not);
built for 1 and for 2 threads, the conv and GEMM models' LLVM modules allocate no "local" buffer
through ``TVMBackendAllocWorkspace`` (with ``LOCALS_ON_STACK`` off the conv's accumulator tile
is such a call), and their outputs match ONNX Runtime.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import tvm

from backends.tvm import parallel_scope
from backends.tvm.schedules import contraction as C
from backends.tvm.schedules import threads
from backends.tvm.target import detect_host_target
from tests.backends.test_tvm_serial_build import conv_model, gemm_model
from tests.backends.tvm_build_check import build_and_compare


def _two_loops() -> tvm.tirx.PrimFunc:
    from tvm.script import tirx as T

    @T.prim_func
    def f(a: T.Buffer((64, 16), "float32"), b: T.Buffer((64, 16), "float32")):
        for i in T.parallel(64):
            for j in range(16):
                b[i, j] = a[i, j] * T.float32(2)
        for i in T.parallel(4):
            for k in T.parallel(16):
                b[i, k] = a[i, k]

    return f


def _locals() -> tvm.tirx.PrimFunc:
    from tvm.script import tirx as T

    @T.prim_func
    def f(a: T.Buffer((64, 16), "float32"), b: T.Buffer((64, 16), "float32")):
        for i in T.parallel(64):
            acc = T.alloc_buffer((16,), "float32", scope="local")
            big = T.alloc_buffer((8192,), "float32", scope="local")
            for j in range(16):
                acc[j] = a[i, j]
                big[j] = acc[j]
            for j in range(16):
                b[i, j] = big[j]

    return f


def test_small_locals_marked_for_the_stack() -> None:
    g = parallel_scope.locals_on_stack(_locals())
    marked = re.findall(r'(\w+) = T\.alloc_local\(.*annotations=\{"disable_lower_builtin": 1\}', g.script())
    assert marked == ["acc"], g.script()  # 64 B yes, 32 KiB > LOCAL_STACK_MAX_BYTES no
    assert "disable_lower_builtin" not in _locals().script()


def _scopes(func: tvm.tirx.PrimFunc) -> list[str]:
    return re.findall(r'T\.attr\(0, "compute_scope", "([^"]+)"\)', func.script())


def test_pass_wraps_outermost_parallel_bodies() -> None:
    f = _two_loops()
    g = parallel_scope.wrap_parallel_bodies(f, "f")
    assert _scopes(f) == []
    assert _scopes(g) == ["f_par_body0"]  # the nested parallel pair is left alone
    assert parallel_scope.wrap_parallel_bodies(g, "f").same_as(g)  # idempotent


def _llvm_ir(mod: tvm.IRModule) -> str:
    target = tvm.target.Target(detect_host_target())
    lib = parallel_scope.compile(mod, target).mod
    return next(src for m in [lib, *lib.imports] for src in [m.inspect_source("ll")] if "define" in src)


def _par_bodies(ll: str) -> list[str]:
    return [line for line in ll.splitlines() if line.startswith("define") and "_par_body" in line]


@pytest.mark.parametrize("make", [conv_model, gemm_model], ids=["conv", "gemm"])
def test_parallel_bodies_get_noalias_pointers(make, monkeypatch) -> None:
    monkeypatch.delenv(threads.ENV, raising=False)
    monkeypatch.setattr(parallel_scope, "NOALIAS_PARALLEL_BODY", True)
    with threads.building_for(2):
        mod = build_and_compare(make())  # with the pass: still matches ORT
    ll = _llvm_ir(mod)
    bodies = _par_bodies(ll)
    assert bodies, "no parallel body function"
    assert len(bodies) == len(re.findall(r"^define .*@__tvm_parallel_lambda", ll, re.M))  # one per loop
    for line in bodies:
        pointers = re.findall(r"(?:\(|, )(ptr [^%]*)%", line)
        assert pointers and all("noalias" in p for p in pointers), line
    monkeypatch.setattr(parallel_scope, "NOALIAS_PARALLEL_BODY", False)
    assert _par_bodies(_llvm_ir(mod)) == []
    monkeypatch.setattr(parallel_scope, "LOCALS_ON_STACK", False)
    assert parallel_scope.tir_pipeline(tvm.target.Target(detect_host_target())) == "default"


def _workspace_locals(ll: str) -> list[str]:
    return re.findall(r"%([\w.]*local[\w.]*) = (?:tail )?call ptr", ll)


@pytest.mark.parametrize("make", [conv_model, gemm_model], ids=["conv", "gemm"])
@pytest.mark.parametrize("n", [1, 2])
def test_locals_not_in_workspace(make, n: int, monkeypatch) -> None:
    monkeypatch.delenv(threads.ENV, raising=False)
    # Not a border-split conv (contraction.SPLIT_PAD_BORDER): there the accumulator stays a whole-map
    # "local" buffer, in the workspace (seen in session 17, already so on main for 16 -> 16 on 64x64);
    # on AVX2, contraction rule 1's 4-pixel tile gives this 32x32 conv the 8 column tiles that rule needs.
    monkeypatch.setattr(C, "SPLIT_PAD_BORDER", False)
    with threads.building_for(n):
        mod = build_and_compare(make())  # with both rules: still matches ORT
    assert _workspace_locals(_llvm_ir(mod)) == []
    if make is conv_model:
        monkeypatch.setattr(parallel_scope, "LOCALS_ON_STACK", False)
        assert _workspace_locals(_llvm_ir(mod)), "the conv's accumulator tile was expected in the workspace"


def test_build_library_has_parallel_bodies(tmp_path: Path, monkeypatch) -> None:
    from backends.tvm.build import build

    monkeypatch.delenv(threads.ENV, raising=False)
    monkeypatch.setattr(parallel_scope, "NOALIAS_PARALLEL_BODY", True)
    build(gemm_model(), tmp_path / "on.so", options={"threads": 2})
    monkeypatch.setattr(parallel_scope, "NOALIAS_PARALLEL_BODY", False)
    build(gemm_model(), tmp_path / "off.so", options={"threads": 2})
    assert b"_par_body" in (tmp_path / "on.so").read_bytes()
    assert b"_par_body" not in (tmp_path / "off.so").read_bytes()
