"""CPU loop order for an axis permutation whose output-innermost axis is strided in its source.

For: an all-spatial block that copies one buffer under a permutation of its axes (each source
index is one block variable ``v`` or ``c - v``: a transpose, optionally with a reversing
strided slice folded in), where the output's innermost axis is *not* the source's innermost one
and its extent is a multiple of the vector width. The case that matters: a training step's
per-step weight layout changes, a conv weight OIHW -> HWIO (``(512, 512, 3, 3) -> (3, 3, 512,
512)``) and its flipped transpose for the data gradient. In inference these are constants folded
at build time; in training the weights change every step, so each step runs them, and their
cost does not shrink with the batch (issue 16: a data rank's batch-8 step against half the
batch-16 step).

Rule (:func:`schedule_strided_transpose`): split the output-innermost axis by the vector width;
loops = its outer part, then the other output axes in their *source* order, then the vector
part (vectorised). Each vector lane then walks its source row sequentially and every store
writes whole vectors. The default injective order (output order, innermost vectorised) made
every vector a gather of ``lanes`` loads ``stride`` apart and walked the source ``H*W`` times
over (resnet-18's ``(512, 512, 3, 3)`` transpose, 1 thread: 5.7 ms a call, measured in the
batch-8 training step). The outer part is the parallel loop when the block is large enough
(``threads.parallel_elements``). Off (:data:`TILE_STRIDED_TRANSPOSE`): the default order.
"""

from __future__ import annotations

from typing import Any

from .threads import parallel_elements

#: an axis permutation whose output-innermost axis is strided in the source walks the source
#: rows in order (:func:`schedule_strided_transpose`); off: the injective rule's output order
TILE_STRIDED_TRANSPOSE = True
PARALLEL_MIN = 16384
ROW_TILE = 16


def _source_axes(sch: Any, block: Any) -> list[int] | None:
    """Per block variable, the source axis it indexes, when the block is a one-buffer permutation
    copy (each load index ``v`` or ``c - v`` of a distinct variable); else None."""
    from tvm import tirx
    from tvm.tirx.analysis import undefined_vars

    stmt = sch.get(block)
    body = stmt.body
    if not isinstance(body, tirx.stmt.BufferStore) or not hasattr(body.value, "indices"):  # a load (TensorLoad)
        return None
    ivars = [iv.var for iv in stmt.iter_vars]
    if len(body.indices) != len(ivars) or not all(i.same_as(v) for i, v in zip(body.indices, ivars)):
        return None
    axis_of: dict[int, int] = {}
    for axis, idx in enumerate(body.value.indices):
        used = [k for k, v in enumerate(ivars) if any(u.same_as(v) for u in undefined_vars(idx))]
        plain = isinstance(idx, tirx.expr.Var) or (isinstance(idx, tirx.expr.Sub) and isinstance(idx.a, tirx.expr.IntImm)
                                                   and isinstance(idx.b, tirx.expr.Var))
        if len(used) != 1 or not plain or used[0] in axis_of:
            return None
        axis_of[used[0]] = axis
    if len(axis_of) != len(ivars):
        return None
    return [axis_of[k] for k in range(len(ivars))]


def schedule_strided_transpose(sch: Any, block: Any, lanes: int, parallel: bool = True) -> bool:
    """Apply the module's rule to ``block`` (in place); False (nothing changed) when it does not fit."""
    from .vector import const_extent

    if not TILE_STRIDED_TRANSPOSE:
        return False
    src = _source_axes(sch, block)
    loops = sch.get_loops(block)
    if src is None or len(loops) != len(src) or len(src) < 2 or src[-1] == max(src):
        return False
    exts = [const_extent(sch, lp) for lp in loops]
    if any(e is None for e in exts) or exts[-1] % lanes:
        return False
    o, v = sch.split(loops[-1], factors=[None, lanes])
    rest = sorted(range(len(loops) - 1), key=lambda k: src[k])
    n2 = len(loops) - 2
    if exts[n2] % ROW_TILE == 0 and exts[n2] > ROW_TILE:
        ro, ri = sch.split(loops[n2], factors=[None, ROW_TILE])
        sch.reorder(o, ro, *[loops[k] for k in rest if k != n2], ri, v)
    else:
        sch.reorder(o, *[loops[k] for k in rest], v)
    sch.vectorize(v)
    total = 1
    for e in exts:
        total *= e
    if parallel and exts[-1] > lanes and parallel_elements(total, PARALLEL_MIN):
        sch.parallel(o)
    return True
