"""CPU rule for row-wise normalisations: LayerNorm, softmax, and any function made of
reductions over a row's last axis followed by an elementwise write of the same row.

Shapes it is for: the ``[..., D]`` activations of transformers, LayerNorm over the hidden size
(bert/gpt: D = 128-1024; ViT: 96-768) and softmax over the key axis of ``[B, heads, S, S]``
scores (S = 64-197). Before this rule dlight's CPU ``Reduction`` scheduled them: each
reduction (LayerNorm's sum and sum of squared deviations, softmax's max and exp-sum) was a
scalar chain of D dependent adds (one FP-add latency, 3-4 cycles, per element), and that was
most of the kernel's time (bert b1, 64 x 128 LayerNorm: ~16 us a call).

Schedule, per row (the output's leading axes fused into one loop)::

    for row in (parallel if rows x D >= threads.PARALLEL_MIN_ELEMENTS else serial):
        for each reduction (in order):                  # the row is read from memory once and
            acc[A] = init                                # stays in L1 for the later passes
            for o in D / A: for a in vectorize(A):       # A = the vector width (rule 3)
                acc[a] = acc[a] (+|max) f(x[row, o*A + a])
            r[row] = reduce(acc[0..A))                   # A -> 1, once per row
        per-row scalars (mean) and per-element intermediates (softmax's exp) at the row
        for d in vectorize(D): out[row, d] = g(x[row, d], r[row], ...)

Rules:

1. Applies when the function has one output block, spatial, whose last axis has a constant
   extent ``D``; at least one reduction block; every reduction block has exactly one reduction
   axis, innermost, of extent ``D``, and one spatial axis per leading output axis (one value per
   row); every other block is spatial. Matrix products and pooling never match (their reduction
   extent is not the output's last extent, or they have one reduction and are claimed earlier
   by ``GemmPacked``/``Contraction``).
2. Spatial intermediates with a single consumer (softmax's ``x - max``) are inlined; those read
   twice (softmax's ``exp``, read by the sum and by the normalisation) stay materialised per row,
   so ``exp`` is computed once.
3. A reduction is split by ``A`` = the vector width (else half or a quarter of it, at least 4
   lanes) when ``A`` divides ``D`` (:func:`accumulator_width`), and ``rfactor`` turns the ``A``
   lanes into one vector of partial sums: D/A vector adds, then A scalar adds per row. One
   vector, not several: the A-to-1 step is scalar, so for the rows here (D/A = 4-48) more
   lanes cost more in that step than they hide in add latency. The order of the additions
   changes (A partial sums), so results match the scalar chain up to float rounding.
   3b. When no vector width divides ``D`` (softmax over the 65 keys of a ViT with a class token;
   50 for ViT-B/32 at 224), the partial sums are the largest divisor of ``D`` between 4 and the
   vector width (:func:`scalar_partials`), scalar and unrolled: for 65, 13 independent chains
   of 5 adds instead of one of 65 (a vector split with a tail is scalarised by TVM, and
   ``rfactor`` over an imperfect split loses its bounds predicate under the row loop). A prime
   ``D`` (197 tokens) keeps one scalar chain. Knob :data:`SCALAR_PARTIALS`.
4. The row loop runs in parallel only when the function touches at least
   ``threads.PARALLEL_MIN_ELEMENTS`` elements (the memory-bound threshold of
   :mod:`.threads`): a bert b1 LayerNorm (8K elements, ~2 us) is cheaper than one fork/join.
   A symbolic row count (a dynamic batch) stays serial: the size is unknown at build time.

:data:`ROWWISE` off: the rule declines and dlight's ``Reduction`` schedules these functions
(the old behaviour).

Invariant: only splits, rfactor, compute_at/inline and loop annotations (each checked by TVM), so
the function computes the same values up to float rounding order; a function this rule does not
match, or a primitive that fails, returns ``None`` and the next rule runs.
"""

from __future__ import annotations

from typing import Any

from tvm.s_tir.dlight.cpu.base import CPUScheduleRule

from .threads import parallel_elements
from .vector import const_extent, vector_lanes

#: schedule LayerNorm/softmax-style functions with this rule; off: dlight's CPU Reduction does
ROWWISE = True
#: rows no vector width divides reduce into scalar partial sums (rule 3b); off: one scalar chain
SCALAR_PARTIALS = True


def accumulator_width(d: int, lanes: int) -> int:
    """Lanes of partial sums for a reduction over ``d`` elements (rule 3); 0: stay scalar."""
    return next((w for w in (lanes, lanes // 2, lanes // 4) if w >= 4 and d % w == 0), 0)


def _reduce_vars(block: Any) -> list[Any]:
    from tvm import tirx

    return [iv for iv in block.iter_vars if iv.iter_type == tirx.IterVar.CommReduce]


def _matches(sch: Any, blocks: list[Any], out: Any) -> int | None:
    """``D`` when the blocks have the shape of rule 1, else None."""
    from tvm import tirx

    out_ivs = sch.get(out).iter_vars
    if not out_ivs or _reduce_vars(sch.get(out)):
        return None
    d = _int_or_none(out_ivs[-1].dom.extent)
    if d is None or d < 2:
        return None
    n_red = 0
    for b in blocks:
        stmt = sch.get(b)
        red = _reduce_vars(stmt)
        if not red:
            continue
        if any(iv.iter_type not in (tirx.IterVar.DataPar, tirx.IterVar.CommReduce) for iv in stmt.iter_vars):
            return None
        if len(red) != 1 or not stmt.iter_vars[-1].same_as(red[0]) or _int_or_none(red[0].dom.extent) != d:
            return None
        if len(stmt.iter_vars) != len(out_ivs):
            return None
        n_red += 1
    return d if n_red else None


def _int_or_none(ext: Any) -> int | None:
    """An extent expression as an int, None when it is symbolic."""
    try:
        return int(ext)
    except (TypeError, ValueError):
        return None


def _inline_single_use(sch: Any, root: Any, out_name: str) -> None:
    """Rule 2: inline spatial intermediates read by one block."""
    for b in list(sch.get_child_blocks(root)):
        stmt = sch.get(b)
        if stmt.name_hint == out_name or _reduce_vars(stmt) or len(sch.get_consumers(b)) != 1:
            continue
        try:
            sch.compute_inline(b)
        except Exception:  # e.g. a per-row scalar read at a different index: keep it
            pass


def scalar_partials(d: int, lanes: int) -> int:
    """Rule 3b: the largest divisor of ``d`` in [4, lanes] (independent scalar partial sums for a
    row no vector width divides); 0 when there is none (a prime ``d``)."""
    return next((w for w in range(lanes, 3, -1) if d % w == 0), 0)


def _rfactor(sch: Any, block: Any, lanes: int) -> tuple[Any, bool] | None:
    """Rules 3/3b: split the reduction of ``block`` (still in its own loop nest) into partial
    sums; (the partial-sum block, True when they are vector lanes), or None: one scalar chain."""
    loop = sch.get_loops(block)[-1]
    d = const_extent(sch, loop)
    width = accumulator_width(d, lanes)
    if not width and SCALAR_PARTIALS:
        width = scalar_partials(d, lanes)
        vector = False
    else:
        vector = True
    if not width:
        return None
    _, inner = sch.split(loop, factors=[None, width])
    return sch.rfactor(inner, factor_axis=0), vector


def _vectorize_partial_sums(sch: Any, rf: Any) -> bool:
    """Order the partial-sum block's loops under the row (o, a): lanes innermost, vectorised.
    True when there is an ``o`` loop to hoist the initialisation out of."""
    inner = sch.get_loops(rf)[1:]  # [0] is the row loop
    if len(inner) == 2:  # compute_at regenerates (a, o) in block-variable order
        sch.reorder(inner[1], inner[0])
    sch.vectorize(sch.get_loops(rf)[-1])
    return len(inner) == 2


def _unroll_partial_sums(sch: Any, rf: Any) -> None:
    """Rule 3b: the scalar partial sums' lanes innermost and unrolled (independent chains)."""
    inner = sch.get_loops(rf)[1:]
    if len(inner) == 2:
        sch.reorder(inner[1], inner[0])
    sch.unroll(sch.get_loops(rf)[-1])


def _hoist_init(sch: Any, rf: Any) -> None:
    """The partial sums' initialisation before their ``o`` loop, vectorised (last: a block
    without its init is no longer a reduction block to the other primitives)."""
    init = sch.decompose_reduction(rf, sch.get_loops(rf)[-2])
    sch.vectorize(sch.get_loops(init)[-1])


class Rowwise(CPUScheduleRule):
    """Vectorised row reductions + one elementwise row write (see the module docstring)."""

    def apply(self, func: Any, target: Any, _tunable: bool) -> Any:
        from tvm import s_tir, tirx

        if not ROWWISE or not isinstance(func, tirx.PrimFunc) or not self.is_target_available(target):
            return None
        try:
            sch = s_tir.Schedule(func)
            root = sch.get_sblock("root")
            outs = sch.get_output_blocks(root)
            if len(outs) != 1:
                return None
            d = _matches(sch, sch.get_child_blocks(root), outs[0])
            if d is None:
                return None
            return _schedule(sch, root, outs[0], d, vector_lanes(target))
        except Exception:  # a shape this rule does not handle: leave it to the next rule
            return None


def _schedule(sch: Any, root: Any, out: Any, d: int, lanes: int) -> Any:
    """The module docstring's schedule on a matched function (rules 2-4); None for one row."""
    out_name = sch.get(out).name_hint
    _inline_single_use(sch, root, out_name)
    out = sch.get_sblock(out_name)
    loops = sch.get_loops(out)
    if len(loops) < 2:
        return None  # one row: nothing to place the reductions under
    rows = sch.fuse(*loops[:-1]) if len(loops) > 2 else loops[0]
    n_rows = const_extent(sch, rows)
    width = accumulator_width(d, lanes)
    if width:
        _, v = sch.split(loops[-1], factors=[None, width])
        sch.vectorize(v)
    reductions = [b for b in sch.get_child_blocks(root) if _reduce_vars(sch.get(b))]
    partial = [rf for rf in (_rfactor(sch, b, lanes) for b in reductions) if rf is not None]
    rf_names = {sch.get(rf).name_hint for rf, _ in partial}
    producers = [b for b in sch.get_child_blocks(root) if sch.get(b).name_hint != out_name]
    for b in reversed(producers):
        sch.compute_at(b, rows, preserve_unit_loops=False)
    for rf, vector in partial:
        if not vector:
            _unroll_partial_sums(sch, rf)
    hoist = [rf for rf, vector in partial if vector and _vectorize_partial_sums(sch, rf)]
    for b in producers:
        stmt = sch.get(b)
        if not _reduce_vars(stmt) and stmt.name_hint not in rf_names and len(sch.get_loops(b)) > 1 and width:
            _, v = sch.split(sch.get_loops(b)[-1], factors=[None, width])
            sch.vectorize(v)
    if n_rows is not None and parallel_elements(n_rows * d):
        sch.parallel(rows)
    for rf in hoist:
        _hoist_init(sch, rf)
    return sch
