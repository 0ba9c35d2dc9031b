"""CPU loop order for an axis permutation whose output-innermost axis is strided in its source.

For: an all-spatial block that copies one buffer under a permutation of its axes (each source
index is one block variable ``v`` or ``c - v``: a transpose, optionally with a reversing
strided slice folded in), where the output's innermost axis is *not* the source's innermost one
and its extent is a multiple of the vector width. The case that matters: a training step's
per-step weight layout changes, a conv weight OIHW -> HWIO (``(512, 512, 3, 3) -> (3, 3, 512,
512)``). In inference these are constants folded
at build time; in training the weights change every step, so each step runs them, and their
cost does not shrink with the batch (issue 16: a data rank's batch-8 step against half the
batch-16 step).

Rule (:func:`schedule_strided_transpose`): split the output-innermost axis by the vector width and
the output's second-innermost axis by :data:`ROW_TILE` (when it divides it and is larger); loops =
the vector columns' outer part, the row tiles' outer part, the other output axes in their *source*
order, the rows of a tile, the vector (vectorised). A tile (``lanes`` x ``ROW_TILE`` x the axes
between, 16 x 16 x 3 x 3 floats for a 3x3 conv weight on AVX-512) reads ``lanes`` source rows of
``ROW_TILE * 9`` contiguous floats each once (9 KiB, in L1 while the tile's ``3 x 3`` taps are
written) and writes whole vectors. The default injective order (output order, innermost
vectorised) makes every vector a gather of ``lanes`` loads ``I*H*W`` floats apart and walks the
whole source once per tap (by analysis, not measured apart). The vector columns' loop is the
parallel loop when the block is large enough (``threads.parallel_elements``). Measured (1 thread,
thread CPU, load ~5.7, 15 interleaved calls): ``(512, 512, 3, 3) -> (3, 3, 512, 512)`` 2.78 ms
against 6.13 ms off; with its taps reversed as well 2.05 against
5.70 ms. Inference builds are unchanged (conv weights are folded constants there: the rule fires
on no function of resnet-18). Only from a source stride of :data:`MIN_SOURCE_STRIDE` elements:
below a cache line the default order's lanes share lines (the data gradient's fused ``(I, O, 3,
3) -> (3, 3, I, O)`` with its taps reversed, stride 9: 2.2-2.5 ms tiled against 1.8-1.9 ms).
Also caught, and not better: a batch's NHWC -> NCHW activation transpose, ``(16, 32, 32, 64)``,
stride 64: 1.23-1.61 ms tiled against 1.12-1.36 ms (two interleaved runs, load 3.3-3.7); the
training step measured whole and paired is faster at both batches (docs/per_device_speed.md,
"Session 12"). Off (:data:`TILE_STRIDED_TRANSPOSE`): the default order.
"""

from __future__ import annotations

from typing import Any

from .threads import parallel_elements

#: an axis permutation whose output-innermost axis is strided in the source walks the source
#: rows in order (:func:`schedule_strided_transpose`); off: the injective rule's output order
TILE_STRIDED_TRANSPOSE = True
#: elements: as ``injective.PARALLEL_MIN`` (below it a parallel loop costs more than it saves)
PARALLEL_MIN = 16384
#: the source stride (elements) of the output-innermost axis from which the rule applies (one
#: cache line of float32; see the module docstring)
MIN_SOURCE_STRIDE = 16
#: rows (the output's second-innermost axis) per tile: ``lanes`` x ROW_TILE source rows stay in L1
ROW_TILE = 16


def permutation_indices(stmt: Any) -> list[tuple[int, int | None]] | None:
    """Per source axis of the block ``stmt``, (the block variable it reads, the constant ``c`` of a
    ``c - v`` index, or None for ``v``), when the block is a one-buffer permutation copy (stores
    at its own variables, each load index ``v`` or ``c - v`` of a distinct variable); else None."""
    from tvm import tirx
    from tvm.tirx.analysis import undefined_vars

    body = stmt.body
    # the stored value a load (TVM 0.27 names its class TensorLoad)
    if not isinstance(body, tirx.stmt.BufferStore) or not hasattr(body.value, "indices"):
        return None
    ivars = [iv.var for iv in stmt.iter_vars]
    if len(body.indices) != len(ivars) or not all(i.same_as(v) for i, v in zip(body.indices, ivars)):
        return None
    out: list[tuple[int, int | None]] = []
    for idx in body.value.indices:
        used = [k for k, v in enumerate(ivars) if any(u.same_as(v) for u in undefined_vars(idx))]
        E = tirx.expr
        plain = isinstance(idx, E.Var) or (isinstance(idx, E.Sub) and isinstance(idx.a, E.IntImm)
                                           and isinstance(idx.b, E.Var))
        if len(used) != 1 or not plain or any(used[0] == k for k, _ in out):
            return None
        out.append((used[0], None if isinstance(idx, E.Var) else int(idx.a.value)))
    return out if len(out) == len(ivars) else None


def _source_axes(sch: Any, block: Any) -> list[int] | None:
    """Per block variable, the source axis it indexes (:func:`permutation_indices`); else None."""
    perm = permutation_indices(sch.get(block))
    if perm is None:
        return None
    axis_of = {k: axis for axis, (k, _) in enumerate(perm)}
    return [axis_of[k] for k in range(len(perm))]


def _source_stride(sch: Any, block: Any, axis: int) -> int:
    """Elements between neighbours of the source's ``axis`` (its row-major stride; 0 if not constant)."""
    stride = 1
    for e in sch.get(block).body.value.source.shape[axis + 1:]:  # the loaded buffer (TVM 0.27: source)
        if not hasattr(e, "value"):
            return 0
        stride *= int(e.value)
    return stride


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
    if _source_stride(sch, block, src[-1]) < MIN_SOURCE_STRIDE:
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
