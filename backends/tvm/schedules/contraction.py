"""CPU rule for one-reduction-block functions: conv2d (direct, NHWC; depthwise and grouped
too), matmul/dense, batch matmul, pooling and global pooling, each with its fused producers
(padding, transposes) and epilogue (bias, batch-norm affine, residual add, activation).

Schedule (the classic register-blocked GEMM applied to the block's own loop nest):

    for outer in parallel(fuse(vec_axis.o, other spatial..., row_axis.o)):   # one output tile
        acc[ni, nj*V] = init                        # accumulator tile, lives in registers
        for r in reduction loops:                   # kh, kw, ci  /  k
            for i in unroll(ni): for j in unroll(nj): for v in vectorize(V):
                acc[i, j*V+v] += a[..i..] * b[..j*V+v..]
        out[tile] = epilogue(acc)                   # bias/affine/add/relu fused here

``vec_axis`` is the output's innermost axis (channels in NHWC, columns of a matmul), split
into ``nj`` vectors of ``V`` lanes; ``row_axis`` is the next spatial axis that has extent > 1
(output width, matmul rows), blocked by ``ni``. The weight panel of one ``vec_axis`` tile
stays in L2 while every row tile streams past it. Producers are materialised and scheduled
as injective loops (a transposed operand becomes contiguous once instead of gathered in the
inner loop).

Applies only when every read of the reduction block either does not use the vector axis or
uses it in its last (contiguous) dimension; otherwise the inner loop would gather, so the
function is left to the next rule.
"""

from __future__ import annotations

from typing import Any

from tvm.s_tir.dlight.cpu.base import CPUScheduleRule

from .injective import schedule_spatial_block
from .threads import worth_parallel
from .vector import const_extent, largest_divisor, vector_lanes

MAX_ACCUMULATORS = 24  # of the 32 AVX-512 vector registers, leave some for operands


def _uses(expr: Any, var: Any) -> bool:
    from tvm.tirx.analysis import undefined_vars

    return any(v.same_as(var) for v in undefined_vars(expr))


class Contraction(CPUScheduleRule):
    """Register-tiled, vectorised, parallel schedule for a single reduction block."""

    def apply(self, func: Any, target: Any, _tunable: bool) -> Any:
        from tvm import s_tir, tirx

        if not isinstance(func, tirx.PrimFunc) or not self.is_target_available(target):
            return None
        try:
            return self._apply(s_tir.Schedule(func), target)
        except Exception:  # a pattern this rule does not handle: leave it to the next rule
            return None

    def _apply(self, sch: Any, target: Any) -> Any:
        found = self._match(sch)
        if found is None:
            return None
        root, red, stmt, loops, s_idx, r_idx, vec_pos = found

        bits = stmt.writes[0].source.dtype.bits
        lanes = vector_lanes(target, bits)
        exts = [const_extent(sch, lp) for lp in loops]
        if any(e is None for e in exts):
            return None

        vec, nj, row_pos, ni = _tile_sizes(exts, s_idx, lanes)

        # Accumulate in a small tile, written back (with the epilogue) per output tile.
        wb = sch.cache_write(red, 0, "local")
        loops = sch.get_loops(red)
        # Split the two register axes.
        v_outer, v_j, v_lane = sch.split(loops[vec_pos], factors=[None, nj, vec])
        spatial_outer = []
        row_inner = None
        for i in s_idx[:-1]:
            if i == row_pos and ni > 1:
                o, row_inner = sch.split(loops[i], factors=[None, ni])
                spatial_outer.append(o)
            else:
                spatial_outer.append(loops[i])
        red_loops = [loops[i] for i in r_idx]
        inner = ([row_inner] if row_inner is not None else []) + [v_j, v_lane]
        order = [v_outer, *spatial_outer, *red_loops, *inner]
        sch.reorder(*order)
        outer = sch.fuse(v_outer, *spatial_outer) if spatial_outer else v_outer
        if worth_parallel(_flops(exts)):  # small kernels: the fork/join costs more (threads.py)
            sch.parallel(outer)

        sch.reverse_compute_at(wb, outer, preserve_unit_loops=True)
        consumers = [b for b in sch.get_child_blocks(root)]
        names_before = {str(sch.get(b).name_hint) for b in consumers}
        self._inline_epilogue(sch, wb)
        if row_inner is not None:
            sch.unroll(row_inner)
        sch.unroll(v_j)
        if vec > 1:
            sch.vectorize(v_lane)
        if red_loops:
            init = sch.decompose_reduction(red, red_loops[0])
            self._vectorize_tail(sch, init, vec)
        self._vectorize_tail(sch, wb, vec)
        # Everything else (padding, transposes, epilogue blocks that did not inline).
        red_name = str(sch.get(red).name_hint)
        for b in sch.get_child_blocks(root):
            name = str(sch.get(b).name_hint)
            if name in (red_name, str(sch.get(wb).name_hint)) or name not in names_before:
                continue
            schedule_spatial_block(sch, b, lanes)
        return sch

    @staticmethod
    def _match(sch: Any) -> tuple | None:
        """The one reduction block with spatial loops first and a vectorisable last output
        axis: (root, block, its statement, loops, spatial loop indices, reduction loop indices,
        the vector loop's index); None when the function is not such a contraction."""
        from tvm import tirx

        root = sch.get_sblock("root")
        blocks = sch.get_child_blocks(root)
        red_blocks = [b for b in blocks
                      if any(iv.iter_type == tirx.IterVar.CommReduce for iv in sch.get(b).iter_vars)]
        if len(red_blocks) != 1:
            return None
        red = red_blocks[0]
        stmt = sch.get(red)
        if len(stmt.writes) != 1 or stmt.init is None:
            return None
        loops = sch.get_loops(red)
        ivs = list(stmt.iter_vars)
        if len(loops) != len(ivs):
            return None
        # Each loop must drive exactly its own block iter (no fused/split loops).
        kinds = ["S" if iv.iter_type == tirx.IterVar.DataPar else "R" for iv in ivs]
        if "S" not in kinds or any(c not in "SR" for c in kinds):
            return None
        s_idx = [i for i, k in enumerate(kinds) if k == "S"]
        r_idx = [i for i, k in enumerate(kinds) if k == "R"]
        if s_idx != list(range(len(s_idx))):  # spatial loops first, as legalized ops are
            return None
        out_region = stmt.writes[0].region
        vec_pos = s_idx[-1]
        vec_var = ivs[vec_pos].var
        if not _uses(out_region[-1].min, vec_var):
            return None
        for read in stmt.reads:
            dims = [_uses(r.min, vec_var) for r in read.region]
            if any(dims[:-1]):
                return None
        return root, red, stmt, loops, s_idx, r_idx, vec_pos

    @staticmethod
    def _inline_epilogue(sch: Any, wb: Any) -> None:
        """Fold the elementwise consumers of the write-back block into it, in order."""
        while True:
            consumers = sch.get_consumers(wb)
            if len(consumers) != 1:
                return
            try:
                sch.reverse_compute_inline(consumers[0])
            except Exception:
                return

    @staticmethod
    def _vectorize_tail(sch: Any, wb: Any, vec: int) -> None:
        loops = sch.get_loops(wb)
        if vec <= 1 or not loops:
            return
        ext = const_extent(sch, loops[-1])
        if ext is not None and ext % vec == 0:
            if ext > vec:
                _, v = sch.split(loops[-1], factors=[None, vec])
                sch.vectorize(v)
            else:
                sch.vectorize(loops[-1])


def _flops(exts: list) -> float:
    """2 x the iteration count of the reduction block (one multiply-add per iteration)."""
    total = 2.0
    for e in exts:
        total *= e
    return total


def _tile_sizes(exts: list, s_idx: list[int], lanes: int) -> tuple[int, int, int | None, int]:
    """Register tile of a contraction: (vector width V, vectors per row nj, the row loop's index,
    rows ni), within MAX_ACCUMULATORS accumulators."""
    vec_pos = s_idx[-1]
    # Vector axis: V lanes x nj vectors.
    e_vec = exts[vec_pos]
    vec = largest_divisor(e_vec, (lanes, lanes // 2, lanes // 4)) if e_vec >= 4 else 1
    if vec < 4:
        vec = 1
    # Row axis: the innermost other spatial loop with extent > 1.
    row_pos = next((i for i in reversed(s_idx[:-1]) if exts[i] > 1), None)
    # Without a row axis (a matrix-vector product, e.g. an LSTM step at batch 1) only the nj
    # vectors give independent FMA chains: 8 of them, not 2 (measured: [1,128]x[128,512]
    # 15.8 -> 2.5 us, one thread).
    nj = largest_divisor(e_vec // vec, (8, 4, 2, 1) if row_pos is None else (2, 1)) if vec > 1 else 1
    ni = 1
    if row_pos is not None:
        budget = max(1, MAX_ACCUMULATORS // nj) if vec > 1 else 8
        cands = tuple(c for c in (8, 7, 6, 5, 4, 3, 2) if c <= budget)
        ni = largest_divisor(exts[row_pos], cands)

    return vec, nj, row_pos, ni
