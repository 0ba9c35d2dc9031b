"""Vector width and tile-size choices shared by the CPU schedule rules."""

from __future__ import annotations

from typing import Any


def vector_lanes(target: Any, dtype_bits: int = 32) -> int:
    """SIMD lanes for ``dtype_bits`` elements on ``target`` (AVX-512: 16 fp32; unknown: 4)."""
    from tvm.target.codegen import llvm_get_vector_width

    try:
        bits = int(llvm_get_vector_width(target))
    except Exception:  # not an llvm target, or an LLVM without the query
        bits = 128
    if bits <= 0:
        bits = 128
    return max(bits // dtype_bits, 1)


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
