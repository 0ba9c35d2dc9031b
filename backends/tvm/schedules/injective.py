"""CPU rule for functions with no reduction: elementwise chains, broadcasts, transposes, pads.

Rule: inline every intermediate block into its consumer (one pass over memory), then for each
remaining block vectorise the innermost loop when its extent is a multiple of the vector width
(or a short loop of at least 4), and run the fused outer loops in parallel when the block
writes at least :data:`PARALLEL_MIN` elements (below that, waking threads costs more than it
saves). An innermost extent below :data:`SHORT_INNER` (the 3 channels of an NHWC image: the
stem conv's pad, the input's NCHW -> NHWC transpose) is unrolled, and the loop around it stays
serial outside the fused parallel loop (when the loops left to fuse still have >= 16
iterations): fused, each element paid a div/mod to rebuild its indices (measured, 1 thread,
thread CPU time: mobilenet's 3x3 stride-2 stem conv with its pad, 112x112x3 -> 56x56x32,
batch 8 1848 -> 767 us; resnet's 7x7 stem 0.84-0.92x).

An innermost extent that is a multiple of half or a quarter of the vector width but not of the
width (24, 40, 56, 72 or 120 channels on AVX-512) is split by that narrower vector
(:data:`NARROW_VECTORS`); before, such a loop ran scalar. Measured (1 thread, thread CPU time,
conv 3x3 + bias + ReLU, 24 -> 24 channels on 32x32, batch 8, interleaved with its unpadded
twin on a 34x34 input): the padded conv took 2054 us against 1123 us without padding, the
difference being the scalar pad copy with its bounds check per element.
"""

from __future__ import annotations

from typing import Any

from tvm.s_tir.dlight.cpu.base import CPUScheduleRule

from .vector import const_extent, vector_lanes

PARALLEL_MIN = 16384
# Innermost extents below this (and not vectorised) stay out of the fused parallel loop, along
# with the loop around them (see schedule_spatial_block); 0 turns it off.
SHORT_INNER = 4
#: vectorise an innermost extent by lanes/2 or lanes/4 when the full width does not divide it
NARROW_VECTORS = True


def _is_spatial(sch: Any, block: Any) -> bool:
    from tvm import tirx

    return all(iv.iter_type == tirx.IterVar.DataPar for iv in sch.get(block).iter_vars)


def schedule_spatial_block(sch: Any, block: Any, lanes: int, parallel: bool = True) -> None:
    """Vectorise the innermost loop of ``block`` and parallelise its outer loops (in place)."""
    loops = sch.get_loops(block)
    if not loops:
        return
    total = 1
    for lp in loops:
        e = const_extent(sch, lp)
        total *= e if e is not None else PARALLEL_MIN
    inner = loops[-1]
    ext = const_extent(sch, inner)
    outer = list(loops[:-1])
    if ext is not None and ext % lanes == 0 and ext > lanes:
        o, v = sch.split(inner, factors=[None, lanes])
        sch.vectorize(v)
        outer.append(o)
    elif ext is not None and 4 <= ext <= lanes:
        sch.vectorize(inner)
    elif NARROW_VECTORS and ext is not None and _narrow_vector(ext, lanes):
        o, v = sch.split(inner, factors=[None, _narrow_vector(ext, lanes)])
        sch.vectorize(v)
        outer.append(o)
    elif ext is not None and ext < SHORT_INNER and len(outer) >= 2 and _product(sch, outer[:-1]) >= 16:
        # a few channels innermost (an RGB image's pad): fusing them into the parallel loop
        # costs a div/mod per element; keep the row loop serial and unroll the channels
        sch.unroll(inner)
        outer = outer[:-1]
    else:
        outer.append(inner)
    if not parallel or not outer:
        return
    if total < PARALLEL_MIN:
        return
    fused = sch.fuse(*outer) if len(outer) > 1 else outer[0]
    sch.parallel(fused)


def _narrow_vector(ext: int, lanes: int) -> int:
    """The widest of lanes/2, lanes/4 (at least 4) that divides ``ext``; 0 when none does."""
    return next((v for v in (lanes // 2, lanes // 4) if v >= 4 and ext % v == 0), 0)


def _product(sch: Any, loops: list) -> int:
    """The iteration count of ``loops`` (0 when one is symbolic)."""
    total = 1
    for lp in loops:
        e = const_extent(sch, lp)
        total *= e if e is not None else 0
    return total


class Injective(CPUScheduleRule):
    """Parallel + vectorised loops for all-spatial PrimFuncs (see the module docstring)."""

    def apply(self, func: Any, target: Any, _tunable: bool) -> Any:
        from tvm import s_tir, tirx

        if not isinstance(func, tirx.PrimFunc) or not self.is_target_available(target):
            return None
        try:
            sch = s_tir.Schedule(func)
            root = sch.get_sblock("root")
            blocks = sch.get_child_blocks(root)
            if not blocks or not all(_is_spatial(sch, b) for b in blocks):
                return None
            outputs = {str(sch.get(b).name_hint) for b in sch.get_output_blocks(root)}
            for b in blocks:
                if str(sch.get(b).name_hint) not in outputs:
                    try:
                        sch.compute_inline(b)
                    except Exception:  # kept as its own loop nest
                        pass
            lanes = vector_lanes(target)
            for b in sch.get_child_blocks(root):
                schedule_spatial_block(sch, b, lanes)
            return sch
        except Exception:  # a shape this rule does not handle: leave it unscheduled
            return None
