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
2. The FMA datapath width (:func:`fma_datapath_bits`): how wide one FMA unit really is, which
   the register-tile rules need beside the vector width. AVX-512 Intel cores (Skylake-SP, Ice
   Lake, Sapphire Rapids; this session's host, which LLVM names ``rocketlake``) execute a 512-bit
   FMA in one unit, two of them per core: a 4-cycle latency x 2 ports wants at least 8
   independent 512-bit accumulators in flight, and every weight vector load competes with the
   broadcasts for the two load ports each cycle. AMD Zen 4 (``znver4``) executes 512-bit
   instructions on two 256-bit pipes (:data:`HALF_WIDTH_AVX512_CPUS`), half the throughput per
   instruction, so the same tile leaves it twice the slack. Keyed on the target's ``mcpu``
   (the one property LLVM's feature list does not give); an AVX-512 CPU this table does not name
   counts as full width. ``PARTITIONER_FULL_WIDTH_FMA=0`` answers "not full width" everywhere
   (the contraction rules 3-4 that read it then keep their older tiles).
3. Per-CPU settings (:func:`by_cpu`): a rule whose measured best value differs on one CPU keeps
   a table keyed by LLVM ``mcpu`` beside its general value (``contraction.NARROW_MIN_VECTORS``,
   ``gemm_packed.PACK_A_32_BY_CPU``, ``gemm_packed.ROWS_OUTER_B_BYTES_BY_CPU``: Zen 5, session
   28). ``PARTITIONER_SCHEDULE_BY_CPU=0`` (:data:`SCHEDULE_BY_CPU`) ignores every such table, so
   a paired run can build the general rules on that CPU in a subprocess (MPI ranks, compile
   workers) where a module attribute set in the parent does not reach.
"""

from __future__ import annotations

import functools
import os
from typing import Any

#: rule 1: x86 vector width from the target's CPU features; off: TVM's llvm_get_vector_width
VECTOR_WIDTH_FROM_FEATURES = os.environ.get("PARTITIONER_VECTOR_WIDTH_FROM_FEATURES", "1") != "0"
# (feature, bits), widest first
_X86_WIDTHS = (("avx512f", 512), ("avx", 256), ("sse2", 128))


#: rule 2: AVX-512 CPUs whose 512-bit FMAs run on two 256-bit pipes (double-pumped)
HALF_WIDTH_AVX512_CPUS = frozenset({"znver4"})
#: rule 2: off: :func:`full_width_fma` answers False on every target
FULL_WIDTH_FMA = os.environ.get("PARTITIONER_FULL_WIDTH_FMA", "1") != "0"

#: rule 3: off (env ``PARTITIONER_SCHEDULE_BY_CPU=0``): every per-CPU table ignored
SCHEDULE_BY_CPU = os.environ.get("PARTITIONER_SCHEDULE_BY_CPU", "1") != "0"

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


def mcpu(target: Any) -> str:
    """The target's LLVM ``mcpu`` (a Target or a plain dict target; '' when it names none)."""
    if isinstance(target, dict):
        return str(target.get("mcpu", ""))
    try:
        return str(target.attrs.get("mcpu", ""))
    except Exception:
        return ""


def by_cpu(table: dict[str, Any], target: Any, default: Any) -> Any:
    """Rule 3: ``table``'s value for the target's ``mcpu``, else ``default`` (always ``default``
    when :data:`SCHEDULE_BY_CPU` is off or there is no target)."""
    if not SCHEDULE_BY_CPU or target is None:
        return default
    return table.get(mcpu(target), default)


def fma_datapath_bits(target: Any) -> int:
    """Width in bits of one FMA unit of ``target`` (rule 2): the vector width, except 256 on
    the AVX-512 CPUs of :data:`HALF_WIDTH_AVX512_CPUS`."""
    bits = vector_bits(target)
    if bits >= 512 and mcpu(target) in HALF_WIDTH_AVX512_CPUS:
        return 256
    return bits


def full_width_fma(target: Any) -> bool:
    """True on a 512-bit-vector target whose FMA units are 512 bits wide (rule 2; Intel AVX-512
    server cores), and :data:`FULL_WIDTH_FMA` holds."""
    return FULL_WIDTH_FMA and vector_bits(target) >= 512 and fma_datapath_bits(target) >= 512


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
