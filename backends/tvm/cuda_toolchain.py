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
"""

from __future__ import annotations

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
