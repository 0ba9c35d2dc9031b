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

Also (session 25, :data:`TILE_LINEAR_TRANSPOSE`): a copy whose source indices are not a plain
permutation but whose flat source offset simplifies to a linear form of the block's variables
(:func:`linear_source_strides`): a reshape fused before the transpose. The case: a training
step's weight-gradient operand ``X^T`` of a MatMul over ``[batch, seq, k]`` activations,
``Reshape([b*s, k]) -> Transpose`` fused as ``X[v1 // s, v1 % s, v0]``, offset ``k v1 + v0``;
the loops are ordered by descending stride as the permutation case orders them by source axis.
Measured (1 thread, wall per call, 30 calls, ``[32, 64, 1024] -> [1024, 2048]``): 2.05 ms
against 11.78 ms off; ``[32, 64, 256] -> [256, 2048]`` 0.18 against 1.21 ms; the zoo bert's
1-rank training step (train_tvm_profile.py, thread CPU) 240.2 against 275.6 ms. In inference it
fires on bert's and gpt's ``K^T`` at batch 8 (``[8, 64, 128] -> [8, 4, 32, 64]``, 21-31 us
against 38-41 us median on 1 thread, within noise on 2) and on no conv model of per_device.py.
The largest read decides, so elementwise work fused into the transpose is taken too: the zoo
resnet's stem batch norm written ``(H, W, N, C)`` for its weight gradient, ``x[n, c, h, w] * s[c]
+ b[c]`` at ``(64, 64, 32, 32)``: 5.7 against 31.0 ms a step (two paired profiles, thread CPU).

The row tile (:func:`_row_axis`, :data:`ROW_TILE_BY_SOURCE`) is the output axis innermost in the
source, so a tile is a 16 x 16 block that reads 16 contiguous floats per source row; session
11's rule took the output's second-innermost axis, the same axis for the conv weights and the
bert operand. Measured (1 thread, wall per call, medians of 40, interleaved by process): NHWC ->
NCHW ``(16, 32, 32, 64)`` 0.67 ms against 1.09 (second-innermost) and 1.42 (untiled);
``(64, 32, 32, 64)`` 7.1-7.6 against 8.7-10.6 and 8.0-8.2; on 2 threads 7.4 against 10.6 and
7.6. ``benchmarks/copy_kernels_micro.py`` times every case above with its knob on and off in one
process (docs/per_device_speed.md, "Session 25").
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from .threads import parallel_elements

#: an axis permutation whose output-innermost axis is strided in the source walks the source
#: rows in order (:func:`schedule_strided_transpose`); off: the injective rule's output order
TILE_STRIDED_TRANSPOSE = True
#: the rule also takes copies whose source offset is linear in the block's variables (a reshape
#: fused before the transpose, :func:`linear_source_strides`); env
#: ``PARTITIONER_TVM_TILE_LINEAR_TRANSPOSE=0`` keeps it to plain permutations
TILE_LINEAR_TRANSPOSE = os.environ.get("PARTITIONER_TVM_TILE_LINEAR_TRANSPOSE", "1") != "0"
#: the row tile is the output axis innermost in the source (:func:`_row_axis`); env
#: ``PARTITIONER_TVM_ROW_TILE_BY_SOURCE=0``: the output's second-innermost axis
ROW_TILE_BY_SOURCE = os.environ.get("PARTITIONER_TVM_ROW_TILE_BY_SOURCE", "1") != "0"
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


def linear_source_strides(stmt: Any) -> list[int] | None:
    """Per block variable of ``stmt``, its stride in the flat offset of the block's largest read,
    when the block stores at its own variables, reads every buffer at one point (no window), has
    no select (a pad's or concat's bounds check), and that largest read's offset is linear in the
    variables with distinct positive constant strides. The cases: a transpose with a reshape fused
    before it (bert's weight-gradient operand ``X[v1 // 64, v1 % 64, v0]``, offset ``1024 v1 +
    v0``) and a transpose with elementwise work fused into it (the stem's batch norm written as
    HWNC for its weight gradient, ``x[n, c, h, w] * s[c] + b[c]``: ``x`` is the largest read, the
    per-channel vectors are small). Else None."""
    from tvm import sym, tirx

    body = stmt.body
    if not isinstance(body, tirx.stmt.BufferStore):
        return None
    ivars = [iv.var for iv in stmt.iter_vars]
    if len(body.indices) != len(ivars) or not all(i.same_as(v) for i, v in zip(body.indices, ivars)):
        return None
    if "if_then_else" in str(body.value) or "Select" in str(body.value):
        return None
    largest, size = None, 0
    for region in stmt.reads:  # TVM 0.27: TensorRegion, its buffer is ``source``
        dims = [int(e.value) if hasattr(e, "value") else 0 for e in region.source.shape]
        points = all(hasattr(r.extent, "value") and int(r.extent.value) == 1 for r in region.region)
        if not points or 0 in dims:
            return None
        if int(np.prod(dims)) > size:
            largest, size = region, int(np.prod(dims))
    if largest is None:
        return None
    offset, stride = 0, 1
    for r, ext in reversed(list(zip(largest.region, largest.source.shape))):
        offset, stride = offset + r.min * stride, stride * int(ext.value)
    analyzer = sym.Analyzer()
    for iv in stmt.iter_vars:
        analyzer.bind(iv.var, iv.dom)
    coef = sym.detect_linear_equation(analyzer.simplify(offset), ivars)
    if len(coef) != len(ivars) + 1 or not all(hasattr(c, "value") for c in coef):
        return None
    strides = [int(c.value) for c in coef[:-1]]
    return strides if min(strides) > 0 and len(set(strides)) == len(strides) else None


def _source_axes(sch: Any, block: Any) -> tuple[list[int], int] | None:
    """Per block variable, the rank of the source axis it walks (0 outermost), and the source
    stride of the output-innermost variable: from :func:`permutation_indices`, else from
    :func:`linear_source_strides`; None when neither fits."""
    stmt = sch.get(block)
    perm = permutation_indices(stmt)
    if perm is None:
        strides = linear_source_strides(stmt) if TILE_LINEAR_TRANSPOSE else None
        if strides is None:
            return None
        rank = {k: r for r, k in enumerate(sorted(range(len(strides)), key=lambda k: -strides[k]))}
        return [rank[k] for k in range(len(strides))], strides[-1]
    axis_of = {k: axis for axis, (k, _) in enumerate(perm)}
    src = [axis_of[k] for k in range(len(perm))]
    return src, _source_stride(stmt, src[-1])


def _source_stride(stmt: Any, axis: int) -> int:
    """Elements between neighbours of the source's ``axis`` (its row-major stride; 0 if not constant)."""
    stride = 1
    for e in stmt.body.value.source.shape[axis + 1:]:  # the loaded buffer (TVM 0.27: source)
        if not hasattr(e, "value"):
            return 0
        stride *= int(e.value)
    return stride


def _row_axis(src: list[int], exts: list[int]) -> int | None:
    """The output axis tiled by :data:`ROW_TILE`: of the axes other than the output-innermost one
    whose extent is a multiple of it (and larger), the one innermost in the source, so a tile
    reads ``ROW_TILE`` contiguous source elements per row (16 x 16 floats, a register-sized
    transpose). With ``ROW_TILE_BY_SOURCE`` off, the output's second-innermost axis when it fits
    (session 11's rule; the same axis for a conv weight OIHW -> HWIO, whose source-innermost taps
    are 3 long). None: no axis fits."""
    if not ROW_TILE_BY_SOURCE:
        n2 = len(exts) - 2
        return n2 if exts[n2] % ROW_TILE == 0 and exts[n2] > ROW_TILE else None
    fits = [k for k in range(len(exts) - 1) if exts[k] % ROW_TILE == 0 and exts[k] > ROW_TILE]
    return max(fits, key=lambda k: src[k]) if fits else None


def schedule_strided_transpose(sch: Any, block: Any, lanes: int, parallel: bool = True) -> bool:
    """Apply the module's rule to ``block`` (in place); False (nothing changed) when it does not fit."""
    from .vector import const_extent

    if not TILE_STRIDED_TRANSPOSE:
        return False
    found = _source_axes(sch, block)
    if found is None:
        return False
    src, inner_stride = found
    loops = sch.get_loops(block)
    if len(loops) != len(src) or len(src) < 2 or src[-1] == max(src):
        return False
    exts = [const_extent(sch, lp) for lp in loops]
    if any(e is None for e in exts) or exts[-1] % lanes:
        return False
    if inner_stride < MIN_SOURCE_STRIDE:
        return False
    o, v = sch.split(loops[-1], factors=[None, lanes])
    rest = sorted(range(len(loops) - 1), key=lambda k: src[k])
    row = _row_axis(src, exts)
    if row is not None:
        ro, ri = sch.split(loops[row], factors=[None, ROW_TILE])
        sch.reorder(o, ro, *[loops[k] for k in rest if k != row], ri, v)
    else:
        sch.reorder(o, *[loops[k] for k in rest], v)
    sch.vectorize(v)
    total = 1
    for e in exts:
        total *= e
    if parallel and exts[-1] > lanes and parallel_elements(total, PARALLEL_MIN):
        sch.parallel(o)
    return True
