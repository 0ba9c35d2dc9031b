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

A convolution's zero-padded RGB input (3 channels innermost: the stem's ``pad_temp``) is copied
one output row at a time, the row's zeros first, then its interior as one contiguous vectorised
run with no bounds check (:data:`SPLIT_PAD_COPY`, :func:`schedule_padded_copy`, called by the
Contraction rule for its producers).

A concatenation along the innermost axis (an NHWC channel concat: Inception's branch outputs)
runs one loop per input (:data:`SPLIT_CONCAT`, :func:`schedule_concat_block`): in each, the
input is known and the copy is a plain vector load/store. Before, TOPI's chain of
``if_then_else`` on the channel index was vectorised as a select of every input's load per
vector.

The same split also applies when a reshape that keeps the concat axis innermost and whole is fused
behind the concat (its index is then ``v % extent``) and when the first input is itself a select
(a fused pad's bounds check) (:data:`CONCAT_THROUGH_RESHAPE`, session 18). Shapes it is for: a
training step's NHWC im2col, ``pad -> 9 strided slices -> concat on channels -> reshape to
[N*Ho*Wo, 9*C]`` (``partitioner/training/rules/linear.py``), whose fused kernel ran as one flat
vector loop selecting among the 9 slices' padded loads per lane. Measured (Intel AVX-512, 1
thread, thread CPU per call, ``benchmarks/im2col_forms_micro.py``, env
``PARTITIONER_TVM_CONCAT_THROUGH_RESHAPE=0`` in one run (load 1.5), default in another (2.5-4.1)):
resnet's layer1 columns from an NHWC input at 2 images 511.0 -> 92.7 us, layer2 260.8 -> 43.7,
layer1 at batch 16 5324.5 -> 1617.7.

An axis permutation whose output-innermost axis is strided in its source (a training step's conv
weight OIHW -> HWIO, recomputed every step) walks the source rows in order instead
(:mod:`.transpose_tiles`, tried before the default order).
"""

from __future__ import annotations

import math
import os
from typing import Any

from tvm.s_tir.dlight.cpu.base import CPUScheduleRule

from .threads import parallel_elements
from .transpose_tiles import schedule_strided_transpose
from .vector import const_extent, vector_lanes

PARALLEL_MIN = 16384
# Innermost extents below this (and not vectorised) stay out of the fused parallel loop, along
# with the loop around them (see schedule_spatial_block); 0 turns it off.
SHORT_INNER = 4
#: vectorise an innermost extent by lanes/2 or lanes/4 when the full width does not divide it
NARROW_VECTORS = True
#: a concat along the innermost axis runs one vectorised loop per input
#: (:func:`schedule_concat_block`); off: one loop with a select per element
SPLIT_CONCAT = True
#: (session 18) that rule also where the concat's innermost axis is indexed ``v % extent`` (a
#: reshape fused behind the concat that keeps that axis innermost whole: a conv weight gradient's
#: NHWC im2col ``[N, Ho, Wo, K*C] -> [N*Ho*Wo, K*C]``, ``partitioner/training/rules/linear.py``);
#: env ``PARTITIONER_TVM_CONCAT_THROUGH_RESHAPE=0`` turns it off
CONCAT_THROUGH_RESHAPE = os.environ.get("PARTITIONER_TVM_CONCAT_THROUGH_RESHAPE", "1") != "0"
#: a convolution's zero-padded input copy runs as one row at a time, zeros then the interior as a
#: plain vector copy (:func:`schedule_padded_copy`); off: one bounds-checked loop per element
SPLIT_PAD_COPY = True


def _is_spatial(sch: Any, block: Any) -> bool:
    from tvm import tirx

    return all(iv.iter_type == tirx.IterVar.DataPar for iv in sch.get(block).iter_vars)


def schedule_spatial_block(sch: Any, block: Any, lanes: int, parallel: bool = True) -> None:
    """Vectorise the innermost loop of ``block`` and parallelise its outer loops (in place)."""
    loops = sch.get_loops(block)
    if not loops:
        return
    if SPLIT_CONCAT and parallel and schedule_concat_block(sch, block, lanes):
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
    if not parallel_elements(total, PARALLEL_MIN):
        return
    fused = sch.fuse(*outer) if len(outer) > 1 else outer[0]
    sch.parallel(fused)


def schedule_concat_block(sch: Any, block: Any, lanes: int) -> bool:
    """Schedule ``block`` as a concatenation along its innermost axis, one loop per input; False
    (nothing changed) when it is not one or its input widths share no vector width >= 4.

    Shapes it is for: TOPI's ``concatenate`` on the last axis (channel concats in NHWC:
    Inception's 4 branches of 24-64 channels, U-Net's skip concats), whose value is a chain
    ``if_then_else(k <= c, x_j[.., c - k], ...)``. Vectorised as one loop, every vector
    selects between the loads of all inputs (and a 16-lane vector straddles two 24-channel
    inputs). Here the channel loop is split by the widest vector (lanes, lanes/2, lanes/4) that
    divides every input's width, and its outer loop partitioned (TVM's ``loop_partition``) at
    the input boundaries: in each part the input is fixed, the simplifier drops the conditions
    at lowering, and the part is a contiguous vector copy. The loops outside run in parallel
    as in :func:`schedule_spatial_block`. Measured (1 thread, thread CPU time, 15 interleaved
    rounds, hot cache, batch 8): 4 x 24 channels on 32x32 285 -> 88 us, 4 x 32 324 -> 127,
    16 + 16 on 64x64 304 -> 99."""
    bounds = _concat_bounds(sch, block)
    loops = sch.get_loops(block)
    ext = const_extent(sch, loops[-1])
    if not bounds or ext is None:
        return False
    edges = [0, *bounds, ext]
    widths = [b - a for a, b in zip(edges, edges[1:])]
    common = math.gcd(*widths)
    vec = next((v for v in (lanes, lanes // 2, lanes // 4) if v >= 4 and common % v == 0), 0)
    if not vec or min(widths) <= 0:
        return False
    co, cv = sch.split(loops[-1], factors=[None, vec])
    sch.vectorize(cv)
    sch.loop_partition(co, factors=[w // vec for w in widths[:-1]] + [None])
    outer = list(loops[:-1])
    if outer and parallel_elements(_product(sch, outer) * ext, PARALLEL_MIN):
        sch.parallel(sch.fuse(*outer) if len(outer) > 1 else outer[0])
    return True


def _concat_bounds(sch: Any, block: Any) -> list[int]:
    """The innermost-axis offsets where the concat ``block`` switches input, ascending ([] when
    its value is not a chain ``if_then_else(k <= v, .., ..)`` on its last block variable)."""
    from tvm import ir, tirx

    stmt = sch.get(block)
    body, var = stmt.body, stmt.iter_vars[-1].var
    loops = sch.get_loops(block)
    dom = stmt.iter_vars[-1].dom.extent
    if (len(loops) != len(stmt.iter_vars) or not isinstance(dom, tirx.IntImm)
            or const_extent(sch, loops[-1]) != int(dom)):
        return []  # loops already transformed: not the one-loop-per-axis nest this rule splits
    if not isinstance(body, tirx.BufferStore) or not body.indices[-1].same_as(var):
        return []
    bounds, value = [], body.value
    while isinstance(value, ir.Call) and value.op.name.endswith("if_then_else"):
        cond = value.args[0]
        if not (isinstance(cond, tirx.LE) and isinstance(cond.a, tirx.IntImm) and _is_var(cond.b, var, int(dom))):
            if bounds and CONCAT_THROUGH_RESHAPE:
                break  # the first input's own select (a fused pad's bounds check), not the chain's
            return []
        bounds.append(int(cond.a.value))
        value = value.args[2]
    return sorted(set(bounds))


def _is_var(expr: Any, var: Any, extent: int) -> bool:
    """``expr`` is ``var`` or ``var % extent`` (:data:`CONCAT_THROUGH_RESHAPE`: a reshape that
    keeps the concat axis innermost, fused behind it, indexes it as ``v % extent``)."""
    from tvm import tirx

    if expr.same_as(var):
        return True
    return (CONCAT_THROUGH_RESHAPE and isinstance(expr, tirx.FloorMod) and expr.a.same_as(var)
            and isinstance(expr.b, tirx.IntImm) and int(expr.b.value) == extent)


def schedule_padded_copy(sch: Any, block: Any, lanes: int) -> bool:
    """Schedule ``block``, a zero-padding copy ``out[n, h, w, c] = in[n, h - p, w - q, c]`` inside
    the bounds, else 0 (TOPI's ``pad_temp`` before a convolution), as two loops per output row:
    the whole row set to zero, then (on interior rows) the ``w x c`` interior copied as one
    contiguous run, fused and vectorised; the rows (``n, h``) are the parallel loop. False
    (nothing changed) when the block is not such a copy (TVM's ``can_decompose_padding``) or
    has fewer than 3 loops.

    Shapes it is for: the padded NHWC inputs of direct convolutions scheduled by
    :class:`~backends.tvm.schedules.contraction.Contraction`, above all RGB stems (3 channels
    innermost: ResNet's 7x7 stride-2 stem pads ``[n, 224, 224, 3]`` to ``[n, 230, 230, 3]``),
    whose copy ran scalar with a 4-way bounds check per element (~1.1 ms of the stem's
    10.6 ms at batch 4); the interior of a row is 672 contiguous floats, a plain vector copy,
    and the zeros are written in L1 (one row: 2.7 KiB) just before the interior overwrites
    them. Only innermost extents below 4 (RGB inputs): the 3x3 convs' pads (64-512
    channels) are vectorised already, and decomposed they ran 1.01x (conv3x3 class of
    resnet18 224x224 b4, paired, load ~6: noise-level, not a gain). Not for depthwise
    convolutions (their own rule) nor element-wise functions."""
    if not SPLIT_PAD_COPY:
        return False
    loops = sch.get_loops(block)
    if len(loops) < 3 or any(const_extent(sch, lp) is None for lp in loops):
        return False
    if const_extent(sch, loops[-1]) >= 4:  # wider channels are vectorised already (docstring)
        return False
    try:
        if not sch.can_decompose_padding(block, loops[-2]):
            return False
    except Exception:  # noqa: BLE001 - not a padding pattern TVM recognises
        return False
    total = _product(sch, loops)
    zeros = sch.decompose_padding(block, loops[-2])
    for blk in (zeros, block):
        inner = sch.get_loops(blk)[len(loops) - 2:]
        run = sch.fuse(*inner)
        ext = const_extent(sch, run)
        width = lanes if ext % lanes == 0 else _narrow_vector(ext, lanes)
        if width:
            _, v = sch.split(run, factors=[None, width])
            sch.vectorize(v)
    outer = sch.get_loops(block)[:len(loops) - 2]
    if outer and parallel_elements(total, PARALLEL_MIN):
        sch.parallel(sch.fuse(*outer) if len(outer) > 1 else outer[0])
    return True


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
                if not schedule_strided_transpose(sch, b, lanes):
                    schedule_spatial_block(sch, b, lanes)
            return sch
        except Exception:  # a shape this rule does not handle: leave it unscheduled
            return None
