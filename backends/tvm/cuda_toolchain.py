"""The CUDA toolchain a GPU build needs, and nothing more: NVRTC through ``cuda.bindings``.

Rules:
1. Compiling for a GPU needs no GPU (DESIGN.md, "CUDA without a GPU"): TVM 0.27 compiles the
   generated CUDA C with NVRTC (its default, ``TVM_CUDA_COMPILE_MODE=nvrtc``) into a cubin for the
   target's ``arch``, through the ``cuda-bindings`` package; ``libnvrtc`` comes from the
   ``nvidia-cuda-nvrtc-cu12`` wheel. Both are the optional extra ``cuda`` of this package.
2. :func:`require_cuda_toolchain` checks both before a build starts and raises one
   :class:`BackendError` naming ``pip install .[cuda]`` when either is missing, instead of
   TVM's traceback from deep inside code generation.
3. The check does not import TVM and does not look for a GPU.
4. TVM 0.27 keeps each GPU library's CUDA *source* (``__global__`` functions, no cubin: checked
   on the zoo bert for sm_90) and compiles it when the library loads, through the global function
   ``tvm_callback_cuda_compile``, which ``tvm.support.nvcc`` registers. So the machine that runs
   a GPU artifact needs NVRTC too (not the GPU build's toolkit: any NVRTC of the driver's CUDA
   major). That callback takes the arch from ``Target.current()``, which a runtime-only TVM
   lacks ("tvm.target._ffi_api has no attribute TargetCurrent", seen on an H200 on 2026-12-04):
   :func:`register_load_time_compiler` registers ours, which compiles for the arch it is given
   (the GPU the rank runs on).
"""

from __future__ import annotations

from typing import Any

from partitioner.core.errors import BackendError

INSTALL_HINT = "pip install .[cuda]  (cuda-bindings<13 and nvidia-cuda-nvrtc-cu12)"


def toolchain_problem() -> str | None:
    """Why a CUDA build cannot run here (one phrase), or None when NVRTC is usable."""
    try:
        from cuda.bindings import nvrtc  # noqa: F401 - the import is the check
    except ImportError:
        return "the cuda-bindings package is not installed"
    try:
        err, major, minor = nvrtc.nvrtcVersion()  # loads libnvrtc (via cuda-pathfinder)
    except Exception as e:  # noqa: BLE001 - a missing shared library surfaces as any error type
        return f"libnvrtc cannot be loaded ({str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__})"
    if int(err) != 0:
        return f"nvrtcVersion failed ({err})"
    return None


def nvrtc_version() -> str | None:
    """``"12.9"`` when NVRTC loads, else None (for the manifest's toolchain facts)."""
    if toolchain_problem() is not None:
        return None
    from cuda.bindings import nvrtc

    _, major, minor = nvrtc.nvrtcVersion()
    return f"{major}.{minor}"


def require_cuda_toolchain() -> None:
    """Raise BackendError (one line, naming the extra) when a CUDA build cannot run here."""
    problem = toolchain_problem()
    if problem is not None:
        raise BackendError(f"compiling for a CUDA target needs NVRTC: {problem}; install it with {INSTALL_HINT}")


CUDA_COMPILE_CALLBACK = "tvm_callback_cuda_compile"


def register_load_time_compiler(arch: str) -> None:
    """Rule 4: libraries loaded from now on compile their CUDA C with NVRTC to a cubin for ``arch``."""
    import tvm_ffi
    from tvm.support import nvcc  # its import registers TVM's callback: ours replaces it

    def compile_cubin(code: str, *_: Any) -> bytearray:
        return nvcc.compile_cuda(code, target_format="cubin", arch=arch, compiler="nvrtc")

    tvm_ffi.register_global_func(CUDA_COMPILE_CALLBACK, compile_cubin, override=True)
