"""CPU rule for functions with no reduction: elementwise chains, broadcasts, transposes, pads.

Rule: inline every intermediate block into its consumer (one pass over memory), then for each
remaining block vectorise the innermost loop when its extent is a multiple of the vector width
(or a short loop of at least 4), and run the fused outer loops in parallel when the block
writes at least :data:`PARALLEL_MIN` elements (below that, waking threads costs more than it
saves).
"""

from __future__ import annotations

from typing import Any

from tvm.s_tir.dlight.cpu.base import CPUScheduleRule

from .vector import const_extent, vector_lanes

PARALLEL_MIN = 16384


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
    else:
        outer.append(inner)
    if not parallel or not outer:
        return
    if total < PARALLEL_MIN:
        return
    fused = sch.fuse(*outer) if len(outer) > 1 else outer[0]
    sch.parallel(fused)


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
