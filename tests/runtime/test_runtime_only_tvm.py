"""Artifacts run on a runtime-only TVM (no ``libtvm_compiler``): what a deployment, or a lent GPU
machine with no TVM wheel (benchmarks/device_bundle.py), has.

- Loading an artifact imports neither our CPU schedules nor TVM's compiler side (dlight, ``tvm.relax``):
  a 2-rank CPU artifact runs with ``TVM_USE_RUNTIME_LIB=1`` and matches ONNX Runtime.
- GPU libraries hold CUDA C, compiled as they load (``backends/tvm/cuda_toolchain.py`` rule 4):
  the callback we register compiles for the arch it was given, not ``Target.current()``.
- The device bundle's TVM leaves the compiler library out.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
from pathlib import Path

import onnx
import pytest

import models_zoo

ROOT = Path(__file__).resolve().parents[2]


def test_cpu_artifact_runs_on_a_runtime_only_tvm(tmp_path: Path) -> None:
    onnx.save(models_zoo.build("mlp", batch=2), tmp_path / "mlp.onnx")
    cli = [sys.executable, "-m", "partitioner.cli"]
    r = subprocess.run([*cli, "compile", str(tmp_path / "mlp.onnx"), "-o", str(tmp_path / "a"), "--devices",
                        "2", "--strategy", "tensor", "--jobs", "1"], capture_output=True, text=True, cwd=ROOT,
                       timeout=600)
    assert r.returncode == 0, r.stderr
    env = {**os.environ, "TVM_USE_RUNTIME_LIB": "1"}
    r = subprocess.run([*cli, "run", str(tmp_path / "a"), "--check"], capture_output=True, text=True,
                       cwd=ROOT, timeout=600, env=env)
    assert r.returncode == 0, r.stderr
    assert "check logits:" in r.stdout and r.stdout.count(" ok") >= 1, r.stdout


def test_loading_imports_no_compiler_module() -> None:
    code = ("import sys, tvm; from backends.tvm.executable import TvmRankExecutable, load_device_runtimes; "
            "load_device_runtimes(); "
            "bad = sorted(m for m in sys.modules if m.startswith(('tvm.s_tir', 'tvm.relax', "
            "'backends.tvm.schedules.contraction'))); "
            "print(tvm._RUNTIME_ONLY, bad)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300,
                       env={**os.environ, "TVM_USE_RUNTIME_LIB": "1"})
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "True []"


def test_load_time_compiler_uses_the_given_arch(monkeypatch) -> None:
    import tvm_ffi
    from tvm.support import nvcc

    from backends.tvm.cuda_toolchain import CUDA_COMPILE_CALLBACK, register_load_time_compiler

    seen = []
    monkeypatch.setattr(nvcc, "compile_cuda",
                        lambda code, **kw: seen.append((code, kw)) or bytearray(b"CUBIN"))
    previous = tvm_ffi.get_global_func(CUDA_COMPILE_CALLBACK, allow_missing=True)
    try:
        register_load_time_compiler("sm_90")
        out = tvm_ffi.get_global_func(CUDA_COMPILE_CALLBACK)("__global__ void k() {}")
    finally:
        if previous is not None:
            tvm_ffi.register_global_func(CUDA_COMPILE_CALLBACK, previous, override=True)
    assert bytes(out) == b"CUBIN"
    assert seen == [("__global__ void k() {}",
                     {"target_format": "cubin", "arch": "sm_90", "compiler": "nvrtc"})]


@pytest.mark.timeout(300)
def test_device_bundle_tvm_has_no_compiler_library(tmp_path: Path) -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import device_bundle
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    out = tmp_path / "tvm.tar.xz"
    device_bundle.tvm_runtime_tar(out)
    with tarfile.open(out) as tar:
        names = tar.getnames()
    assert "tvm/lib/libtvm_runtime.so" in names and "tvm/runtime/vm.py" in names
    assert any(n.startswith("apache_tvm-") and n.endswith("dist-info") for n in names)
    assert not [n for n in names if "libtvm_compiler" in n or "__pycache__" in n or "3rdparty" in n]
    assert out.stat().st_size < 8 * 2**20
