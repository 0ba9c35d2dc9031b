"""A conv weight's per-call layout transpose folded into its panel packing: one pass, not two.

For: a training step (or pipeline stage) built by TVM, where a conv weight is a program input
that changes every step. ConvertLayout gives each conv2d an HWIO weight, so TVM emits
``T = transpose(W)`` (OIHW -> HWIO; for a conv's input gradient ``Conv(dY, flip(W^T))`` the fused
``transpose_strided_slice_transpose``, taps reversed) and then the conv schedule's
``*_weight_prepack`` (``schedules/contraction._pack_conv_weights``) copies ``T`` once more into
panels ``Wp[o // p, h, w, i, o % p]``. Both run on every call, over the whole weight: the zoo
resnet-18's data rank at batch 8 spends about 12 ms a step in the weight transposes, 12 in
their flipped twins and 11 in the packs (docs/per_device_speed.md, "Session 12"), none of which
shrinks with the batch.

Rules:

1. Pattern (in every Relax function of the built module, after the schedule pipeline):
   ``Wp = call_tir(pack, (T,))`` where ``pack`` is a one-block PrimFunc named
   ``*_weight_prepack`` whose block stores ``Wp[v3 // p, v0, v1, v2, v3 % p] = T[v0, v1, v2, v3]``
   (``p`` = the packed output's last dim, at least two panels: a one-panel pack, ``Wp[0, v0, v1,
   v2, v3]``, is a reshape that TVM's ``RewriteDataflowReshape`` makes free, so folding the
   transpose into it saves nothing; measured, matching it too made the resnet's 1-rank step
   slower under MPI, CPU 264.7-275.2 against 246.0-265.7 ms in three runs, load 1-13), ``T = call_tir(tr, (W,))`` is read by nothing else,
   and ``tr`` is a one-block axis permutation (each source index one block variable ``v`` or
   ``c - v``, :func:`backends.tvm.schedules.transpose_tiles.permutation_indices`).
2. Rewrite: ``Wp = call_tir(folded, (W,))`` where ``folded`` computes
   ``Wp[P, h, w, i, r] = W[g(h, w, i, P*p + r)]`` (``g`` the permutation) in one pass; the
   transpose becomes dead and is removed. Loop order: the panel ``P`` outermost, then the other
   output axes by their source stride (largest first: the source is read in its own order, one
   panel's ``p`` source rows at a time, 590 KiB for a 3x3 512-channel layer, in L2), the
   panel's ``p`` lanes innermost and vectorised (whole-line writes). Parallel over panels where
   ``threads.parallel_elements`` says so.
3. Knob :data:`FOLD_TRANSPOSED_PACKS` (default on; ``$PARTITIONER_TVM_FOLD_TRANSPOSED_PACKS=0`` off). Inference builds are unchanged: their conv
   weights are constants, transposed and packed at build time (no such call remains).

Invariant: every element of ``Wp`` is the same element of ``W`` as before (a copy, bit for bit).
"""

from __future__ import annotations

import os
from typing import Any

from .schedules.transpose_tiles import MIN_SOURCE_STRIDE, ROW_TILE, permutation_indices

#: rules 1-2 on (module constant; off: TVM's transpose then the separate pack, two passes per call);
#: the environment's ``PARTITIONER_TVM_FOLD_TRANSPOSED_PACKS=0`` turns it off in MPI ranks too
FOLD_TRANSPOSED_PACKS = os.environ.get("PARTITIONER_TVM_FOLD_TRANSPOSED_PACKS", "1") != "0"
SUFFIX = "_weight_prepack"


def _one_block(func: Any) -> Any:
    """The only SBlock of ``func`` (a PrimFunc), or None."""
    from tvm import s_tir

    try:
        sch = s_tir.Schedule(func)
        blocks = sch.get_child_blocks(sch.get_sblock("root"))
        inner = [b for b in blocks]
        while len(inner) == 1 and sch.get_child_blocks(inner[0]):
            inner = list(sch.get_child_blocks(inner[0]))
        return sch.get(inner[0]) if len(inner) == 1 else None
    except Exception:  # noqa: BLE001 - a function this rule cannot read: not a match
        return None


def _copy_store(func: Any) -> tuple[Any, Any] | None:
    """The one block of the two-parameter PrimFunc ``func`` and its store, when the block stores
    one loaded value; else None."""
    from tvm import tirx

    stmt = _one_block(func) if len(func.params) == 2 else None
    body = stmt.body if stmt is not None else None
    if not isinstance(body, tirx.stmt.BufferStore) or not hasattr(body.value, "indices"):
        return None
    return stmt, body


def _permutation(func: Any) -> list[tuple[int, int | None]] | None:
    """Rule 1's ``tr``: per source axis, (the output axis it reads, the constant ``c`` of ``c - v``
    or None), when ``func``'s one block is an axis permutation copy; else None."""
    found = _copy_store(func)
    return permutation_indices(found[0]) if found is not None else None


def _panel(func: Any) -> int | None:
    """Rule 1's ``pack``: its panel width ``p`` when its block stores
    ``Wp[v3 // p, v0, v1, v2, v3 % p] = T[v0, v1, v2, v3]``; else None."""
    from tvm import tirx

    found = _copy_store(func)
    if found is None:
        return None
    stmt, body = found
    v = [iv.var for iv in stmt.iter_vars]
    out_shape = [int(d) for d in body.buffer.shape]
    if len(v) != 4 or len(out_shape) != 5 or len(body.value.indices) != 4 \
            or not all(i.same_as(x) for i, x in zip(body.value.indices, v)):
        return None
    p = out_shape[-1]
    E = tirx.expr
    i0, i1, i2, i3, i4 = body.indices

    def part(e: Any, kind: Any) -> bool:  # v3 // p or v3 % p
        return isinstance(e, kind) and e.a.same_as(v[3]) and isinstance(e.b, E.IntImm) and int(e.b.value) == p

    ok = part(i0, E.FloorDiv) and part(i4, E.FloorMod) and all(a.same_as(b) for a, b in zip((i1, i2, i3), v))
    return p if ok else None


def folded_pack(src_shape: list[int], perm: list[tuple[int, int | None]], out_shape: list[int],
                dtype: str, lanes: int, parallel: bool) -> Any:
    """Rule 2's PrimFunc: ``Wp[P, a0, a1, a2, r] = W[g(a0, a1, a2, P*p + r)]`` (``perm`` = ``g``
    as :func:`_permutation` gives it), scheduled in rule 2's loop order."""
    from tvm import s_tir, te, tirx

    p = out_shape[-1]
    w = te.placeholder([tirx.IntImm("int64", d) for d in src_shape], dtype, name="w")

    def value(P: Any, a0: Any, a1: Any, a2: Any, r: Any) -> Any:
        t_idx = [a0, a1, a2, P * p + r]
        return w[tuple(t_idx[k] if c is None else c - t_idx[k] for k, c in perm)]

    packed = te.compute([tirx.IntImm("int64", d) for d in out_shape], value, name="packed")
    sch = s_tir.Schedule(te.create_prim_func([w, packed]))
    blk = sch.get_sblock("packed")
    P, a0, a1, a2, r = sch.get_loops(blk)
    strides = [1] * len(src_shape)
    for k in range(len(src_shape) - 2, -1, -1):
        strides[k] = strides[k + 1] * src_shape[k + 1]
    axis_of = {k: s for s, (k, _) in enumerate(perm)}  # output axis of T -> source axis
    order = sorted(range(3), key=lambda k: -strides[axis_of[k]])  # T's axes 0-2, source order
    middle = [(a0, a1, a2)[k] for k in order]
    vec = lanes if lanes > 1 and p % lanes == 0 else 0
    if not vec:
        sch.reorder(P, *middle, r)
    elif strides[axis_of[3]] >= MIN_SOURCE_STRIDE and out_shape[3] % ROW_TILE == 0 and out_shape[3] > ROW_TILE:
        # rule 2's tiles: lanes source rows x ROW_TILE input channels (x the taps) stay in L1
        ro, ri = sch.split(r, factors=[None, vec])
        io, ii = sch.split(a2, factors=[None, ROW_TILE])
        sch.reorder(P, ro, io, *[(a0, a1)[k] for k in order if k != 2], ii, ri)
        sch.vectorize(ri)
    else:
        ro, ri = sch.split(r, factors=[None, vec])
        sch.reorder(P, *middle, ro, ri)
        sch.vectorize(ri)
    if parallel and out_shape[0] > 1:
        sch.parallel(P)
    func = sch.mod["main"].without_attr("global_symbol")
    return func.with_attr("tirx.is_scheduled", True).with_attr("tirx.noalias", True)


def _pack_loops(func: Any) -> tuple[bool, int]:
    """Of the one-block PrimFunc ``func`` (the pack, scheduled for the build's target and
    threads): whether it has a parallel loop, and its vectorised loop's extent (0: none)."""
    from tvm import s_tir, tirx

    sch = s_tir.Schedule(func)
    blocks = sch.get_child_blocks(sch.get_sblock("root"))
    loops = [sch.get(lp) for b in blocks for lp in sch.get_loops(b)]
    vec = [int(lp.extent) for lp in loops if lp.kind == tirx.stmt.ForKind.VECTORIZED and hasattr(lp.extent, "value")]
    return any(lp.kind == tirx.stmt.ForKind.PARALLEL for lp in loops), (vec[0] if vec else 0)


def fold_transposed_packs(mod: Any) -> Any:
    """Rules 1-2 over every Relax function of ``mod``; ``mod`` unchanged when nothing matches or
    :data:`FOLD_TRANSPOSED_PACKS` is off."""
    from tvm import tirx

    if not FOLD_TRANSPOSED_PACKS:
        return mod
    panels = {gv: _panel(f) for gv, f in mod.functions_items()
              if isinstance(f, tirx.PrimFunc) and gv.name_hint.endswith(SUFFIX)}
    panels = {gv: p for gv, p in panels.items() if p}
    return _rewrite(mod, panels) if panels else mod


def _uses(func: Any) -> dict[Any, int]:
    """How many bindings (and the function's body) read each Relax var of ``func``."""
    from tvm import relax

    counts: dict[Any, int] = {}
    exprs = [b.value for blk in func.body.blocks for b in blk.bindings] + [func.body.body]
    for e in exprs:
        for v in relax.analysis.free_vars(e):
            counts[v] = counts.get(v, 0) + 1
    return counts


def _rewrite(mod: Any, panels: dict[Any, int]) -> Any:
    """Rule 2's call rewrite, then dead-code elimination of the transposes left unread."""
    import tvm
    from tvm import relax, tirx
    from tvm.relax.expr_functor import PyExprMutator, mutator

    call_tir = tvm.ir.Op.get("relax.call_tir")
    made: dict[tuple, Any] = {}
    changed = [0]

    @mutator
    class _Folder(PyExprMutator):
        def __init__(self, module: Any) -> None:
            super().__init__(module)
            self.module = module
            self.counts: dict[Any, int] = {}

        def transform(self) -> Any:
            for gv, func in self.module.functions_items():
                if isinstance(func, relax.Function) and isinstance(func.body, relax.SeqExpr):
                    self.counts = _uses(func)
                    self.builder_.update_func(gv, self.visit_expr(func))
            return self.builder_.get()

        def visit_call_(self, call: Any) -> Any:  # noqa: N802 - TVM's method name
            call = self.builder_.normalize(super().visit_call_(call))
            if not isinstance(call, relax.Call) or not call.op.same_as(call_tir) or call.args[0] not in panels:
                return call
            args = call.args[1].fields if isinstance(call.args[1], relax.Tuple) else []
            if len(args) != 1 or not isinstance(args[0], relax.Var) or self.counts.get(args[0], 0) != 1:
                return call
            t = self.lookup_binding(args[0])
            if not isinstance(t, relax.Call) or not t.op.same_as(call_tir):
                return call
            t_args = t.args[1].fields if isinstance(t.args[1], relax.Tuple) else []
            tr = self.module[t.args[0]] if t.args[0] in self.module.functions else None
            perm = _permutation(tr) if isinstance(tr, tirx.PrimFunc) else None
            if perm is None or len(t_args) != 1:
                return call
            src = t_args[0]
            src_shape = [int(d) for d in src.ty.shape.values]
            out_shape = [int(d) for d in call.ty.shape.values]
            dtype = str(call.ty.dtype)
            key = (tuple(src_shape), tuple(perm), tuple(out_shape), dtype, call.args[0])
            if key not in made:
                parallel, lanes = _pack_loops(self.module[call.args[0]])  # as the pack was scheduled
                made[key] = self.builder_.add_func(folded_pack(src_shape, perm, out_shape, dtype, lanes, parallel),
                                                   "fused_transpose" + SUFFIX)
            changed[0] += 1
            return relax.call_tir(made[key], (src,), call.ty)

    out = _Folder(mod).transform()
    if not changed[0]:
        return mod
    return relax.transform.DeadCodeElimination()(out)


__all__ = ["FOLD_TRANSPOSED_PACKS", "fold_transposed_packs", "folded_pack"]
