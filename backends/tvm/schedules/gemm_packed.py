"""CPU rule for matrix products: a packed-B, register-blocked GEMM micro-kernel.

Shapes it is for: one reduction block computing ``C[b.., i, j] += A[b.., i, k] * B[b.., k, j]``
(or ``B[b.., j, k]``: a transposed operand), i.e. ONNX ``MatMul`` / ``Gemm`` (any ``transB``),
batched MatMul (attention's QK^T and PV), and NHWC 1x1 convolutions
``out[n, h, w, co] += x[n, h*s, w*s, ci] * W[0, 0, ci, co]`` (reductions of extent 1 besides
``ci``; rows = output width, (n, h) = batch; on narrow maps rows = (h, w), n = batch:
:func:`_fuse_rows`), with at least 2 x 2 x lanes x rows of FMAs (smaller products stay
with :class:`~backends.tvm.schedules.contraction.Contraction`). An N that is not a multiple of
the vector width (or of half of it) is padded: zero columns in the packed B, only the real
columns written (:func:`_padded_n`). Producers/epilogues (bias, activation, residual add, and
chains that read the result twice such as GELU) are fused as in Contraction.

Schedule (the BLIS/MLAS structure, written as TVM schedule primitives)::

    Bp[b.., j // NR, k, j % NR] = B[..]                  # pack B: one contiguous K x NR panel
                                                          # per NR columns (constant B: done once,
                                                          # at build time - see below)
    for (b.., jo, io) in parallel_if_worth(...):         # jo outer: one B panel stays in L2 while
                                                          #   every row tile streams past it (io
                                                          #   outer when all of B fits L2)
        acc[MR, NR] = 0
        for k in K:                                       # registers: MR x NR/V accumulators
            for i in unroll(MR): for j in unroll(NR/V):
                acc[i, j*V:(j+1)*V] += A[i, k] (broadcast) * Bp[jo, k, j*V:(j+1)*V] (vector load)
        C[tile] = epilogue(acc)

Tile sizes come from the target (:func:`micro_tile`): V fp32 lanes and the register file (32
on AVX-512, 16 on AVX2); among the tiles that divide the output (no bounds checks in the inner
loops) and fit the registers, the one with the most FMAs per load (AVX-512: 4 x 4V for square
sizes; AVX2: 6 x 2V). At least 8 independent FMAs hide the FMA latency (4 cycles x 2 pipes).
On AVX2 matrix products take 6 x 2V with M padded to a multiple of 6, and from K >= 1024 or
N >= 256 read A from a per-call copy packed into 6-row panels ``Ap[.., i // 6, k, i % 6]``
(:func:`micro_tile` rule 6)::

    Ap[b.., i // 6, k, i % 6] = A[b.., i, k]              # zero rows up to a multiple of 6
    for (b.., mc, jo, io) in parallel_if_worth(...):     # mc: ~1 MiB of Ap, when B is too large
        ...                                               #   for rows-outer; else as above
            acc[i, ..] += Ap[b.., io, k, i] (broadcast) * Bp[jo, k, ..] (vector load)

On AVX-512 targets with full-width 512-bit FMAs (two FMA units: Intel server cores, not Zen 4),
products whose packed B does not fit ``ROWS_OUTER_B_BYTES`` take a 12 x 2V tile the same way, M
padded to a multiple of 12 and A packed into 12-row panels (:func:`micro_tile` rule 7).

Constant weights: when B is a parameter of the kernel (a weight after Relax's import), the pack
block is annotated ``meta_schedule.layout_rewrite_preproc``; the pipeline then runs
``SplitLayoutRewritePreproc`` + ``FoldConstant`` (:func:`prepack_passes`), so the packed copy
is computed once at build time and the kernel reads ``Bp`` directly. When B is an activation
(batched attention products), packing runs per call (K x N copies against M x N x K FMAs), as a
vectorised copy (:func:`_schedule_runtime_packs`) unless it is an identity copy, which Relax
turns into a free reshape.

Threads: the outer loop is parallel only when the product has at least
:func:`~backends.tvm.schedules.threads.parallel_min_flops` (below that the fork/join of TVM's
pool costs more than it saves; :mod:`backends.tvm.schedules.threads`), counting the fused
epilogue's operations per output element as work too (``threads.with_epilogue``: a small-K head
with a sigmoid).
"""

from __future__ import annotations

import os
from typing import Any

from tvm.s_tir.dlight.cpu.base import CPUScheduleRule

from .contraction import Contraction, _uses
from .injective import schedule_spatial_block
from .threads import epilogue_ops, with_epilogue, worth_parallel
from .vector import by_cpu, const_extent, fma_datapath_bits, vector_lanes

LAYOUT_REWRITE = "meta_schedule.layout_rewrite_preproc"
# Loop order: when all of the packed B fits this many bytes (the L2 of current server cores:
# Zen 4 1 MiB, Ice Lake-SP 1.25 MiB), row tiles go outermost: B stays in L2, one A tile in L1, and
# C is written row by row. Measured on Zen 4 (thread CPU time, GFLOP/s rows-outer vs
# panels-outer): 512x128x1000 88 vs 73, 512x512x128 105 vs 100, 512^3 101 vs 102, but 2048^3
# 78 vs 105 (B 16 MiB streamed from L3 per row tile), hence the bound.
ROWS_OUTER_B_BYTES: int | None = 1 << 20
#: the bound by LLVM ``mcpu`` where it differs (:func:`_rows_outer`). Zen 5 (``znver5``, 1 MiB of L2
#: per core): 512 KiB, half the L2, so that A's and C's tiles fit beside B. Measured there (session
#: 28, ``benchmarks/gemm.py --variant``, 1 thread, median of 9 interleaved rounds, rule 7 off, ms,
#: rows outer / panels outer): 512^3 (B 1 MiB) 1.150 / 1.048 and 1.318 / 1.133 in a second run (ORT
#: 1.052, 1.234); B of 64-512 KiB within 1-4% either way (256^3, 512x128x512, 512x512x128,
#: 512x128x1000; ``benchmarks/results/session28_zen5/gemm_sweep4.json``, ``gemm_sweep5.json``)
ROWS_OUTER_B_BYTES_BY_CPU: dict[str, int | None] = {"znver5": 1 << 19}
#: 1x1 convs on narrow maps take (h, w) as the GEMM's rows (:func:`_fuse_rows`); off: one output row
FUSE_NARROW_ROWS = True
#: inline producers that copy a buffer unchanged (:func:`_inline_identity_copies`); off: keep the copy
INLINE_IDENTITY_COPIES = True
#: N that no vector width divides (8210 classes): pad it in the packed B (:func:`_padded_n`); off:
#: such GEMMs go to Contraction
PAD_N = True
#: 1x1 convs with such an N too (their input read through a reindexed copy, :func:`_pack_b`)
PAD_POINTWISE_CONV = True
#: M = 1-3 takes an M-row tile (:func:`micro_tile` rule 4); off: the 8-row partial tile
SMALL_M_TILE = True
#: 16 vector registers (AVX2): prefer the tile with more rows on a tie (:func:`micro_tile` rule 5);
#: off: fewer rows, as on AVX-512
TALL_TILE_16_REGISTERS = True
#: packing functions that run per call (B an activation) get a vectorised, parallel schedule
#: (:func:`_schedule_runtime_packs`); off: TVM's serial scalar copy
SCHEDULE_RUNTIME_PACKS = True
#: 16 vector registers (AVX2): the 6 x 2-vector tile with M padded to a multiple of 6 and A packed
#: into 6-row panels (:func:`micro_tile` rule 6); off: A read in place, rules 1-5's tile
PACK_A_16_REGISTERS = os.environ.get("PARTITIONER_GEMM_PACK_A", "1") != "0"
#: rows of the packed-A tile (BLIS/MLAS's 6 on AVX2: 12 accumulators + 2 B vectors + 1 broadcast)
PACK_A_ROWS = 6
#: bytes of packed A per M block when B is too large for rows-outer (:func:`_a_block_tiles`); 0: no
#: M blocking (B panels outermost, all of A streamed past each)
PACK_A_BLOCK_BYTES = int(os.environ.get("PARTITIONER_GEMM_PACK_A_BLOCK_BYTES", str(1 << 20)))
#: smallest M, N and K for which the 6-row tile is taken (below: :func:`micro_tile`'s)
PACK_A_MIN = (12, 16, 16)
#: smallest K, and smallest N, from which A is packed into panels (:func:`_packs_a`); below both
#: the 6-row tile reads A in place, and only when 6 divides M
PACK_A_MIN_K = int(os.environ.get("PARTITIONER_GEMM_PACK_A_MIN_K", "1024"))
PACK_A_MIN_N = int(os.environ.get("PARTITIONER_GEMM_PACK_A_MIN_N", "256"))
#: 32 vector registers of 512 bits with a full-width 512-bit FMA datapath (two 512-bit FMA units:
#: Intel server cores): the packed-A tile of :func:`micro_tile` rule 7 (``PACK_A_TILE_32``) with M
#: padded to its rows; off (env ``PARTITIONER_GEMM_PACK_A_32=0``): rules 1-5's tile with A in place
#: (MLAS's AVX-512 block: 24 accumulators + 2 B vectors + 1 broadcast = 27 registers; 24 FMAs per
#: 2 vector loads and 12 broadcasts). Why: with two FMA ports a k step of the 4 x 4 tile lasts 8
#: cycles and reads a 256-byte B row of a panel that lives in L2 (32 bytes/cycle); 12 x 2 reads 128
#: bytes of B per 12 cycles. Rows-outer products (B in L2, one A tile in L1) keep rules 1-5: there
#: 12 x 2 with packed A lost (512^3 1.10x, 480x256x256 1.15x against 6 x 4 in place). Measured on
#: an Intel Xeon (Sapphire-Rapids class, LLVM host cpu ``rocketlake``, 1 thread, thread CPU time,
#: median of 15 interleaved rounds, load 6.5 on 2 cores; rule 7 / off / ORT, ms): 1024^3 26.0 /
#: 29.2 / 28.8, 2048^3 188 / 203 / 239 (``benchmarks/results/session18_intel/gemm18/
#: ab_rule7_1t.json``). 14 x 2 (28 accumulators) lost to 12 x 2 (1.03x, 1.15x), 6 x 4 with packed
#: A did not beat 4 x 4; k blocking (a kc x NR block of B kept in L1) lost 1.02-2x in four variants
#: (docs/gemm.md, session 18).
PACK_A_32_REGISTERS = os.environ.get("PARTITIONER_GEMM_PACK_A_32", "1") != "0"
#: rule 7 off by LLVM ``mcpu`` (``vector.by_cpu``; ``PACK_A_32_REGISTERS`` off turns it off
#: everywhere). Zen 5 (``znver5``, two
#: 512-bit FMA pipes): off, rules 1-5's tile (4 x 4 vectors, A in place). Measured there (session 28,
#: ``benchmarks/gemm.py --variant``, 1 thread, median of 9 interleaved rounds, ms, rule 7 / off /
#: ORT): 1024^3 10.18 / 8.35 / 8.80, 2048^3 75.8 / 67.6 / 72.6 (92-93% of the 258-273 GFLOP/s
#: peak against 77-82%; ``benchmarks/results/session28_zen5/gemm_sweep4.json``); 6 x 4 with packed
#: A 9.75 ms on 1024^3 (``gemm_sweep2.json``)
PACK_A_32_BY_CPU: dict[str, bool] = {"znver5": False}
#: (rows, vectors) of rule 7's tile: 12 x 2 vectors = 24 accumulators + 2 B vectors + 1 broadcast
PACK_A_TILE_32 = (12, 2)
#: matrix products (one reduction) whose N is not a multiple of 16, on full-width 512-bit FMA
#: targets: N padded to full 16-lane vectors (:func:`_plan`) instead of half-width 8-lane vectors,
#: which run at half the FMA peak there (a 256-bit FMA does half the work per cycle; on Zen 4 it
#: is as fast per cycle, hence the half width there). Shapes: gpt's 1000-class head
#: (512x128x1000 at batch 8), projections with N = 8 mod 16. Off (env
#: ``PARTITIONER_GEMM_PAD_N_512=0``): half-width vectors as on Zen 4. 1x1 convolutions keep them.
PAD_N_FULL_WIDTH_512 = os.environ.get("PARTITIONER_GEMM_PAD_N_512", "1") != "0"



def micro_tile(lanes: int, m: int, n: int, registers: int) -> tuple[int, int] | None:
    """(MR, NR) register tile for ``lanes`` fp32 lanes per vector, an ``m`` x ``n`` output and a
    file of ``registers`` vector registers; None when ``n`` is not a multiple of ``lanes``.

    Rules:
    1. Candidates: MR rows (a divisor of ``m``) x NV vectors (a divisor of N/lanes, <= 6) whose
       MR x NV accumulators + NV B vectors + 1 broadcast fit the registers, with at least 8
       accumulators (FMA latency 4 cycles x 2 pipes) when the output has that many vectors.
    2. The winner has the most FMAs per load, MR·NV / (MR + NV) (each k step loads MR broadcasts
       and NV vectors for MR·NV FMAs), then the most accumulators, then the fewest rows (the A
       rows are K floats apart; fewer streams alias less in L1). On AVX-512 that is 4 x 4
       vectors for square sizes (measured on Zen 4, thread CPU time, 512^3..2048^3: 99-103
       GFLOP/s against 98-102 for 8 x 2), 6 x 4 when 6 divides M; on AVX2 6 x 2 (BLIS/MLAS's
       6 x 16).
    3. No divisor of ``m`` qualifies (a prime M): MR = min(8, max) with NV = 2 (or 1), and the
       last row tile is partial (a predicate on its rows): correct, but such tiles ran 30-50%
       slower, hence rule 1 first.
    4. Tiny M (a batch-1 classifier head, M = 1-3, where M x the widest NV < 8): rule 1 asks
       only for M x widest NV accumulators, so the tile is all M rows x the widest NV instead
       of rule 3's 8-row tile with 7 rows predicated off in the k loop (``SMALL_M_TILE``).
       Such products stream B once and are bound by memory, not by FMA latency.
    5. 16 registers (AVX2): rule 2's last tie-break is inverted, the most rows first
       (``TALL_TILE_16_REGISTERS``). For a power-of-two M, where 6 x 2 vectors does not divide,
       the tie is 2 x 4 against 4 x 2 vectors (8 accumulators, 1.33 FMAs per load each).
       4 x 2 reads a 64-byte B panel row per k step, not 128. Measured on Zen 3 (``znver3``,
       1 thread, thread CPU time, median of 7 interleaved rounds, 4 x 2 / 2 x 4, ms): 512^3
       4.87 / 6.78, 1024^3 39.1 / 43.1, 512x128x128 0.299 / 0.317.
    6. 16 registers (AVX2), matrix products (one reduction) with N a multiple of 2 vectors and
       M >= 12: the caller (:func:`_pack_a_plan`) replaces this tile by BLIS/MLAS's 6 x 2
       vectors (12 accumulators + 2 B vectors + 1 broadcast = 15 registers, 12 FMAs per 8 loads
       against 8 per 6 for 4 x 2), M padded to a multiple of 6 (zero rows, only the real rows
       written). From K >= ``PACK_A_MIN_K`` (1024) or N >= ``PACK_A_MIN_N`` (256) A is copied per
       call into 6-row panels ``Ap[.., i // 6, k, i % 6]`` (:func:`_pack_a`) that the k loop reads
       as one sequential stream: read in place, the 6 rows are K floats apart, at K = 1024 all in
       one L1 set, and the unpacked 6 x 2 tile took 72.8 ms on 1024^3 (session 16). Below both, the
       tile reads A in place and only when 6 divides M (a padded copy of A cost as much as the
       tile saved: 512x512x128 1.03-1.07x). When B is too large for rows-outer, M blocks of ~1 MiB
       of packed A (:func:`_a_block_tiles`) go outermost and every B panel streams past each
       (2048^3: 16 MiB of packed A streamed past each panel ran at 35-44 GFLOP/s, M blocks of
       96-342 rows at 61-70). The inner loop is 12 FMAs per k with 2 B loads and 6 broadcasts,
       no spills (checked in the znver3 asm). ``PACK_A_16_REGISTERS`` (env
       ``PARTITIONER_GEMM_PACK_A=0``): off, rules 1-5's tile with A in place. Measured on Zen 3
       (``znver3``, 1 thread, thread CPU time, median of 15 interleaved rounds, load 3.4-3.6 on
       2 cores; rule 6 / off / ORT, ms): 512^3 4.80 / 5.17 / 4.45, 1024^3 35.0 / 39.1 / 38.1,
       2048^3 272 / 395 / 352, 512x128x512 1.28 / 1.37 / 1.23; 512x128x128 and 512x512x128 keep
       the old tile (1.00x, 0.99x). ``benchmarks/results/session17_avx2/gemm_pack_a_ab.json``.
    7. 32 registers of 512 bits on a target whose 512-bit FMA runs at full width (two 512-bit FMA
       units, Intel server cores; not ``vector.HALF_WIDTH_AVX512_CPUS``, i.e. not Zen 4), matrix
       products whose packed B does not fit ``ROWS_OUTER_B_BYTES`` (panels outer: 1024^3,
       2048^3, large-N projections), N a multiple of 2 vectors, M >= 12: the caller
       (:func:`_pack_a_plan`) replaces this tile by ``PACK_A_TILE_32`` = 12 x 2 vectors, M padded
       to a multiple of 12 and A packed into 12-row panels exactly as rule 6. Why, measured, and
       what lost: the comment of ``PACK_A_32_REGISTERS``. Not on the CPUs ``PACK_A_32_BY_CPU``
       turns off: Zen 5 (``znver5``), where rules 1-5's 4 x 4 tile with A in place, panels outer
       from 512 KiB of B (``ROWS_OUTER_B_BYTES_BY_CPU``), measured 89-94% of peak on 512^3 to
       2048^3 against 76-83% with this rule and the 1 MiB rows-outer bound."""
    if n % lanes != 0:
        return None
    vectors = n // lanes
    tall = TALL_TILE_16_REGISTERS and registers <= 16  # rule 5
    best: tuple[tuple[float, int, int], int, int] | None = None
    # FMAs in flight the output allows: 8 (rule 1), fewer when M is tiny (rule 4)
    widest = max(d for d in range(1, min(6, vectors) + 1) if vectors % d == 0)
    need = min(8, m * vectors) if SMALL_M_TILE is False else min(8, m * vectors, m * widest)
    for nv in range(1, min(6, vectors) + 1):
        if vectors % nv:
            continue
        max_rows = (registers - nv - 1) // nv
        for mr in range(1, min(max_rows, m) + 1):
            if m % mr or mr * nv < need:
                continue
            key = (mr * nv / (mr + nv), mr * nv, mr if tall else -mr)
            if best is None or key > best[0]:
                best = (key, mr, nv)
    if best is not None:
        return best[1], best[2] * lanes
    nv = 2 if vectors % 2 == 0 else 1
    return min(8, (registers - nv - 1) // nv), nv * lanes


class GemmPacked(CPUScheduleRule):
    """Packed-B register-blocked GEMM (module docstring: which shapes, which schedule)."""

    def apply(self, func: Any, target: Any, _tunable: bool) -> Any:
        from tvm import s_tir, tirx

        if not isinstance(func, tirx.PrimFunc) or not self.is_target_available(target):
            return None
        try:
            return self._apply(s_tir.Schedule(func), func, target)
        except Exception:  # a pattern this rule does not handle: leave it to the next rule
            return None

    def _apply(self, sch: Any, func: Any, target: Any) -> Any:
        from tvm import tirx

        root = sch.get_sblock("root")
        red = _float32_reduction(sch, root)
        if red is None:
            return None
        _inline_identity_copies(sch, red)  # a 1x1 conv's pad_temp with no padding: a full copy
        stmt = sch.get(red)
        ivs = list(stmt.iter_vars)
        loops = sch.get_loops(red)
        if len(loops) != len(ivs) or len(ivs) < 3:
            return None
        kinds = ["S" if iv.iter_type == tirx.IterVar.DataPar else "R" for iv in ivs]
        ns = kinds.count("S")
        # spatial loops first, then reductions; all reductions but the last must have extent 1
        # (a 1x1 convolution's kh, kw), checked below once the extents are known
        if ns < 2 or kinds != ["S"] * ns + ["R"] * (len(kinds) - ns) or ns == len(kinds):
            return None
        vi, vj, vk = ivs[ns - 2].var, ivs[ns - 1].var, ivs[-1].var
        out = stmt.writes[0]
        if not (_uses(out.region[-1].min, vj) and _uses(out.region[-2].min, vi)):
            return None
        b_idx, b_transposed = _operand_roles(stmt, out, vi, vj, vk) or (None, False)
        if b_idx is None:
            return None

        exts = [const_extent(sch, lp) for lp in loops]
        if any(e is None for e in exts) or any(e != 1 for e in exts[ns:-1]):
            return None
        k, n = exts[-1], exts[ns - 1]
        plan, n_pad = _plan(target, exts, ns)
        if plan is None:
            return None
        fuse_rows = None if n_pad else _fuse_rows(target, exts, ns, plan)
        a_plan = None if fuse_rows else _pack_a_plan(target, plan, exts, ns, n_pad)
        lanes, mr, nr, flops = a_plan or fuse_rows or plan

        b_buf = stmt.reads[b_idx].source
        b_is_param = any(p.same_as(b_buf) for p in func.params)
        # 1. pack B into panels Bp[.., j // nr, k, j % nr] (zero columns up to n_pad)
        padding, a_src = _padding(stmt, b_idx, exts, ns, (mr, nr, n_pad), a_plan is not None)
        pack = _pack_b(sch, red, b_idx, nr, b_transposed, padding)
        if b_is_param:
            sch.annotate(pack, LAYOUT_REWRITE, True)
        a_pack = None if a_src is None or not _packs_a(n_pad or n, k) else _pack_a(sch, red, a_src, mr)
        # 2. accumulators + tiling (the epilogue counted before cache_write adds its copy block)
        ops = epilogue_ops(sch, red)
        wb = sch.cache_write(red, 0, "local")
        if fuse_rows is not None:  # a 1x1 conv on a narrow map: rows = h x w (see _fuse_rows)
            sch.fuse(*sch.get_loops(red)[ns - 3:ns - 1])
            ns -= 1
        loops = sch.get_loops(red)
        b_loops, li, lj, unit_r, lk = loops[:ns - 2], loops[ns - 2], loops[ns - 1], loops[ns:-1], loops[-1]
        io, ii = sch.split(li, factors=[None, mr])
        jo, jj, jv = sch.split(lj, factors=[None, nr // lanes, lanes])
        tiles = _tile_loops(sch, io, jo, k, k * n * 4, mr if a_pack is not None else 0, target)
        sch.reorder(*b_loops, *tiles, *unit_r, lk, ii, jj, jv)
        outer = sch.fuse(*b_loops, *tiles)
        if worth_parallel(with_epilogue(flops, ops, flops / (2.0 * k))):  # work incl. the epilogue
            sch.parallel(outer)
        sch.reverse_compute_at(wb, outer, preserve_unit_loops=True)
        names_before = {str(sch.get(b).name_hint) for b in sch.get_child_blocks(root)}
        Contraction._inline_epilogue(sch, wb)
        for lp in (ii, jj):
            sch.unroll(lp)
        sch.vectorize(jv)
        init = sch.decompose_reduction(red, unit_r[0] if unit_r else lk)
        Contraction._vectorize_tail(sch, init, lanes)
        Contraction._vectorize_tail(sch, wb, lanes)

        # 3. the pack block and other producers: plain parallel/vectorised copies
        skip = {str(sch.get(b).name_hint) for b in (red, wb, init)} | _schedule_a_pack(sch, a_pack, flops)
        if b_is_param:
            skip.add(str(sch.get(pack).name_hint))  # folded at build time
        for blk in sch.get_child_blocks(root):
            name = str(sch.get(blk).name_hint)
            if name not in skip and name in names_before:
                schedule_spatial_block(sch, blk, lanes)
        return sch


def _plan(target: Any, exts: list[int], ns: int) -> tuple[tuple[int, int, int, float] | None, int | None]:
    """The register tile (:func:`_register_tile`) and, when N had to be padded for it, the padded
    N (:func:`_padded_n`), else None.

    Last resort, a whole 4-vector panel: a tiny-M product whose padded N still gives fewer than
    4 accumulators (a batch-1 head with 100 classes: 1 row x 13 half-width vectors, widest NV 1)
    pads N to a multiple of 4 full vectors (100 -> 128): such GEMVs read B once and are bound
    by memory; the Contraction rule ran heldout_mbv2's 1x640x100 head at ~6 GFLOP/s."""
    plan = _register_tile(target, exts, ns)
    if plan is not None or not PAD_N:
        return plan, None
    lanes, n = vector_lanes(target, 32), exts[ns - 1]
    # full-width 512-bit FMA (PAD_N_FULL_WIDTH_512): _padded_n's half-vector rounding (24 stays 24)
    # gives no tile at 16 lanes; the next whole vector (32) before a whole 4-vector panel (64)
    whole = [-(-n // lanes) * lanes] if _pads_to_full_vectors(target, exts, ns) else []
    for n_pad in (_padded_n(lanes, n), *whole, -(-n // (4 * lanes)) * 4 * lanes):
        plan = _register_tile(target, exts[:ns - 1] + [n_pad] + exts[ns:], ns)
        if plan is not None:
            return plan, n_pad
    return None, None


def _padded_n(lanes: int, n: int) -> int:
    """N rounded up for the register tile, for an N that no vector width divides.

    Shapes it is for: classifier heads and projections whose N is not a multiple of 8 (an OCR
    model's 8210 classes, magika's 113, a 10-class head): without it they went to the
    Contraction rule, which ran them ~10x slower than ONNX Runtime. The packed B gets zero
    columns up to the padded N (at build time for a constant weight), the kernel computes the
    padded tile, and the write-back stores only the real columns (a predicate there, not in the
    k loop). Measured (loaded machine, 1 thread, thread CPU time, ours padded / unpadded / ORT,
    ms): 32x1024x8210 6.4 / 69.9 / 6.7, 64x256x1002 0.34 / 3.37 / 0.32, 256x256x113
    0.156 / 1.42 / 0.159, 256x256x50 0.078 / 0.59 / 0.083, 256x256x20 0.032 / 0.061 / 0.045,
    64x128x10 0.004 / 0.015 / 0.008: padding paid even at 60% wasted columns.

    Rules: 1. the widest panel whose padding wastes at most N/16 of the FLOPs (4, 2, then 1
    full vectors: 8210 -> 8256 keeps the 4 x 4-vector tile, 1002 -> 1024); 2. otherwise (small
    N) the next multiple of half the vector width on AVX-512 (a 256-bit half is as fast per cycle
    on Zen 4; 20 -> 24, 10 -> 16), of the vector width on narrower targets."""
    for width in (4 * lanes, 2 * lanes, lanes):
        n_pad = -(-n // width) * width
        if (n_pad - n) * 16 <= n:
            return n_pad
    step = lanes // 2 if lanes >= 16 else lanes
    return -(-n // step) * step


def _pack_b(sch: Any, red: Any, b_idx: int, nr: int, transposed: bool, padding: list[int] | None) -> Any:
    """The block that writes B packed as ``Bp[.., j // nr, k, j % nr]``: a copy of B
    (``cache_read``), or with ``padding`` (per block iter) TVM's ``pad_einsum`` producer, which
    also pads the output and adds the block that writes back its real columns."""
    b_src = sch.get(red).reads[b_idx].source
    rank = len(sch.get(red).reads[b_idx].region)
    if padding is None:
        pack = sch.cache_read(red, b_idx, "global")
    else:
        # a 1x1 conv reads x[n, h + kh, w + kw, ci], not an einsum index: read it through a
        # reindexed copy (pure block vars) for pad_einsum, then inline that copy back. A conv's
        # input has fewer dims than block iters - 1 (its unit kh, kw); a matmul's A has exactly that
        out = sch.get(red).writes[0].source
        copies = [sch.reindex(red, ("read", i)) for i, r in enumerate(sch.get(red).reads)
                  if PAD_POINTWISE_CONV and len(padding) > len(r.region) + 1
                  and not r.source.same_as(b_src) and not r.source.same_as(out)]
        sch.pad_einsum(red, padding)
        for blk in copies:
            sch.compute_inline(blk)
        pack = _producer_or_copy(sch, red, b_src)
    sch.transform_layout(pack, ("write", 0), _pack_map(rank, nr, transposed=transposed))
    return pack


def _producer_or_copy(sch: Any, red: Any, src: Any) -> Any:
    """The producer of ``red`` that reads ``src`` (a ``pad_einsum`` pad block), or a new
    ``cache_read`` copy of it when ``src`` was not padded."""
    pack = next((p for p in sch.get_producers(red) if any(r.source.same_as(src) for r in sch.get(p).reads)), None)
    if pack is not None:
        return pack
    idx = next(i for i, r in enumerate(sch.get(red).reads) if r.source.same_as(src))
    return sch.cache_read(red, idx, "global")


def _pack_a_plan(target: Any, plan: tuple[int, int, int, float], exts: list[int], ns: int, n_pad: int | None) -> tuple[int, int, int, float] | None:
    """The packed-A register tile (lanes, rows, columns, FLOPs) of :func:`micro_tile` rule 6 (16
    registers: 6 x 2 vectors) or rule 7 (32 registers, full-width 512-bit FMA:
    ``PACK_A_TILE_32``) for a matrix product, or None (``plan``'s tile stays)."""
    lanes, _, _, flops = plan
    m, n, k = exts[ns - 2], n_pad or exts[ns - 1], exts[-1]
    if len(exts) - ns != 1:
        return None
    if lanes == 8 and PACK_A_16_REGISTERS:
        rows, nv = PACK_A_ROWS, 2
    elif (lanes == 16 and PACK_A_32_REGISTERS and by_cpu(PACK_A_32_BY_CPU, target, True)
          and _full_width_512_fma(target) and not _rows_outer(k * n * 4, target)):
        rows, nv = PACK_A_TILE_32
    else:
        return None
    if n % (nv * lanes) or m < max(PACK_A_MIN[0], rows) or n < PACK_A_MIN[1] or k < PACK_A_MIN[2]:
        return None
    if not _packs_a(n, k) and m % rows:
        return None  # A read in place would need a padded row-major copy: no better than the old tile
    return lanes, rows, nv * lanes, flops


def _full_width_512_fma(target: Any) -> bool:
    """Whether the target's 512-bit FMAs run at full width (:func:`vector.fma_datapath_bits`: not
    on ``vector.HALF_WIDTH_AVX512_CPUS``, i.e. not Zen 4)."""
    return fma_datapath_bits(target) >= 512


def _packs_a(n: int, k: int) -> bool:
    """Whether the 6-row tile reads A from 6-row panels (else in place): from ``PACK_A_MIN_K``
    (A's rows 4 KiB apart alias in L1) or ``PACK_A_MIN_N`` (the copy amortised over N / 16 panels)."""
    return k >= PACK_A_MIN_K or n >= PACK_A_MIN_N


def _pack_a(sch: Any, red: Any, a_src: Any, mr: int) -> Any:
    """The block that writes A packed as ``Ap[.., i // mr, k, i % mr]`` (rows padded to a
    multiple of ``mr`` by ``pad_einsum`` already): the micro-kernel reads mr floats per k step
    from one sequential stream instead of mr rows K floats apart."""
    from tvm import tirx

    pack = _producer_or_copy(sch, red, a_src)

    def f(*idx):
        *lead, i, kk = idx
        return (*lead, tirx.floordiv(i, mr), kk, tirx.floormod(i, mr))

    rank = len(sch.get(pack).writes[0].region)
    imap = tirx.IndexMap.from_func(f, ndim=rank)
    sch.transform_layout(pack, ("write", 0), imap)
    sch.transform_block_layout(pack, imap)
    return pack


def _a_block_tiles(row_tiles: int, k: int, rows: int = PACK_A_ROWS) -> int | None:
    """Row tiles per M block of the packed-A schedule (:func:`micro_tile` rule 6): the largest divisor of
    ``row_tiles`` whose A block (tiles x PACK_A_ROWS x K floats) is at most 2 x
    ``PACK_A_BLOCK_BYTES``, if that block is at least half of it; else None (no M blocking)."""
    if not PACK_A_BLOCK_BYTES:
        return None
    tile_bytes = rows * k * 4
    best = max(d for d in range(1, row_tiles + 1) if row_tiles % d == 0 and d * tile_bytes <= 2 * PACK_A_BLOCK_BYTES) \
        if tile_bytes <= 2 * PACK_A_BLOCK_BYTES else 0
    if best * tile_bytes * 2 < PACK_A_BLOCK_BYTES or best >= row_tiles:
        return None
    return best


def _schedule_a_pack(sch: Any, pack: Any, flops: float) -> set[str]:
    """Loops (.., panel, k, row in panel): the row loop unrolled (6 sequential stores per k),
    the outer loops fused and parallel when the product is worth threads; the block's name (an
    empty set for no pack)."""
    if pack is None:
        return set()
    loops = sch.get_loops(pack)
    sch.unroll(loops[-1])
    outer = sch.fuse(*loops[:-2]) if len(loops) > 3 else loops[0]
    if worth_parallel(flops):
        sch.parallel(outer)
    return {str(sch.get(pack).name_hint)}


def _padding(stmt: Any, b_idx: int, exts: list[int], ns: int, tile: tuple[int, int, int | None], six_rows: bool) -> tuple[list[int] | None, Any]:
    """``pad_einsum``'s padding per block iter (None: nothing to pad) and, for :func:`micro_tile`
    rule 6's tile (``six_rows``), A's buffer (else None): N up to ``n_pad``, and with the 6-row
    tile M up to a multiple of 6."""
    mr, nr, n_pad = tile
    if not six_rows:
        return (None if n_pad is None else [1] * (ns - 1) + [nr] + [1] * (len(exts) - ns)), None
    out = stmt.writes[0].source
    a_src = next(r.source for i, r in enumerate(stmt.reads) if i != b_idx and not r.source.same_as(out))
    padding = [1] * (ns - 2) + [mr if exts[ns - 2] % mr else 1] + [nr if n_pad else 1] + [1]
    return (padding if any(p != 1 for p in padding) else None), a_src


def _tile_loops(sch: Any, io: Any, jo: Any, k: int, b_bytes: int, packed_a: int,
                target: Any = None) -> tuple[Any, ...]:
    """The row-tile and panel loops, outermost first: rows outer when all of B fits
    ``ROWS_OUTER_B_BYTES``; else panels outer, or with packed A (:func:`micro_tile` rule 6) M
    blocks of :func:`_a_block_tiles` row tiles outermost, every B panel streamed past each."""
    if _rows_outer(b_bytes, target):
        return io, jo
    block = _a_block_tiles(const_extent(sch, io), k, packed_a) if packed_a else None
    if block is None:
        return jo, io
    imc, iin = sch.split(io, factors=[None, block])
    return imc, jo, iin


def _rows_outer(b_bytes: int, target: Any = None) -> bool:
    """Whether a packed B of ``b_bytes`` fits ``ROWS_OUTER_B_BYTES`` (row tiles outermost;
    ``ROWS_OUTER_B_BYTES_BY_CPU``'s bound on the CPUs it names)."""
    bound = by_cpu(ROWS_OUTER_B_BYTES_BY_CPU, target, ROWS_OUTER_B_BYTES)
    return bound is not None and b_bytes <= bound


def _pads_to_full_vectors(target: Any, exts: list[int], ns: int) -> bool:
    """``PAD_N_FULL_WIDTH_512``: a matrix product (one reduction) on a full-width 512-bit FMA
    target pads N to 16-lane vectors instead of taking 8-lane ones."""
    return PAD_N_FULL_WIDTH_512 and len(exts) - ns == 1 and _full_width_512_fma(target)


def _register_tile(target: Any, exts: list[int], ns: int) -> tuple[int, int, int, float] | None:
    """(vector lanes, tile rows, tile columns, FLOPs) for the GEMM with spatial extents
    ``exts[:ns]`` and reduction ``exts[-1]``; None when it is too small for a register tile
    (Contraction handles it)."""
    m, n, k = exts[ns - 2], exts[ns - 1], exts[-1]
    lanes = vector_lanes(target, 32)
    registers = 32 if lanes >= 16 else 16  # AVX-512 has 32 vector registers, AVX2 16
    if n % lanes != 0 and lanes >= 16 and not _pads_to_full_vectors(target, exts, ns):
        # e.g. N = 1000 on AVX-512: half-width vectors (on Zen 4 as fast per cycle, as its
        # 512-bit FMA is two 256-bit halves; on 2x512-bit Intel parts half the peak). Not on
        # AVX2: a 128-bit FMA is half of a 256-bit one's work per cycle, so such N is padded to
        # 8 lanes instead (:func:`_padded_n`; session 16, once vector.py rule 1 gave AVX2 its 8
        # lanes: before, AVX2 targets were sized as AVX-512 and this branch never saw 8 lanes).
        # Matrix products on full-width 512-bit FMA targets pad N instead (PAD_N_FULL_WIDTH_512)
        lanes //= 2
    tile = micro_tile(lanes, m, n, registers)
    if tile is None:
        return None
    mr, nr = tile
    batch = 1
    for e in exts[:ns - 2]:
        batch *= e
    if m * n * k < 2 * 2 * lanes * 4 or mr * (nr // lanes) < 4:
        return None
    return lanes, mr, nr, 2.0 * batch * m * n * k


def _fuse_rows(target: Any, exts: list[int], ns: int, plan: tuple[int, int, int, float]) -> tuple[int, int, int, float] | None:
    """The register tile with the output's two row axes fused into one, when that tile has more
    FMAs per load than ``plan``'s; else None.

    Shapes it is for: NHWC 1x1 convolutions (unit kh/kw reductions, spatial (n, h, w, co)) on
    narrow maps, where the rows of the GEMM are one output row of ``w`` pixels: on a 2x2 map
    (ResNet-50's last stage at 64 px) that allows only 2-row tiles, 2 x 4 vectors = 1.33 FMAs per
    load, against 4 x 4 = 2.0 with the 4 pixels of the map as rows. The fused row index
    ``f`` maps back to ``(f // w, f % w)``; the division is computed once per row tile, outside
    the k loop. Only tiles of whole output rows (``w`` divides the tile's rows): a tile that
    straddles a row boundary (8 rows of a 28-wide map) computed wrong values (checked: TVM
    0.27, N = 24 on a 28x28 map), and wide maps have good tiles without fusing anyway. Matrix products (no unit reductions) are never fused (their batch axes index B)."""
    if not FUSE_NARROW_ROWS or ns < 4 or len(exts) - ns < 2 or exts[ns - 3] <= 1:
        return None
    lanes, mr, nr, _ = plan
    fused = exts[:ns - 3] + [exts[ns - 3] * exts[ns - 2]] + exts[ns - 1:]
    alt = _register_tile(target, fused, ns - 1)
    if alt is None or alt[0] != lanes or alt[1] % exts[ns - 2]:
        return None
    nv, alt_nv = nr // lanes, alt[2] // lanes
    if alt[1] * alt_nv / (alt[1] + alt_nv) <= mr * nv / (mr + nv):
        return None
    return alt


def _inline_identity_copies(sch: Any, red: Any) -> None:
    """Inline the producers of ``red`` that copy a buffer element for element (same shape, same
    indices): TOPI's ``conv2d_nhwc`` always builds ``pad_temp``, which for a 1x1 conv without
    padding is a copy of the whole input, written and read back per call (mobilenet's 1x1 convs
    with 16-32 input channels at batch 8 spent about as long in that copy as in the GEMM).
    Inlined, the GEMM reads the input directly; other producers (transposes, real padding) stay
    materialised as before."""
    from tvm import tirx

    for blk in sch.get_producers(red) if INLINE_IDENTITY_COPIES else []:
        stmt = sch.get(blk)
        body = stmt.body
        if any(iv.iter_type != tirx.IterVar.DataPar for iv in stmt.iter_vars) or stmt.init is not None:
            continue
        load = body.value if isinstance(body, tirx.BufferStore) else None
        if type(load).__name__ not in ("BufferLoad", "TensorLoad"):  # 0.27 loads are TensorLoad
            continue
        src, dst = getattr(load, "buffer", None) or load.source, body.buffer
        same_shape = [str(d) for d in src.shape] == [str(d) for d in dst.shape]
        same_index = len(body.indices) == len(load.indices) and all(
            a.same_as(b) for a, b in zip(body.indices, load.indices))
        if same_shape and same_index:
            try:
                sch.compute_inline(blk)
            except Exception:  # noqa: BLE001 - TVM refused (e.g. read elsewhere): keep the copy
                pass


def _float32_reduction(sch: Any, root: Any) -> Any:
    """The function's one float32 reduction block with an init and 2-3 reads, or None."""
    from tvm import tirx

    red_blocks = [b for b in sch.get_child_blocks(root)
                  if any(iv.iter_type == tirx.IterVar.CommReduce for iv in sch.get(b).iter_vars)]
    if len(red_blocks) != 1:
        return None
    stmt = sch.get(red_blocks[0])
    if len(stmt.writes) != 1 or stmt.init is None or len(stmt.reads) not in (2, 3):
        return None
    return red_blocks[0] if str(stmt.writes[0].source.dtype) == "float32" else None


def _operand_roles(stmt: Any, out: Any, vi: Any, vj: Any, vk: Any) -> tuple[int, bool] | None:
    """Identify A (uses i, k) and B (uses k, j in its last two dims, either order): B's read
    index and whether it is transposed, or None when the reads are not a GEMM's."""
    a_idx = b_idx = None
    b_transposed = False
    for idx, read in enumerate(stmt.reads):
        if read.source.same_as(out.source):
            continue
        reg = read.region
        if len(reg) < 2:
            return None
        last2 = [(_uses(r.min, vi), _uses(r.min, vj), _uses(r.min, vk)) for r in reg[-2:]]
        if any(_uses(r.min, v) for r in reg[:-2] for v in (vi, vj, vk)):
            return None
        if last2 == [(True, False, False), (False, False, True)]:
            a_idx = idx
        elif last2 == [(False, False, True), (False, True, False)]:
            b_idx = idx
        elif last2 == [(False, True, False), (False, False, True)]:
            b_idx, b_transposed = idx, True
        else:
            return None
    if a_idx is None or b_idx is None:
        return None
    return b_idx, b_transposed


def _pack_map(rank: int, nr: int, transposed: bool) -> Any:
    """Index map B[.., k, j] (or B[.., j, k]) -> Bp[.., j // nr, k, j % nr]."""
    from tvm import tirx

    def f(*idx):
        *lead, x, y = idx
        kk, jj = (y, x) if transposed else (x, y)
        return (*lead, tirx.floordiv(jj, nr), kk, tirx.floormod(jj, nr))

    return tirx.IndexMap.from_func(f, ndim=rank)


def prepack_passes() -> list[Any]:
    """Split the packing of constant weights into its own function and fold it at build time.

    The packing calls are merged by common-subexpression elimination before folding: each call
    site gets its own packing call, so a weight used by many calls (an unrolled LSTM's ``R``, one
    per time step) would otherwise be folded into one packed copy per call (128 copies for
    sequence 128: a 128x larger library, and every step streaming a cold copy from memory)."""
    import tvm
    from tvm import relax

    split = tvm.transform.module_pass(_split_preproc, opt_level=0, name="SplitLayoutRewritePreprocWhereAnnotated")
    packs = tvm.transform.module_pass(_schedule_runtime_packs, opt_level=0, name="ScheduleRuntimePacks")
    return [split, packs, relax.transform.EliminateCommonSubexpr(), relax.transform.FoldConstant()]


def _schedule_runtime_packs(mod: Any, _ctx: Any) -> Any:
    """Vectorise (and, from ``threads.PARALLEL_MIN_ELEMENTS``, parallelise) the packing
    functions that ``SplitLayoutRewritePreproc`` split out (``*_weight_prepack``).

    Shapes it is for: products whose packed operand is an activation, not a constant (attention's
    QK^T and PV) and whose packing is not an identity copy (padded N, or several panels; an
    identity copy is turned into a free reshape by Relax). Such a packing function runs on every
    call, and the split leaves its block as TOPI wrote it: a serial scalar copy (heldout_vit's
    65 -> 72-wide K^T pack at batch 8: ~25 us per call next to its ~150 us GEMM). A constant
    weight's packing is folded at build time and never runs; scheduling it too only speeds up the
    folding.

    Rules (:func:`_schedule_pack_copy`): 1. only packs whose innermost loop is B's column axis
    ``j`` (B[.., k, j]: contiguous reads, contiguous writes within a panel); a transposed B keeps
    TVM's copy (vectorising its k loop would scatter the stores). 2. ``j`` is split into (panel,
    column in panel) and only the column loop is vectorised, so ``j // NR`` and ``j % NR`` are
    loop variables: with the whole loop nest fused into one parallel loop (the generic copy
    schedule), they were computed per vector and the vit pack ran 1.6x slower than the scalar
    copy. 3. the loops above ``j`` are fused and parallel from the element threshold."""
    import tvm
    from tvm import s_tir, tirx

    target = tvm.target.Target.current(allow_none=True)
    if not SCHEDULE_RUNTIME_PACKS or target is None:
        return mod
    lanes = vector_lanes(target, 32)
    for gv, func in list(mod.functions_items()):
        if not isinstance(func, tirx.PrimFunc) or not gv.name_hint.endswith("_weight_prepack"):
            continue
        try:
            sch = s_tir.Schedule(func)
            blocks = sch.get_child_blocks(sch.get_sblock("root"))
            if len(blocks) == 1 and _schedule_pack_copy(sch, blocks[0], lanes):
                mod[gv] = sch.mod["main"]
        except Exception:  # noqa: BLE001 - a pack this schedule does not fit: keep TVM's copy
            continue
    return mod


def _schedule_pack_copy(sch: Any, blk: Any, lanes: int) -> bool:
    """Schedule one pack block by the rules of :func:`_schedule_runtime_packs`; False (nothing
    changed) when its innermost loop is not B's column axis or the panel width is not constant."""
    from .threads import parallel_elements

    stmt = sch.get(blk)
    loops = sch.get_loops(blk)
    if len(loops) < 2 or len(stmt.writes) != 1 or not _uses(stmt.writes[0].region[-1].min, stmt.iter_vars[-1].var):
        return False
    width, ext = int(stmt.writes[0].source.shape[-1]), const_extent(sch, loops[-1])
    exts = [const_extent(sch, lp) for lp in loops]
    if ext is None or ext % width or any(e is None for e in exts):
        return False
    vec = next((v for v in (lanes, lanes // 2, lanes // 4) if v >= 4 and width % v == 0), 0)
    if not vec:
        return False
    _, col = sch.split(loops[-1], factors=[None, width])
    _, lane = sch.split(col, factors=[None, vec])
    sch.vectorize(lane)
    total = 1
    for e in exts:
        total *= e
    if parallel_elements(total):
        sch.parallel(sch.fuse(*loops[:-1]) if len(loops) > 2 else loops[0])
    return True


def _split_preproc(mod: Any, ctx: Any) -> Any:
    """TVM's ``SplitLayoutRewritePreproc``, on the functions that have a pack block to split.

    TVM 0.27's pass visits every PrimFunc and stops with "There should be a compute block if there
    is only one subtree under the root" on a function whose root holds one opaque block, which is
    how TOPI writes ScatterElements with a reduction (a training graph's MaxPool gradient). When
    the pass fails, it is run again on the module without the PrimFuncs that hold no annotated
    pack block (they have nothing to split), and those are put back unchanged."""
    import tvm
    from tvm import relax, tirx

    split = relax.transform.SplitLayoutRewritePreproc()
    try:
        return split(mod)
    except tvm.error.InternalError:
        pass
    kept = {gv: f for gv, f in mod.functions.items()
            if isinstance(f, tirx.PrimFunc) and LAYOUT_REWRITE not in f.script()}
    rest = tvm.IRModule({gv: f for gv, f in mod.functions.items() if gv not in kept}, attrs=mod.attrs)
    out = split(rest)
    for gv, f in kept.items():
        out[gv] = f
    return out

