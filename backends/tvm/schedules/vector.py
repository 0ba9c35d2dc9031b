"""Vector width and tile-size choices shared by the CPU schedule rules.

Rules:
1. The vector width of an x86 LLVM target comes from its CPU features: 512 bits with
   ``avx512f``, 256 with ``avx``, 128 with ``sse2`` (:func:`vector_bits`). Why: TVM 0.27's
   ``llvm_get_vector_width`` returns 512 for every x86 ``mcpu`` (checked: ``znver3``,
   ``haswell``, ``skylake``, ``x86-64``, ``core2`` and a bare ``llvm`` all gave 512), so on an
   AVX2 CPU every rule sized its tiles for 16 fp32 lanes and 32 registers: LLVM split each
   16-lane vector into two ymm registers and the GEMM's 4 x 4-vector tile became 32 ymm
   accumulators in a 16-register file, spilled to the stack on every k step (session 16,
   ``znver3``). Other targets (no such features: aarch64, ...) keep TVM's answer.
   ``VECTOR_WIDTH_FROM_FEATURES`` (env ``PARTITIONER_VECTOR_WIDTH_FROM_FEATURES=0``): off,
   TVM's answer everywhere. AVX-512 targets get 512 either way (the tables' ``znver4`` builds
   are unchanged).
"""

from __future__ import annotations

import functools
import os
from typing import Any

#: rule 1: x86 vector width from the target's CPU features; off: TVM's llvm_get_vector_width
VECTOR_WIDTH_FROM_FEATURES = os.environ.get("PARTITIONER_VECTOR_WIDTH_FROM_FEATURES", "1") != "0"
# (feature, bits), widest first
_X86_WIDTHS = (("avx512f", 512), ("avx", 256), ("sse2", 128))


_BITS: dict[tuple[str, bool], int] = {}


def _bits(target: Any, from_features: bool) -> int:
    import tvm
    from tvm.target.codegen import llvm_cpu_has_features, llvm_get_vector_width

    try:
        if target is not None and not isinstance(target, tvm.target.Target):
            target = tvm.target.Target(target)
        bits = int(llvm_get_vector_width(target))
        if target is None:  # TVM's current/host target: its answer, as before rule 1
            return bits if bits > 0 else 128
    except Exception:  # not an llvm target, or an LLVM without the query
        return 128
    if from_features:
        triple = str(target.attrs.get("mtriple", "")) or _host_triple()
        if triple.startswith(("x86_64", "i386", "i686", "x86")):
            for feature, width in _X86_WIDTHS:
                try:
                    if llvm_cpu_has_features(feature, target):
                        return width
                except Exception:
                    break
    return bits if bits > 0 else 128


@functools.lru_cache(maxsize=1)
def _host_triple() -> str:
    from tvm.target.codegen import llvm_get_system_triple

    try:
        return str(llvm_get_system_triple())
    except Exception:
        return ""


def vector_bits(target: Any) -> int:
    """SIMD register width in bits of ``target`` (rule 1; unknown: 128)."""
    try:
        key = (str(target), VECTOR_WIDTH_FROM_FEATURES)
    except Exception:
        return 128
    if key not in _BITS:
        _BITS[key] = _bits(target, VECTOR_WIDTH_FROM_FEATURES)
    return _BITS[key]


def vector_lanes(target: Any, dtype_bits: int = 32) -> int:
    """SIMD lanes for ``dtype_bits`` elements on ``target`` (AVX-512: 16 fp32, AVX2: 8; unknown: 4)."""
    return max(vector_bits(target) // dtype_bits, 1)


def largest_divisor(extent: int, candidates: tuple[int, ...]) -> int:
    """The first of ``candidates`` (largest first) that divides ``extent``; 1 if none does."""
    for c in candidates:
        if c <= extent and extent % c == 0:
            return c
    return 1


def const_extent(sch: Any, loop: Any) -> int | None:
    """A loop's extent as an int, or None when it is symbolic."""
    ext = sch.get(loop).extent
    try:
        return int(ext)
    except (TypeError, ValueError):
        return None
