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

``vec_axis`` is the output's innermost axis (channels in NHWC, columns of a matmul), split into
``nj`` vectors of ``V`` lanes; ``row_axis`` is the next spatial axis that has extent > 1
(output width, matmul rows), blocked by ``ni``. At batch 1 a convolution with at most 1 MiB of
weights fuses ``(n, h, vec_axis.o, row_axis.o)`` instead, so that each thread writes whole
output rows (:data:`ROWS_OUTER_CONV`, :func:`_parallel_order`); at batch > 1 a convolution whose
input exceeds L2 takes 4 channel vectors per tile, so the channel tiles sweep it fewer times
(:data:`WIDE_INPUT_TILE`, :func:`_wide_input_rows`); at batch >= 4 a padded convolution runs
the images as the parallel loop and copies each image's padded input just before its tiles
(:data:`PAD_PER_IMAGE`, :func:`_image_pad`); at batch 1 a padded convolution on a map of at
least 3 column tiles reads its input directly, the padding inlined as bounds checks that only
the first / last row and column tiles keep (:data:`SPLIT_PAD_BORDER`, :func:`_inline_border_pad`,
:func:`_split_border_tiles`). The weight panel of one
``vec_axis`` tile stays in L2 while every row tile streams past it (a convolution's constant
weights are packed into contiguous panels at build time: :func:`_pack_conv_weights`). Producers
are materialised and scheduled as injective loops (a transposed operand becomes contiguous once
instead of gathered in the inner loop), except copies that change nothing (the ``pad_temp``
TOPI writes for a convolution without padding), which are inlined
(:data:`INLINE_IDENTITY_COPIES`).

Applies only when every read of the reduction block either does not use the vector axis or
uses it in its last (contiguous) dimension; otherwise the inner loop would gather, so the
function is left to the next rule.

Numbered rules (from session 17 on; the paragraphs above are the older rules):

1. A tile that fits the register file (:data:`REGISTER_FILE_TILE`, env
   ``PARTITIONER_REGISTER_FILE_TILE=0`` turns it off; default on). A direct convolution (three
   reductions kh, kw, ci) whose tile after the rules above needs more vector registers than the
   target has (``ni*nj`` accumulators + ``nj`` weight vectors + 1 broadcast > 16 on AVX2) takes
   :func:`_register_file_tile`'s tile instead. Shapes it is for: 3x3 convs on 7-, 14-, 28- and
   56-wide maps on AVX2 (every ResNet stage but the 4x4 / 2x2 ones): their default tile is 7 or 8
   pixels x 2 vectors, 14-16 accumulators in 16 ymm registers, and LLVM kept one accumulator on
   the stack (26 stores and 27 reloads in the kernel of 128 -> 128 on 14x14: a store-to-load
   round trip in every FMA chain step). On 32 registers (AVX-512) the default tile always fits
   (at most :data:`MAX_ACCUMULATORS` + 3), so AVX-512 builds never take the rule. A 7x7 map at a
   batch of 4k spans 4 images (:data:`REGISTER_FILE_TILE_IMAGES`). Measured: see
   :func:`_register_file_tile`.
2. A batched RGB stem on a 16-register target runs image by image (:data:`STEM_IMAGES_OUTER`, env
   ``PARTITIONER_STEM_IMAGES_OUTER=0`` turns it off; default on): see :func:`_parallel_order`.
3. On a target with full-width 512-bit FMA units (:func:`vector.full_width_fma`: Intel AVX-512
   server cores, Zen 5; not ``znver4``, whose 512-bit FMAs run on 256-bit pipes, nor AVX2), a batch-1
   direct convolution on a map narrower than :data:`NARROW_ROWS` takes :func:`_full_width_tile`'s
   tile instead of :func:`_narrow_tile`'s (:data:`FULL_WIDTH_NARROW_TILE`, env
   ``PARTITIONER_FULL_WIDTH_NARROW_TILE=0`` turns it off): the most accumulators, then the most
   pixels per weight vector, up to :data:`NARROW_MAX_PIXELS`. Shapes it is for: the 4x4 stages
   of ResNets at 112x112 / 64x64 input (3x3 256 -> 256, 512 -> 512, stride-2 256 -> 512), whose
   weights (2.25-9.4 MiB) stream from L2/L3: 4 pixels x 4 vectors read each weight vector once
   per output row (4 times), 16 pixels x 1 vector once. 2x2 maps keep 4 pixels x 4 vectors (the
   rule picks the same tile; 4 pixels x 1 or 2 vectors measured 1.08x slower). Measured (this
   session's Intel host, ``rocketlake``, 1 thread, thread CPU time, forced tiles, 11
   interleaved rounds, load 3.4-3.9; new / old): 512 -> 512 on 4x4 b1 0.82, 256 -> 256 on 4x4
   0.82, 256 -> 512 stride 2 onto 4x4 0.84; at batch 8 1.00 (hence batch 1 only). Not for
   convs with fewer than 4 input channels (RGB stems, patch embeddings: not measured). Whole
   models, rules 3-4 on / off (``kernel_profile.py --baseline
   backends.tvm.schedules.vector.FULL_WIDTH_FMA=False``, 1 thread, load ~4): conv3x3 class of
   resnet18 b1 0.88, resnet50 b1 0.97, heldout_inception b1 0.96
   (benchmarks/results/session18_intel/conv18/kernel_profile_ab_b1.json).
   On Zen 5 (``znver5``, :data:`NARROW_MIN_VECTORS`) the tile takes at least 2 channel vectors
   where the output has them: 4x4 maps get 8 pixels x 2 vectors instead of 16 x 1 (the same 16
   accumulators). Measured there (session 28, 1 thread, thread CPU time, forced tiles, 11
   interleaved rounds, ``conv_forced_tiles.py``; 16 x 1 / 8 x 2 / 4 x 4, as x ORT): 512 -> 512 on
   4x4 b1 1.00 / 0.85 / 1.04, 256 -> 256 0.90 / 0.84 / 0.87, 256 -> 512 stride 2 onto 4x4 0.99 /
   0.86 / 0.88; a 3x3 map keeps 9 pixels x 2 (0.69; 3 x 4 0.81). Whole models with the
   16-pixel tile against rule 3 off (``per_device.py --build-baseline``, 7 interleaved rounds,
   ``benchmarks/results/session28_zen5/rule3_b1.json``): resnet18 b1 1.16x / 1.05x slower (1 / 2
   threads), resnet50 b1 1.12x / 1.08x; mbv2, inception, unet b1 0.98-1.01x (no narrow maps).
4. On the same targets, a direct convolution whose default tile is one full-width channel vector
   (the output's channel vectors are odd) with fewer than :data:`FULL_WIDTH_MIN_ACCUMULATORS`
   accumulators takes :func:`_full_width_tile`'s tile
   within :data:`FEW_VECTORS_MAX_PIXELS` pixels (:data:`FULL_WIDTH_FEW_VECTORS`, env
   ``PARTITIONER_FULL_WIDTH_FEW_VECTORS=0``). Shapes it is for: 48 output channels (on maps of
   width 6 and more): 3 channel vectors, which the default's ``nj`` in (2, 1)
   took one at a time, 8 pixels x 1 vector = 8 accumulators (exactly 2 ports x 4 cycles, no
   slack); now 8 pixels x 3 vectors = 24. One-vector outputs (16 channels) are left as they were
   (8 pixels x 2 rows measured 1.00-1.02x on 16 -> 16 at 64x64). Measured (as rule 3): 32 -> 48
   on 32x32 b1 0.84, 48 -> 48 on 16x16 b1 0.83 (Inception-style branches). It takes the
   factorised 1x7 / 7x1 convs with 48 channels too. Tiles of 2 or more vectors are left alone
   even below 16 accumulators (6 pixels x 2 vectors on 6- and 12-wide maps: not measured). Whole model, rules on / off as in rule 3:
   heldout_inception b8 conv3x3 class 0.91, conv7x7 class 0.90 (conv1x1, which no rule here
   touches, 0.97: the noise floor at load ~5;
   benchmarks/results/session18_intel/conv18/kernel_profile_ab_inception_b8.json).
"""

from __future__ import annotations

import os
from typing import Any

from tvm.s_tir.dlight.cpu.base import CPUScheduleRule

from .injective import schedule_padded_copy, schedule_spatial_block
from .threads import worth_parallel
from .vector import by_cpu, const_extent, full_width_fma, largest_divisor, vector_lanes

MAX_ACCUMULATORS = 24  # of the 32 AVX-512 vector registers, leave some for operands
# Below this many rows in the register tile (output width < 6: the 4x4 / 2x2 maps of late
# ResNet stages) the tile also spans the next outer spatial axis and more channel vectors
# (:func:`_narrow_tile`).
NARROW_ROWS = 6
#: fold multi-use epilogues (GELU's ``x * (erf(x / sqrt 2) + 1)``, SiLU, HardSwish) into the
#: write-back (:func:`inline_epilogue_chain`); off: only single-consumer chains fold (the old rule)
INLINE_EPILOGUE_CHAIN = True
#: direct convolutions read their constant weights from co-blocked panels packed at build time
#: (:func:`_pack_conv_weights`); off: the HWIO weights are read in place
PACK_CONV_WEIGHTS = True
#: producers that copy a buffer unchanged (TOPI's ``pad_temp`` of a conv without padding) are
#: inlined, as in GemmPacked (``gemm_packed._inline_identity_copies``, which also reads its own
#: knob); off: the copy is materialised
INLINE_IDENTITY_COPIES = True
#: convolutions with fewer than 4 input channels (RGB stems) and a large kernel take one channel
#: vector per tile (:func:`_stem_vectors`); off: two
STEM_ONE_VECTOR = True
#: ... when the tile's weight panel is larger than this (a quarter of a 32 KiB L1)
STEM_PANEL_BYTES = 8192
#: a register tile of narrow vectors (output channels not a multiple of the vector width: 8, 12,
#: 24, 40) with fewer accumulators than this also spans output rows / more channel vectors
#: (:func:`_few_channels_tile`); 0 turns it off
FEW_CHANNELS_ACCUMULATORS = 16
#: convolutions whose packed weights fit :data:`ROWS_OUTER_WEIGHT_BYTES` run the fused outer loop
#: pixels first, channel tiles inside (:func:`_parallel_order`); off: channel tiles outermost
ROWS_OUTER_CONV = True
#: ... the bound: the L2 of one core (Zen 4: 1 MiB), as ``gemm_packed.ROWS_OUTER_B_BYTES``
ROWS_OUTER_WEIGHT_BYTES = 1 << 20
#: convolutions on wide maps whose input exceeds :data:`WIDE_INPUT_BYTES` take a 2 x 2 pixel x
#: 4 channel vector register tile, so the input is swept half as often (:func:`_wide_input_rows`);
#: off: 8 pixels x 2 vectors
WIDE_INPUT_TILE = True
#: ... the bound: the L2 of one core (Zen 4: 1 MiB); an input that fits is re-read from L2
WIDE_INPUT_BYTES = 1 << 20
#: batched convolutions copy one image's padded input at a time, just before the image's output
#: tiles read it, with the images as the parallel loop (:func:`_image_pad`); off: the whole
#: batch's padded copy is one pass before the convolution
PAD_PER_IMAGE = True
#: ... from this batch on (the images are the only parallel loop)
PAD_PER_IMAGE_MIN_BATCH = 4
#: ... for weights (``kh*kw*ci*co`` floats) up to this size: larger ones are read again per image
PAD_PER_IMAGE_MAX_WEIGHT_BYTES = 3 << 19
#: rule 1: a direct convolution whose default register tile needs more vector registers than the
#: target has (16 ymm on AVX2: 7 pixels x 2 vectors = 14 accumulators + 2 weights + 1 broadcast)
#: takes the best tile that fits (:func:`_register_file_tile`); off: the default tile, which LLVM
#: spills (one accumulator stored and reloaded per FMA step). Never applies on 32 registers.
REGISTER_FILE_TILE = os.environ.get("PARTITIONER_REGISTER_FILE_TILE", "1") != "0"
#: ... and on a map whose height no 2, 3 or 4 divides (7x7), the tile may span 4 images instead
#: (:func:`_register_file_tile`); off: such maps take 7 pixels x 1 vector
REGISTER_FILE_TILE_IMAGES = True
#: rule 2: a batched RGB stem runs its images outermost, the channel tiles inside each image
#: (:func:`_parallel_order`); off: the channel tiles outermost, each sweeping the whole batch
STEM_IMAGES_OUTER = os.environ.get("PARTITIONER_STEM_IMAGES_OUTER", "1") != "0"
#: rule 3: on a target with full-width 512-bit FMA units (:func:`vector.full_width_fma`), a batch-1
#: direct convolution on a map narrower than :data:`NARROW_ROWS` takes :func:`_full_width_tile`'s
#: tile (up to :data:`NARROW_MAX_PIXELS` pixels per weight vector); off: :func:`_narrow_tile`'s
FULL_WIDTH_NARROW_TILE = os.environ.get("PARTITIONER_FULL_WIDTH_NARROW_TILE", "1") != "0"
#: ... the most pixels (output rows x columns) one register tile may span
NARROW_MAX_PIXELS = 16
#: ... the fewest channel vectors its tile takes (where the output has that many), by LLVM ``mcpu``;
#: other CPUs 1. Zen 5: a 16-pixel x 1-vector tile on 4x4 maps measured 1.12-1.18x the 8 x 2 one
NARROW_MIN_VECTORS = {"znver5": 2}
#: rule 4: on a target with full-width 512-bit FMA units, a direct convolution whose default tile
#: of full-width vectors has fewer than :data:`FULL_WIDTH_MIN_ACCUMULATORS` accumulators (one
#: channel vector per tile: 16 or 48 output channels) takes :func:`_full_width_tile`'s tile; off: the default
FULL_WIDTH_FEW_VECTORS = os.environ.get("PARTITIONER_FULL_WIDTH_FEW_VECTORS", "1") != "0"
#: ... the bound (two FMA ports x 4 cycles of latency = 8 chains, twice that for slack)
FULL_WIDTH_MIN_ACCUMULATORS = 16
#: ... and the most pixels its tile may span
FEW_VECTORS_MAX_PIXELS = 8
#: batch-1 padded convolutions read the input directly, the padding inlined as bounds checks, and
#: the first / last row and column tiles get loops of their own so that the interior's checks
#: drop (:func:`_inline_border_pad`, :func:`_split_border_tiles`); off: TOPI's whole padded copy
SPLIT_PAD_BORDER = True
#: ... for maps of at least this many column tiles (register tiles along the output row)
SPLIT_PAD_MIN_TILES = 5


def _uses(expr: Any, var: Any) -> bool:
    from tvm.tirx.analysis import undefined_vars

    return any(v.same_as(var) for v in undefined_vars(expr))


class TryRule(CPUScheduleRule):
    """A rule that schedules a PrimFunc with ``self._apply(sch, target)``, or declines (``None``)
    when the function is not a PrimFunc, the target is not a CPU, or ``_apply`` fails on a pattern
    it does not handle: dlight then tries the next rule."""

    def apply(self, func: Any, target: Any, _tunable: bool) -> Any:
        from tvm import s_tir, tirx

        if not isinstance(func, tirx.PrimFunc) or not self.is_target_available(target):
            return None
        try:
            return self._apply(s_tir.Schedule(func), target)
        except Exception:  # a pattern this rule does not handle: leave it to the next rule
            return None

    def _apply(self, sch: Any, target: Any) -> Any:
        raise NotImplementedError


class Contraction(TryRule):
    """Register-tiled, vectorised, parallel schedule for a single reduction block."""

    def _apply(self, sch: Any, target: Any) -> Any:
        found = self._match(sch)
        if found is None:
            return None
        root, red, stmt, loops, s_idx, r_idx, vec_pos = found
        if INLINE_IDENTITY_COPIES:  # a valid (unpadded) conv's pad_temp: a full copy per call
            from .gemm_packed import _inline_identity_copies

            _inline_identity_copies(sch, red)
            stmt = sch.get(red)

        bits = stmt.writes[0].source.dtype.bits
        lanes = vector_lanes(target, bits)
        exts = [const_extent(sch, lp) for lp in loops]
        if any(e is None for e in exts):
            return None

        vec, nj, row_pos, ni, col_pos, hi = _choose_tile(stmt, exts, s_idx, r_idx, vec_pos, lanes,
                                                         full_width_fma(target),
                                                         by_cpu(NARROW_MIN_VECTORS, target, 1))
        border = _inline_border_pad(sch, red, exts, s_idx, row_pos, col_pos, ni)
        pack = _pack_conv_weights(sch, red, stmt, vec_pos, r_idx, nj * vec) if vec > 1 else None
        # Accumulate in a small tile, written back (with the epilogue) per output tile.
        wb = sch.cache_write(red, 0, "local")
        loops = sch.get_loops(red)
        # Split the two register axes.
        v_outer, v_j, v_lane = sch.split(loops[vec_pos], factors=[None, nj, vec])
        spatial_outer = []
        row_inner = col_inner = None
        for i in s_idx[:-1]:
            if i == row_pos and ni > 1:
                o, row_inner = sch.split(loops[i], factors=[None, ni])
                spatial_outer.append(o)
            elif i == col_pos and hi > 1:
                o, col_inner = sch.split(loops[i], factors=[None, hi])
                spatial_outer.append(o)
            else:
                spatial_outer.append(loops[i])
        red_loops = [loops[i] for i in r_idx]
        inner = [lp for lp in (col_inner, row_inner) if lp is not None] + [v_j, v_lane]
        pad = _image_pad(sch, red, exts, r_idx) if spatial_outer and not border else None
        outer = _order_outer(sch, pad, v_outer, spatial_outer, [*red_loops, *inner], exts, r_idx, vec_pos,
                             border, lanes < 16)
        if pad is not None:
            _vectorize_copy(sch, pad, lanes)
        sch.reverse_compute_at(wb, outer, preserve_unit_loops=True)
        consumers = [b for b in sch.get_child_blocks(root)]
        names_before = {str(sch.get(b).name_hint) for b in consumers}
        self._inline_epilogue(sch, wb)
        for lp in (col_inner, row_inner):
            if lp is not None:
                sch.unroll(lp)
        sch.unroll(v_j)
        if vec > 1:
            sch.vectorize(v_lane)
        if red_loops:
            init = sch.decompose_reduction(red, red_loops[0])
            self._vectorize_tail(sch, init, vec)
        self._vectorize_tail(sch, wb, vec)
        # Everything else (padding, transposes, epilogue blocks that did not inline).
        # the pack too: folded away when the weights are constants, a vectorised copy per call when not
        skip = {str(sch.get(b).name_hint) for b in (red, wb) + ((pad,) if pad is not None else ())}
        for b in sch.get_child_blocks(root):
            name = str(sch.get(b).name_hint)
            if name in skip or name not in names_before:
                continue
            if not schedule_padded_copy(sch, b, lanes):
                schedule_spatial_block(sch, b, lanes)
        name = str(sch.get(red).name_hint)
        return _split_border_tiles(sch, outer, exts[row_pos] // ni, exts[1], name) if border else sch

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
        """Fold the elementwise consumers of the write-back block into it, in order (first
        :func:`inline_epilogue_chain`, so that an epilogue that uses the result twice is one
        consumer)."""
        inline_epilogue_chain(sch, wb)
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


def inline_epilogue_chain(sch: Any, wb: Any) -> None:
    """Inline every intermediate block after the write-back ``wb`` into its one consumer, so
    that an epilogue which reads the kernel's result twice becomes a single consumer of ``wb``
    (which ``Contraction._inline_epilogue`` then folds into the write-back).

    Shapes it is for: matmuls and convolutions whose fused epilogue uses the result twice:
    exact GELU as bert/gpt export it, ``y = x * (erf(x / sqrt 2) + 1) * 0.5``; SiLU,
    ``x * sigmoid(x)`` (YOLO-style detectors); HardSwish written as ``x * clip(x + 3) / 6``
    (PP-LCNet / MobileNetV3 exports). The write-back then has two consumers, which the
    one-consumer-at-a-time folding cannot take: the epilogue stayed as separate passes over
    output-sized intermediates (bert/gpt fc1 at batch 8: four passes over 512 x 512 floats).
    After this the chain is one block reading ``x`` twice, computed on the register tile.

    Rules: only blocks downstream of ``wb`` (never the operands' producers: inlining those
    would recompute them inside the reduction loop); only blocks with exactly one consumer (no
    expression is computed twice) that write a buffer allocated in the function (never its
    output); a block TVM refuses to inline (a reduction, a non-trivial index map) stays."""
    if not INLINE_EPILOGUE_CHAIN:
        return
    allocated = list(sch.get(sch.get_sblock("root")).alloc_buffers)
    order: list[Any] = []
    frontier = list(sch.get_consumers(wb))
    while frontier:
        blk = frontier.pop(0)
        if not any(sch.get(blk).same_as(sch.get(b)) for b in order):
            order.append(blk)
            frontier.extend(sch.get_consumers(blk))
    for blk in order:
        internal = all(any(w.source.same_as(a) for a in allocated) for w in sch.get(blk).writes)
        if len(sch.get_consumers(blk)) != 1 or not internal:
            continue
        try:
            sch.compute_inline(blk)
        except Exception:  # noqa: BLE001 - TVM refused this block: keep it
            pass


def _stem_vectors(exts: list, r_idx: list[int], vec: int, nj: int) -> int:
    """Channel vectors per register tile for a convolution whose input-channel reduction (the
    innermost) has fewer than 4 iterations and whose per-tile weight panel
    (``kh*kw*ci*nj*vec`` floats) exceeds :data:`STEM_PANEL_BYTES`: 1; else ``nj`` unchanged.

    Shapes it is for: large-kernel RGB stems (ResNet's 7x7 stride-2 3 -> 64, any batch) on maps
    of width >= :data:`NARROW_ROWS` (narrower maps take :func:`_narrow_tile`). Every tile reads
    the whole panel: with 2 vectors 7*7*3*32 floats = 18.8 KiB, which with the input rows a
    tile reads (~10 KiB) overflowed the 32 KiB L1; with 1 vector (9.4 KiB) it stays. Measured
    (1 thread, thread CPU time, whole models, old and new interleaved): resnet18's stem 0.84x the
    old time at batch 1 and 8, resnet50's (32x32 map) 0.95x (b1) and 0.86x (b8). A 3x3 stem's
    panel is small (3x3x3x32: 3.4 KiB) and one vector there only halves the FMAs per load:
    MobileNet's 3 -> 32 stem ran 1.58x slower, hence the bound."""
    if not STEM_ONE_VECTOR or len(r_idx) != 3 or exts[r_idx[-1]] >= 4 or vec <= 1 or nj <= 1:
        return nj
    panel = 4 * nj * vec
    for i in r_idx:
        panel *= exts[i]
    return 1 if panel > STEM_PANEL_BYTES else nj


def _pack_conv_weights(sch: Any, red: Any, stmt: Any, vec_pos: int, r_idx: list[int], panel: int) -> Any:
    """Pack a direct convolution's constant HWIO weights into panels of ``panel`` output
    channels, ``Wp[co // panel, kh, kw, ci, co % panel]``, folded at build time (the block is
    annotated like :mod:`gemm_packed`'s packs); returns the pack block, or None when nothing is
    packed.

    Shapes it is for: convolutions (three reduction axes kh, kw, ci; a rank-4 weight that is a
    parameter of the function and reads no output pixel) scheduled by this rule, i.e. the
    3x3 / KxK / strided convs GemmPacked does not take. In HWIO, one tile's weight panel is
    ``kh*kw*ci`` rows of ``panel`` floats, ``4*co`` bytes apart: with 512 output channels a 2 KiB
    stride, so the rows of the 4608-row panel of a 3x3 512 -> 512 conv fall into 1/16 of the
    L2's sets (8-way, 64 B lines, 2048 sets): only ~64 KiB of the 1 MiB L2 holds them and every
    row tile reads the panel again from L3. Packed, the panel is contiguous: it streams, and
    stays in L2 between row tiles when it fits. Weights given at run time (external-data models,
    ``weight_params.py``) cannot be folded: the pack then runs per call, scheduled as a
    vectorised copy (unscheduled, it cost 1.2x on a 512-channel 4x4 layer at batch 1;
    scheduled, on par with reading HWIO in place)."""
    if not PACK_CONV_WEIGHTS or len(r_idx) != 3:
        return None
    ivs = list(stmt.iter_vars)
    vec_var = ivs[vec_pos].var
    pixel_vars = [iv.var for iv in ivs[:vec_pos]]
    params = list(sch.mod["main"].params)
    for idx, read in enumerate(stmt.reads):
        region = read.region
        if len(region) != 4 or not _uses(region[-1].min, vec_var):
            continue
        if any(_uses(r.min, v) for r in region for v in pixel_vars):
            continue
        if not any(p.same_as(read.source) for p in params):
            return None
        if any(int(d) % panel for d in read.source.shape[-1:]):
            return None
        from tvm import tirx

        from .gemm_packed import LAYOUT_REWRITE

        pack = sch.cache_read(red, idx, "global")
        sch.transform_layout(pack, ("write", 0), tirx.IndexMap.from_func(
            lambda h, w, i, o: (tirx.floordiv(o, panel), h, w, i, tirx.floormod(o, panel)), ndim=4))
        sch.annotate(pack, LAYOUT_REWRITE, True)
        return pack
    return None


def ivs_of(stmt: Any) -> list:
    return list(stmt.iter_vars)


def _shared_outer_axis(stmt: Any, ivs: list, s_idx: list[int], row_pos: int, vec_pos: int,
                       exts: list) -> int | None:
    """The spatial axis outside the row axis (a conv's output height, else its batch) whose
    pixels share every vector load: no read that uses the vector axis (the weights) uses it.
    None when there is none (a batched matmul's batch axis indexes its B too)."""
    vec_var = ivs[vec_pos].var
    for i in reversed(s_idx[:s_idx.index(row_pos)]):
        if exts[i] <= 1:
            continue
        var = ivs[i].var
        shared = all(not any(_uses(r.min, var) for r in read.region)
                     for read in stmt.reads if any(_uses(r.min, vec_var) for r in read.region))
        return i if shared else None
    return None


def _narrow_tile(exts: list, s_idx: list[int], col_pos: int | None, ni: int, vec: int,
                 registers: int) -> tuple[int, int]:
    """(hi, nj) for a contraction whose row tile is narrow (``ni`` < :data:`NARROW_ROWS`).

    Shapes it is for: direct convolutions whose output width is below 6 (ResNet's 4x4 and 2x2
    stages, any batch), where the default tile (``ni`` rows x 2 vectors) has at most 8
    accumulators: too few to hide the FMA latency (4 cycles x 2 pipes), and each weight vector
    load feeds only ``ni`` FMAs. The tile may take ``hi`` rows of the outer axis ``col_pos`` too
    (``hi`` divides its extent, ``hi * ni <= 8`` pixels); ``hi`` and the number of channel
    vectors ``nj`` (dividing the channel vectors) maximise FMAs per load, P·nj / (P + nj) with
    P = ``hi * ni`` pixels, then the accumulators, then prefer fewer rows, within
    :data:`MAX_ACCUMULATORS` and the register file (P·nj accumulators + nj weight vectors + 1
    broadcast): 2x2 maps get 4 pixels x 4 vectors, 4x4 maps 4 pixels x 4 vectors (AVX-512).
    Wide maps whose input exceeds L2 come here too, with ``ni`` = 2 (:func:`_wide_input_rows`).
    Measured (Zen 4, 1 thread, thread CPU time, conv 3x3 + bias + ReLU): 512 -> 512 channels on a
    2x2 map 687 -> ~400 us at batch 1, on 4x4 949 -> ~820 us."""
    his = [1] + ([c for c in (2, 3, 4) if c * ni <= 8 and exts[col_pos] % c == 0] if col_pos is not None else [])
    vectors = exts[s_idx[-1]] // vec
    best = (0.0, 0, 0, 1, 1)
    for hi in his:
        pixels = hi * ni
        for nj in (8, 6, 4, 3, 2, 1):
            acc = pixels * nj
            if vectors % nj or acc > MAX_ACCUMULATORS or acc + nj + 1 > registers:
                continue
            best = max(best, (acc / (pixels + nj), acc, -hi, hi, nj))
    return best[3], best[4]


def _full_width_tile(exts: list, s_idx: list[int], col_pos: int | None, ni: int, vec: int, registers: int,
                     max_pixels: int, min_vectors: int = 1) -> tuple[int, int]:
    """(hi, nj) for a direct convolution on a target with full-width 512-bit FMA units (rules 3
    and 4): ``hi`` rows of the outer axis ``col_pos`` (dividing it; ``hi * ni`` <= ``max_pixels``)
    and ``nj`` channel vectors (dividing the channel vectors, at most 8), chosen for the most
    accumulators (within :data:`MAX_ACCUMULATORS` and the register file: ``P*nj`` + ``nj``
    weight vectors + 1 broadcast), then the most pixels ``P = hi * ni`` per weight vector load;
    at least ``min_vectors`` channel vectors when the output has that many (rule 3 on Zen 5).

    Why not :func:`_narrow_tile`'s ratio (FMAs per load, broadcasts counted): on such a core the
    broadcasts are L1 hits folded into the FMA, while the weight vectors stream from L2 or L3
    (a 3x3 512 -> 512 conv: 9.4 MiB, read ``1 / P``-th as many times per output pixel); two
    512-bit FMA ports with a 4-cycle latency also want at least 8, better 16, accumulators. Zen
    4 (256-bit pipes) keeps :func:`_narrow_tile`. Shapes and measurements: see rules 3 and 4 in
    the module docstring."""
    his = [1] + ([c for c in range(2, max_pixels // ni + 1) if exts[col_pos] % c == 0] if col_pos is not None else [])
    vectors = exts[s_idx[-1]] // vec
    least = min(min_vectors, vectors)
    best = (0, 0, 0, 1, 1)
    for hi in his:
        pixels = hi * ni
        if pixels > max_pixels:
            continue
        for nj in (8, 6, 4, 3, 2, 1):
            acc = pixels * nj
            if vectors % nj or nj < least or acc > MAX_ACCUMULATORS or acc + nj + 1 > registers:
                continue
            best = max(best, (acc, pixels, -nj, hi, nj))
    return best[3], best[4]


def _few_channels_tile(exts: list, s_idx: list[int], col_pos: int | None, ni: int, vec: int,
                       registers: int) -> tuple[int, int]:
    """(hi, nj) for a contraction whose output channels are not a multiple of the full vector
    width (``vec`` < lanes) and whose default tile has fewer than
    :data:`FEW_CHANNELS_ACCUMULATORS` accumulators (``ni`` pixels x 1 narrow vector).

    Shapes it is for: direct convs with 8, 12, 24 or 40 output channels on AVX-512 (Inception's
    3x3 12 -> 24 and 24 -> 24 on 32x32 maps): 24 channels are 3 vectors of 8 lanes, and the
    default tile (at most 2 vectors) took 1 of them: 8 accumulators of 8 lanes, which only just
    cover the FMA latency (4 cycles x 2 pipes) and feed each weight load to 8 FMAs. The tile
    may span ``hi`` rows of the outer axis ``col_pos`` (the output height, whose pixels share
    the weight loads; ``hi`` divides it) and up to 4 channel vectors (3 for 24 channels);
    chosen like :func:`_narrow_tile`: most FMAs per load, P·nj / (P + nj) with P = ``hi * ni``
    pixels, then most accumulators, then fewest rows, within :data:`MAX_ACCUMULATORS` and the
    register file. Not for a stem whose weight panel :func:`_stem_vectors` cut to one vector
    (its panel would overflow L1 again). Channels a multiple of the full width (16 -> 16 at
    64x64, U-Net) are left alone: a 2-row tile there ran 1.00-1.03x (each FMA needs its own
    pixel broadcast whatever the tile). Measured (conv 3x3 + bias + ReLU, batch 8, 1 thread,
    thread CPU time, median of 41 interleaved runs, new / off): 12 -> 24 on 32x32 0.73,
    24 -> 24 0.85, 6 -> 12 0.80, 24 -> 40 on 16x16 0.93, 16 -> 8 on 32x32 0.97; in heldout_mbv2
    (kernel_profile, 21 runs) its 3x3 stride-2 stem 3 -> 24 on 48x48 0.74 (b1), 0.67 (b8)."""
    his = [1] + ([c for c in (2, 3, 4) if exts[col_pos] % c == 0] if col_pos is not None else [])
    vectors = exts[s_idx[-1]] // vec
    best = (0.0, 0, 0, 1, 1)
    for hi in his:
        pixels = hi * ni
        for nj in (4, 3, 2, 1):
            acc = pixels * nj
            if vectors % nj or acc > MAX_ACCUMULATORS or acc + nj + 1 > registers:
                continue
            best = max(best, (acc / (pixels + nj), acc, -hi, hi, nj))
    return best[3], best[4]


def _input_bytes(stmt: Any, vec_pos: int) -> int:
    """Bytes of the largest buffer the block reads without the vector axis (a conv's input or
    its padded copy; a matmul's A)."""
    vec_var = list(stmt.iter_vars)[vec_pos].var
    sizes = [0]
    for read in stmt.reads:
        if any(_uses(r.min, vec_var) for r in read.region):
            continue
        n = read.source.dtype.bits // 8
        for d in read.source.shape:
            if not hasattr(d, "value"):
                break
            n *= int(d.value)
        else:
            sizes.append(n)
    return max(sizes)


def _wide_input_rows(exts: list, r_idx: list[int], vec_pos: int, row_pos: int, vec: int, ni: int,
                     input_bytes: int) -> int:
    """The row tile for a direct convolution on a wide map (the default row tile ``ni`` has at
    least :data:`NARROW_ROWS` pixels) whose input is larger than :data:`WIDE_INPUT_BYTES`: 2,
    where 2 divides the row and the output has a multiple of 4 channel vectors; else ``ni``.
    With 2 pixels per row the tile goes through :func:`_narrow_tile`, which picks the pixel
    block and the channel vectors: on AVX-512 2 x 2 pixels x 4 vectors (64 channels, 16
    accumulators) where the output height is even and not a multiple of 3, 3 x 2 pixels x 4
    vectors (24 accumulators) where it is; on AVX2 (16 registers) 2 pixels x 4 vectors of 8
    lanes (8 accumulators; still half the default's sweeps, not measured).

    Shapes it is for: the 3x3 convs of ResNet stages at 64-256 output channels at batch 4-8
    (224x224 images at batch 4: 64 channels on 56x56, 128 on 28x28; 112x112 at batch 8: 64 on
    28x28), stride 1 or 2, whose input (1.1-3.2 MiB) no longer fits one core's L2. The channel
    tiles are the outermost parallel loop, so every tile of output channels sweeps the whole
    input again: with the default 8 pixels x 2 vectors a 64-channel conv read its input twice
    from L3, with 4 vectors once (128 channels: 4 sweeps -> 2). The channel vectors are what
    counts: 2 x 2 and 4 x 1 pixels x 4 vectors ran the same at stride 1 (2 x 2 0.91x of 4 x 1 at
    stride 2). Not for RGB stems (fewer than 4 input channels: their L1-sized panel,
    :func:`_stem_vectors`; 4-16 pixel tiles ran 1.10-1.15x slower there), nor narrow channel
    counts (their own tile, :func:`_few_channels_tile`; 16-32 channels already sweep once), nor
    convs whose parallel loop runs rows outermost (batch 1, :func:`_parallel_order`: no
    channel-tile sweeps), nor inputs that fit L2 (256 -> 256 on 14x14 at batch 4, 0.8 MiB:
    0.99-1.01x). Measured (one conv + bias + ReLU, valid padding, kernel thread time, 11-21
    interleaved runs, 1 thread, load 1.3-4; new / old): 64 -> 64 on 56x56 b4 8.55 / 9.26 ms
    (ORT 8.2), 128 -> 128 on 28x28 b4 8.43 / 8.8, 64 -> 128 stride 2 on 56x56 b4 4.91 / 5.7,
    64 -> 64 on 28x28 b8 4.35 / 4.61, 256 -> 256 on 14x14 b8 17.7 / 18.3; the 3 x 2 x 4 tile:
    64 -> 64 on 48x48 b4 (padded) 6.45 / 7.07."""
    weight = 4 * exts[vec_pos]
    for i in r_idx:
        weight *= exts[i]
    rows_outer = ROWS_OUTER_CONV and exts[0] == 1 and weight <= ROWS_OUTER_WEIGHT_BYTES  # _parallel_order
    if (not WIDE_INPUT_TILE or rows_outer or len(r_idx) != 3 or exts[r_idx[-1]] < 4
            or input_bytes <= WIDE_INPUT_BYTES or exts[row_pos] % 2 or (exts[vec_pos] // vec) % 4):
        return ni
    return 2


def _order_outer(sch: Any, pad: Any, v_outer: Any, spatial_outer: list, rest: list, exts: list,
                 r_idx: list[int], vec_pos: int, border: bool = False, few_registers: bool = False) -> Any:
    """Reorder the tile loops (``rest``: reductions and register tile, innermost), fuse the outer
    ones and mark the parallel loop; returns the fused loop of one output tile. Without ``pad``:
    one fused parallel loop in :func:`_parallel_order`'s order. With ``pad`` (the batch's padded
    input copy, :func:`_image_pad`): the image loop outermost and parallel, ``pad`` computed in
    it, the image's tiles (channel tiles, then pixels) fused inside. With ``border``
    (:func:`_inline_border_pad`): ``[n, h, v_outer, w tiles]``, only ``(n, h)`` fused (the parallel
    loop), the column-tile loop returned, so that :func:`_split_border_tiles` can cut both."""
    if border:
        head = _parallel_order(v_outer, spatial_outer, exts, r_idx, vec_pos, few_registers)
        sch.reorder(*head, *rest)
        rows = sch.fuse(*head[:-2])
        if worth_parallel(_flops(exts)):
            sch.parallel(rows)
        return head[-1]
    if not spatial_outer:
        order = [v_outer, *rest]
        sch.reorder(*order)
        if worth_parallel(_flops(exts)):
            sch.parallel(v_outer)
        return v_outer
    head = ([spatial_outer[0], v_outer, *spatial_outer[1:]] if pad is not None
            else _parallel_order(v_outer, spatial_outer, exts, r_idx, vec_pos, few_registers))
    sch.reorder(*head, *rest)
    outer = sch.fuse(*head[int(pad is not None):])
    par = head[0] if pad is not None else outer
    if worth_parallel(_flops(exts)):  # small kernels: the fork/join costs more (threads.py)
        sch.parallel(par)
    if pad is not None:
        sch.compute_at(pad, par, preserve_unit_loops=True)
    return outer


def _image_pad(sch: Any, red: Any, exts: list, r_idx: list[int]) -> Any:
    """The zero-padding producer of a batched direct convolution's input, to be copied one image
    at a time (:data:`PAD_PER_IMAGE`); None when the rule does not apply.

    Shapes it is for: direct convolutions (three reductions kh, kw, ci with at least 4 input
    channels: not RGB stems, whose pad copy has its own row schedule) with padding at batch >=
    :data:`PAD_PER_IMAGE_MIN_BATCH` and weights up to :data:`PAD_PER_IMAGE_MAX_WEIGHT_BYTES`.
    TOPI pads the whole batch into ``pad_temp`` before the convolution: at batch 8 the U-Net's
    16-channel 64x64 input is 2.1 MiB padded, so the copy writes it out of L2 and the
    convolution reads it back from L3 or memory; with 16-32 output channels (9 x 16-32 FMAs per
    input value) that traffic is a tenth of the kernel. Copied per image (one padded 64x64x16
    image: 272 KiB) just before that image's output tiles, it is read back from L2. The images
    are then the parallel loop (hence the batch bound: 4 images on 2 threads), each thread
    copying and convolving its own images, and the channel tiles of one image run inside it:
    the weights are read once per image, hence the weight bound (measured gain up to 1.1 MiB,
    none at 2.25 MiB). Measured (one conv + bias + ReLU, 1 thread, thread CPU time, 15-21
    interleaved rounds, load 5-7; new / knob off): 16 -> 16 on 64x64 b8 0.93, 32 -> 16 0.87,
    16 -> 32 on 32x32 b8 0.93, 64 -> 64 on 28x28 b8 0.94, 64 -> 64 on 56x56 b4 0.96, 3x3
    stride 2 64 -> 128 on 56x56 b4 0.92, 128 -> 256 on 28x28 b4 0.96; 3x3 256 -> 256 (2.25 MiB
    of weights) 0.98-1.01 and 512 -> 512 1.01-1.02, which the weight bound leaves out."""
    weight = 4 * exts[-1 - len(r_idx)]
    for i in r_idx:
        weight *= exts[i]
    if (not PAD_PER_IMAGE or len(r_idx) != 3 or exts[r_idx[-1]] < 4 or exts[0] < PAD_PER_IMAGE_MIN_BATCH
            or weight > PAD_PER_IMAGE_MAX_WEIGHT_BYTES):
        return None
    return _pad_producer(sch, red)


def _pad_producer(sch: Any, red: Any) -> Any:
    """The 4-d zero-padding block (TOPI's ``pad_temp``) that only ``red`` reads, or None."""
    from tvm import tirx

    for blk in sch.get_producers(red):
        stmt = sch.get(blk)
        body = stmt.body
        if (len(stmt.iter_vars) == 4 and isinstance(body, tirx.BufferStore) and len(sch.get_consumers(blk)) == 1
                and "if_then_else" in str(getattr(body.value, "op", ""))):
            return blk
    return None


def _inline_border_pad(sch: Any, red: Any, exts: list, s_idx: list[int], row_pos: int | None,
                       col_pos: int | None, ni: int) -> bool:
    """Inline the zero padding of a batch-1 direct convolution into its loads
    (:data:`SPLIT_PAD_BORDER`); True when it did, and :func:`_split_border_tiles` then gives the
    interior tiles loops of their own.

    Shapes it is for: padded 3x3 / KxK convs (at least 4 input channels: not RGB stems) at batch
    1 whose loop runs rows outermost (:func:`_parallel_order`: weights up to
    :data:`ROWS_OUTER_WEIGHT_BYTES`), with a register tile of ``ni`` > 1 pixels of one output row
    (not :func:`_narrow_tile`'s multi-row tiles), at least :data:`SPLIT_PAD_MIN_TILES` column
    tiles and 3 output rows: the U-Net's 16 -> 16 and 32 -> 16 convs on 64x64 (and ResNet-style
    64-channel convs on 56x56, 224x224 images, where it is neutral). There TOPI's ``pad_temp`` copies the whole input
    before the convolution (16 channels on 64x64: 272 KiB written, then read back from L2) for a
    border of one pixel. Inlined, the interior tiles (all but the first and last row and column
    tile) read the input directly, their bounds checks provably true and dropped at lowering; the
    border tiles keep the checks (a branch around each checked load). Measured (1 thread, thread
    CPU time, paired with the knob off; ``kernel_profile.py`` per layer, three runs at load 2-10,
    and a one-layer driver): 16 -> 16 on 64x64 0.91-0.99, 32 -> 16 on 64x64 0.91-0.98; 64 -> 64
    on 56x56 0.995-1.005 (a copy under 1% of that conv's time: neutral). Maps of
    3-4 column tiles (32x32 and 28x28 outputs with 8- and 7-pixel tiles: half the tiles are border
    tiles) ran 0.97-1.07 (32 -> 48 on 32x32 1.02-1.11 in four runs), hence the bound, which also
    leaves out a stride-2 16 -> 32 from 64x64 to 32x32 that gained (0.93-0.96); 16x16 and smaller
    have no interior. Batches >=
    :data:`PAD_PER_IMAGE_MIN_BATCH` copy per image (:func:`_image_pad`)."""
    if not SPLIT_PAD_BORDER or len(exts) - len(s_idx) != 3 or len(s_idx) != 4 or exts[-1] < 4:
        return False
    weight = 4 * exts[s_idx[-1]] * exts[-1] * exts[-2] * exts[-3]
    if (not ROWS_OUTER_CONV or exts[0] != 1 or weight > ROWS_OUTER_WEIGHT_BYTES or col_pos is not None
            or row_pos != s_idx[-2] or ni < 2 or exts[row_pos] // ni < SPLIT_PAD_MIN_TILES or exts[1] < 3):
        return False
    pad = _pad_producer(sch, red)
    if pad is None:
        return False
    try:
        sch.compute_inline(pad)
    except Exception:  # noqa: BLE001 - TVM checks before it acts: nothing changed
        return False
    return True


def _split_border_tiles(sch: Any, w_tiles_loop: Any, w_tiles: int, rows: int, update: str) -> Any:
    """The schedule with the column-tile loop cut into its first tile, the interior tiles and its
    last tile, and (when the rows loop is serial: a one-thread build or a small conv) the rows
    loop cut the same way (``depthwise._split_border_columns``, which copies the loop in the
    PrimFunc); in the interior copies the inlined padding's bounds checks are provably true and
    TVM drops them. A parallel rows loop stays whole (three parallel loops would fork three
    times); its row check, one per kernel row, stays."""
    from tvm import tirx

    from .depthwise import _split_border_columns

    sch = _split_border_columns(sch, w_tiles_loop, w_tiles)
    root = sch.get_sblock("root")
    blk = next(b for b in sch.get_child_blocks(root) if str(sch.get(b).name_hint) == update)
    outer = sch.get_loops(blk)[0]
    if sch.get(outer).kind == tirx.ForKind.PARALLEL:
        return sch
    return _split_border_columns(sch, outer, rows)


def _vectorize_copy(sch: Any, block: Any, lanes: int) -> None:
    """Vectorise the innermost loop of a copy computed inside another loop (no parallel loop:
    the loop it sits in is the parallel one)."""
    inner = sch.get_loops(block)[-1]
    ext = const_extent(sch, inner)
    width = next((v for v in (lanes, lanes // 2, lanes // 4) if v >= 4 and ext and ext % v == 0), 0)
    if width == ext:
        sch.vectorize(inner)
    elif width:
        _, v = sch.split(inner, factors=[None, width])
        sch.vectorize(v)


def _parallel_order(v_outer: Any, spatial_outer: list, exts: list, r_idx: list[int], vec_pos: int,
                    few_registers: bool = False) -> list:
    """The loops fused into the parallel outer loop, outermost first: ``[v_outer, *spatial]``
    (channel tiles outermost), or ``[n, h, v_outer, w tiles]`` (the channel tiles just above the
    innermost spatial tiles) for a convolution (three reductions) whose weights
    (``kh*kw*ci*co`` floats) fit :data:`ROWS_OUTER_WEIGHT_BYTES`, at batch 1.

    Shapes it is for: the 3x3 convs of ResNet-style stages with up to 128 channels at batch 1.
    TVM's pool splits the fused loop statically, chunk i to thread i: with channel tiles
    outermost, thread 0 wrote channels 0..co/2 of every pixel and thread 1 the rest, while the
    next kernel (the next conv's pad copy, a pool, an add), split by rows, read each of its rows
    half from the other core's cache. Pixels outermost, each thread writes whole rows, the rows
    the next kernel's same thread reads. Channel tiles stay above the width tiles so that one
    panel serves a whole output row before the next. Not for RGB stems (fewer than 4 input
    channels): their one-vector panels (:func:`_stem_vectors`) are meant to be reused from L1 over
    the whole map; per row, ResNet-18's 7x7 stem ran 1.09-1.14x slower on one thread (three paired
    runs, load ~2-3) for a smaller 2-thread gain. The price: each thread reads all the weights per
    output row instead of half of them, hence the L2 bound (a 3x3 256 -> 256 conv, 2.25 MiB, keeps
    channel tiles outermost and one weight panel in L2 while the row tiles stream). Not at batch >
    1: there the maps no longer fit a core's L2 either way, resnet18 at batch 8 already scaled
    1.99x with channel tiles outermost, and its 64- and 128-channel convs ran 1.04-1.18x slower on
    one thread pixels first (one paired run, load ~3). Measured: see docs/per_device_speed.md,
    "The quiet run after steps 5-7".

    Rule 2 (:data:`STEM_IMAGES_OUTER`): on a 16-register target (``few_registers``: AVX2; measured
    there only, so AVX-512 builds keep their order) an RGB stem (fewer than 4 input channels) at
    batch > 1 runs ``[n, v_outer, h, w tiles]``: the images outermost, the channel tiles of one image inside.
    With the channel tiles outermost, each of ResNet-18's eight 8-channel tiles (AVX2, one vector:
    :func:`_stem_vectors`) swept the whole batch's padded input (8 x 118 x 118 x 3 floats, 1.3 MiB)
    and wrote 32 bytes of every 256-byte output pixel of the batch (6.4 MiB), out of L2; per image
    (167 KiB in, 0.8 MiB out) the input stays in L2. Measured: see docs/per_device_speed.md,
    "Session 17 (AVX2): narrow convs"."""
    weight = 4 * exts[vec_pos]
    for i in r_idx:
        weight *= exts[i]
    stem = exts[r_idx[-1]] < 4 if r_idx else False  # RGB input: see below
    single = exts[0] == 1  # batch 1 (the first loop of an NHWC conv is n)
    if ROWS_OUTER_CONV and len(r_idx) == 3 and len(spatial_outer) > 1 and weight <= ROWS_OUTER_WEIGHT_BYTES \
            and not stem and single:
        return [*spatial_outer[:-1], v_outer, spatial_outer[-1]]
    if (STEM_IMAGES_OUTER and few_registers and stem and not single and len(r_idx) == 3
            and len(spatial_outer) > 1):
        return [spatial_outer[0], v_outer, *spatial_outer[1:]]  # rule 2
    return [v_outer, *spatial_outer]


def _flops(exts: list) -> float:
    """2 x the iteration count of the reduction block (one multiply-add per iteration)."""
    total = 2.0
    for e in exts:
        total *= e
    return total


def _choose_tile(stmt: Any, exts: list, s_idx: list[int], r_idx: list[int], vec_pos: int,
                 lanes: int, full_width: bool = False,
                 narrow_min_vectors: int = 1) -> tuple[int, int, int | None, int, int | None, int]:
    """The register tile of the reduction block: (vector width, channel vectors nj, row axis,
    pixels per row ni, outer axis the tile also spans or None, its rows hi). The default
    (:func:`_tile_sizes`), then the rules that replace it for stems, wide inputs, narrow maps,
    narrow channel counts, (rule 1) tiles that overflow a 16-register file and (rules 3-4, on a
    ``full_width`` FMA target: :func:`vector.full_width_fma`) narrow maps (at least
    ``narrow_min_vectors`` channel vectors: :data:`NARROW_MIN_VECTORS`) and few channel vectors."""
    registers = 32 if lanes >= 16 else 16
    vec, nj_default, row_pos, ni = _tile_sizes(exts, s_idx, lanes)
    nj = _stem_vectors(exts, r_idx, vec, nj_default)
    col_pos, hi = None, 1
    narrow_map = ni < NARROW_ROWS  # before _wide_input_rows, which also returns a narrow row tile
    if vec == lanes and row_pos is not None and ni >= NARROW_ROWS and nj == nj_default:
        ni = _wide_input_rows(exts, r_idx, vec_pos, row_pos, vec, ni, _input_bytes(stmt, vec_pos))
    if (REGISTER_FILE_TILE and vec > 1 and row_pos is not None and len(r_idx) == 3
            and ni * nj + nj + 1 > registers):
        col_pos = _shared_outer_axis(stmt, ivs_of(stmt), s_idx, row_pos, vec_pos, exts)
        images = (_shared_outer_axis(stmt, ivs_of(stmt), s_idx, col_pos, vec_pos, exts)
                  if col_pos is not None and REGISTER_FILE_TILE_IMAGES else None)
        ni, hi, nj, col_pos = _register_file_tile(exts, s_idx, row_pos, col_pos, vec, registers, images)
    elif vec > 1 and row_pos is not None and ni < NARROW_ROWS:
        col_pos = _shared_outer_axis(stmt, ivs_of(stmt), s_idx, row_pos, vec_pos, exts)
        if (full_width and FULL_WIDTH_NARROW_TILE and narrow_map and exts[0] == 1 and vec == lanes
                and len(r_idx) == 3 and exts[r_idx[-1]] >= 4):  # not RGB stems / patch embeddings
            hi, nj = _full_width_tile(exts, s_idx, col_pos, ni, vec, registers, NARROW_MAX_PIXELS,  # rule 3
                                      narrow_min_vectors)
        else:
            hi, nj = _narrow_tile(exts, s_idx, col_pos, ni, vec, registers)
    elif (full_width and FULL_WIDTH_FEW_VECTORS and vec == lanes and row_pos is not None and nj == nj_default == 1
          and len(r_idx) == 3 and ni * nj < FULL_WIDTH_MIN_ACCUMULATORS):  # rule 4
        col_pos = _shared_outer_axis(stmt, ivs_of(stmt), s_idx, row_pos, vec_pos, exts)
        hi, nj = _full_width_tile(exts, s_idx, col_pos, ni, vec, registers, FEW_VECTORS_MAX_PIXELS)
        col_pos = col_pos if hi > 1 else None  # one row: _inline_border_pad may still take the conv
    elif (1 < vec < lanes and row_pos is not None and nj == nj_default
          and ni * nj < FEW_CHANNELS_ACCUMULATORS):
        col_pos = _shared_outer_axis(stmt, ivs_of(stmt), s_idx, row_pos, vec_pos, exts)
        hi, nj = _few_channels_tile(exts, s_idx, col_pos, ni, vec, registers)
    return vec, nj, row_pos, ni, col_pos, hi


def _register_file_tile(exts: list, s_idx: list[int], row_pos: int, col_pos: int | None, vec: int,
                        registers: int, images: int | None = None) -> tuple[int, int, int, int | None]:
    """(ni, hi, nj, the axis ``hi`` blocks or None) for a direct convolution whose default tile
    (``ni`` pixels x ``nj`` vectors) needs more vector registers than the target has (rule 1,
    :data:`REGISTER_FILE_TILE`): ``ni`` pixels of the row (dividing the output width, at most 8),
    ``hi`` rows of the outer axis ``col_pos`` (dividing it, at most 4) and ``nj`` channel vectors
    (dividing the channel vectors), with ``ni*hi*nj`` accumulators + ``nj`` weight vectors + 1
    broadcast within the register file. When no 2, 3 or 4 divides the height (7x7 maps), ``hi``
    may instead be 4 images of the axis ``images`` (the batch; its extent a multiple of 4).
    Chosen like :func:`_narrow_tile`: most FMAs per load, P·nj / (P + nj) with P = ``ni * hi``
    pixels, then most accumulators, then fewest channel vectors, then fewest rows. On 16
    registers: 14x14 maps get 2 x 2 pixels x 2 vectors, 28x28 and 56x56 maps 4 pixels x 2
    vectors, 7x7 maps 1 pixel x 4 images x 2 vectors at batch 4, 8, ... and 7 pixels x 1 vector
    otherwise. MLAS's AVX2 conv kernel (``SconvKernelFma3.S``)
    takes 3 pixels x 4 vectors (12 accumulators) with a 2- or 1-pixel remainder; a tile that
    does not divide the map is not one this rule can express (a predicate in the unrolled tile).

    Measured (``znver3``, 1 thread, thread CPU time, conv 3x3 + bias + ReLU, forced tiles,
    7 interleaved rounds, load 2.4-4.4; ORT = 1.00): 128 -> 128 on 14x14 b1 7x2 (the default)
    2.21, 2x2x2 1.11, 2x1x4 1.18, 7x1 1.37, 7x2x1 2.06; b8 2.23 / 1.15 / 1.19 / 1.42 / 1.97;
    256 -> 256 on 7x7 b1 7x2 1.64, 7x1 1.19, 1x4 1.77, 1x8 2.10; b8 1.94 / 1.34 / 1.93 / 2.27;
    64 -> 64 on 28x28 b1 7x2 1.99, 4x2 1.16, 2x2x2 1.17, 2x1x4 1.19, 4x2x1 2.06. Blocks of
    images on 7x7 maps (pixel x images x vectors, against 7x1): 256 -> 256 b8 1x4x2 0.99 and
    1.11 (7x1 1.33, 1.28), 1x2x4 1.21; b4 1x4x2 0.95 (7x1 1.25); stride 2 128 -> 256 onto 7x7 b8
    1x4x2 1.09 (7x1 1.49); but b2 1x2x4 1.24 against 7x1's 1.06, hence blocks of 4 only. Rule on / off
    (``benchmarks/conv_layers.py --only resnet --baseline ...REGISTER_FILE_TILE=False``, 7 rounds,
    load 3.2-4.9): see docs/per_device_speed.md, "Session 17 (AVX2): narrow convs"."""
    width = exts[row_pos]
    outer = [(1, -1)] + ([(c, col_pos) for c in (2, 3, 4) if exts[col_pos] % c == 0]
                         if col_pos is not None else [])
    if len(outer) == 1 and images is not None and exts[images] % 4 == 0:
        outer.append((4, images))  # a 7-high map: blocks of 4 images instead
    vectors = exts[s_idx[-1]] // vec
    best = (0.0, 0, 0, 0, 1, 1, 1, -1)
    for ni in (c for c in range(min(width, 8), 0, -1) if width % c == 0):
        for hi, axis in outer:
            for nj in (8, 4, 3, 2, 1):
                acc = ni * hi * nj
                if vectors % nj or acc > MAX_ACCUMULATORS or acc + nj + 1 > registers:
                    continue
                best = max(best, (acc / (ni * hi + nj), acc, -nj, -hi, ni, hi, nj, axis))
    return best[4], best[5], best[6], (best[7] if best[7] >= 0 else None)


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
