"""CPU rule for depthwise convolutions in NHWC: rows outer, channels in vectors, memory-bound.

Shapes it is for: one reduction block computing
``out[n, h, w, c] += pad[n, h*s + ry*d, w*s + rx*d, c + rc] * W[ry, rx, rc, c]`` with the
channel-group reduction ``rc`` of extent 1 (TVM's ``group_conv2d_nhwc`` with groups = channels,
which is what a depthwise ``Conv`` becomes after the pipeline's NHWC layout pass), any kernel
size, stride or dilation, channels a multiple of the vector width (or of half of it), and its
fused producers (the padding) and epilogue (bias, batch-norm affine, ReLU / ReLU6 clamp,
residual add). MobileNet/EfficientNet-style ``k x k`` depthwise layers are the target.

Why a rule of its own: a depthwise conv does ``k*k`` FMAs per output element and reads one input
element per FMA, i.e. it is bound by memory/L1 bandwidth, not by the FMA units. The
GEMM-style :class:`~backends.tvm.schedules.contraction.Contraction` schedule put channel tiles
outermost, so it streamed the whole input once per 32-channel tile with a stride of C floats,
and it wrote the padded input to memory in a separate pass. Here (the structure of MLAS's NHWC
depthwise kernel, written as TVM schedule primitives)::

    for (n, h) in parallel_if_worth(N x H_out):          # one output row per task
        padrow[kh rows, W_in + pads, C] = pad(x)          # only the rows this output row reads
        for wo in W_out / WR:                              # (materialised per row: stays in L1/L2)
            for co in C / V:
                acc[WR, V] = 0                             # WR vector accumulators
                for ry, rx in kh x kw:
                    for wi in unroll(WR):                   # WR independent FMA chains
                        acc[wi, :] += padrow[ry, (wo*WR + wi)*s + rx, co*V:(co+1)*V] * W[ry, rx, co*V:..]
                out[n, h, wo*WR.., co*V..] = epilogue(acc)  # BN, clamp, residual fused

Every load is a contiguous vector over channels, every input row is read from memory once per
output row that needs it (``kh / s`` times, from cache after the first), and the output is
written once with its epilogue applied. ``WR`` (:func:`row_tile`) is the largest divisor of
the output width up to 8: 8 independent accumulators hide the FMA latency.

Padding (:data:`PAD_INLINE`, the default for the layers :data:`TILE_INPUT` below does not take:
stride 2, dilation, pooling): the pad block is inlined into the conv, so each tap
loads ``x`` directly under a bounds check (``if_then_else`` on the row and column only: one
scalar test per vector load, the same for every channel lane) and no padded copy is written.
Measured on Zen 4 (1 thread, thread CPU time, each kernel's median over interleaved rounds in one
process, MobileNetV2's 3x3 layers at 28-56 px, 7 px for 576 channels): 0.45-0.87x the time of
the copying variants below at batch 8 and 0.5-0.8x at batch 1; a padded copy costs a full write
and re-read of the input, and the conv's own loads are L1/L2-bound, not ALU-bound. When the
inline fails (a pad the rule does not recognise) or :data:`PAD_INLINE` is off, the padded rows
are computed per output row when that copies each input row at most :data:`MAX_PAD_RECOPY` times
(``kh / stride``: stride-2 layers); for stride 1 the padded input is written once before the
loop, as a parallel vectorised copy (measured: per row 0.67x the time of pad-once at stride 2,
1.1-1.3x at stride 1).

Input tiles (:data:`TILE_INPUT`, the default for stride 1, dilation 1). The padded input vectors
that one kernel row of a register tile reads, ``WR + kw - 1`` of them, are computed into a small
buffer inside the ``ry`` loop (the pad block at ``ry``: the bounds check once per vector), and the
``rx`` taps are unrolled, so each input vector is loaded once and feeds up to ``kw`` FMAs from a
register::

    for ry in kh:
        win[WR + kw - 1, V] = pad(x)[row*s + ry, wo*WR : wo*WR + WR + kw - 1, co*V : (co+1)*V]
        for rx in unroll(kw): for wi in unroll(WR):
            acc[wi, :] += win[wi + rx, :] * W[ry, rx, co*V:..]

The window and the accumulators (``global`` scope, ``WR x V`` floats) compact to under
:data:`INPUT_TILE_BYTES` (TVM's 1 KiB stack limit), so both are stack arrays that LLVM keeps in
registers. Why: with the padding inlined, LLVM reused a loaded input vector across the taps that
read it only in a serial kernel. In a parallel row loop TVM emits the body as a lambda whose
buffer pointers come from a closure (no ``noalias``) with 32-bit index arithmetic, and the
accumulators lived in a workspace from ``TVMBackendAllocWorkspace`` (its ``local`` scope is never
put on the stack; with :data:`SPLIT_BORDER`, a whole output row of them): every tap reloaded its
input (mobilenet b8's 144 on 28x28: 169 of 321 FMAs with a memory operand, against 22 of 259
serial), so a parallel layer ran 1.15x its serial time on one thread. Tiled, the serial and
parallel kernels are the same 63 FMAs. Measured (1 thread, thread CPU time, paired with the
inlined padding in one process): ``benchmarks/kernel_profile.py``'s depthwise class 0.82x on
mobilenet b8 (load 5-7), 0.83x at b1; single layers at batch 8 0.64-0.96x (heldout_mbv2's 24 on
48x48 to 288 on 6x6), at batch 1 0.69-0.94x, except mobilenet's 32 on 56x56 at b1 (1.04x).
Stride 2 stays inlined: a window vector feeds at most 2 of 3 taps there (15 loads for 21 FMAs
against 9 for 21 at stride 1), and mobilenet b8's 96 on 56x56 stride 2 ran 1.29x slower tiled.

Pooling (:data:`POOLING`): an NHWC ``MaxPool`` / ``AveragePool`` block is the same loop nest
without the weight (loops ``(n, h, w, c, ry, rx)``, one read of the padded input), equally
memory-bound, and it gets the same schedule. Under :class:`Contraction` its padded input was
written in full first (for -inf / 0 padding) and then read once per 32-channel tile, strided:
ResNet-18's 3x3 stride-2 max pool after the stem at batch 8 (56x56x64) ran 3.4x ORT's time.

Threads: the ``(n, h)`` loop is parallel only when the layer has at least
:func:`~backends.tvm.schedules.threads.parallel_min_flops` FLOPs (below, the fork/join costs
more than it saves: :mod:`backends.tvm.schedules.threads`); a pooling layer also needs
:data:`POOL_PARALLEL_MIN_ELEMENTS` output elements (:func:`_rows_parallel`).
"""

from __future__ import annotations

from typing import Any


from .contraction import Contraction, TryRule, _uses
from .injective import schedule_spatial_block
from .threads import worth_parallel
from .vector import const_extent, largest_divisor, vector_lanes

#: (n, h) tasks below which the padded rows are not computed per row (too few rows to matter)
MAX_ROW_TILE = 8
#: pad per output row when that copies each input row at most this many times (kh / stride)
MAX_PAD_RECOPY = 1.5
#: None: by :data:`MAX_PAD_RECOPY`; True/False forces it (benchmarks/depthwise.py compares);
#: used only when the padding is not inlined
PAD_PER_ROW: bool | None = None
#: inline the padding into the conv's loads (module docstring, "Padding")
PAD_INLINE: bool = True
#: NHWC max/average pooling takes this rule too (module docstring, "Pooling"); off: Contraction
POOLING: bool = True
#: with the padding inlined (not :data:`TILE_INPUT`: stride 2, dilation, pooling), the first and
#: last column tiles get loops of their own, so that the
#: interior tiles' loads carry no column bounds check (:func:`_split_border_columns`); off: one loop
SPLIT_BORDER: bool = True
#: a pooling layer writing fewer output elements than this runs on one thread
#: (:func:`_rows_parallel`); 0: pooling follows the FLOP threshold like the convolutions
POOL_PARALLEL_MIN_ELEMENTS = 1 << 18
#: the share of the FMA peak a depthwise conv runs at on one thread, which scales its FLOP
#: threshold for the thread pool (:func:`_rows_parallel`); 1.0: the GEMM threshold as is
PARALLEL_PEAK_FRACTION = 0.4
#: stride-1 convolutions: the padded input per kernel row of each register tile into a stack
#: buffer, the taps unrolled (module docstring, "Input tiles"); off: the padding is inlined
TILE_INPUT: bool = True
#: a window or accumulator buffer of this many bytes or more is not put on the stack by TVM
#: (``kMaxStackAlloca``): it becomes a workspace allocation, what :data:`TILE_INPUT` avoids
INPUT_TILE_BYTES = 1024


def row_tile(width: int) -> int:
    """Output pixels per register tile: the largest divisor of ``width`` up to 8 (8 independent
    FMA chains cover 4-cycle latency x 2 pipes); 1 for prime widths (correct, slower)."""
    return largest_divisor(width, tuple(range(MAX_ROW_TILE, 0, -1)))


class Depthwise(TryRule):
    """NHWC depthwise convolution (module docstring: which shapes, which schedule)."""

    def _apply(self, sch: Any, target: Any) -> Any:
        found = _match_depthwise(sch)
        if found is None:
            return None
        root, red, loops, exts, stride = found
        taps = exts[4] * exts[5]
        lanes = _lanes(target, exts[3])
        if lanes is None:
            return None
        tiled = _tile_input(sch, red, exts, stride, lanes)
        inlined = not tiled and PAD_INLINE and _inline_pads(sch, red)
        per_row = PAD_PER_ROW if PAD_PER_ROW is not None else exts[4] / stride <= MAX_PAD_RECOPY
        per_row = per_row and not inlined and not tiled
        c = exts[3]
        wr = _input_tile_width(exts, stride, lanes) if tiled else row_tile(exts[2])
        flops = 2.0 * exts[0] * exts[1] * exts[2] * c * taps

        wb = sch.cache_write(red, 0, "global" if tiled else "local")
        ln, lh, lw, lc, ry, rx, *rc = sch.get_loops(red)  # no rc: pooling
        wo, wi = sch.split(lw, factors=[None, wr])
        co, cv = sch.split(lc, factors=[None, lanes])
        sch.reorder(ln, lh, wo, co, ry, rx, *rc, wi, cv)
        row = sch.fuse(ln, lh)
        if _rows_parallel(flops, exts):
            sch.parallel(row)
        sch.reverse_compute_at(wb, co, preserve_unit_loops=True)
        names_before = {str(sch.get(b).name_hint) for b in sch.get_child_blocks(root)}
        Contraction._inline_epilogue(sch, wb)
        sch.unroll(wi)
        sch.vectorize(cv)
        init = sch.decompose_reduction(red, ry)
        Contraction._vectorize_tail(sch, init, lanes)
        Contraction._vectorize_tail(sch, wb, lanes)

        red_name, wb_name = str(sch.get(red).name_hint), str(sch.get(wb).name_hint)
        for blk in sch.get_producers(red):
            if tiled and _is_pad(sch, blk):  # the input vectors one kernel row of this tile reads
                sch.compute_at(blk, ry, preserve_unit_loops=True)
                *_, px, ch = sch.get_loops(blk)
                sch.vectorize(ch)
                sch.unroll(px)
            elif per_row and _is_pad(sch, blk):  # the rows this output row reads, next to it in cache
                sch.compute_at(blk, row, preserve_unit_loops=True)
                _vectorize_innermost(sch, blk, lanes)
        if tiled:
            sch.unroll(rx)
        for blk in sch.get_child_blocks(root):
            name = str(sch.get(blk).name_hint)
            if name in (red_name, wb_name, str(sch.get(init).name_hint)) or name not in names_before:
                continue
            if len(sch.get_loops(blk)) > 0 and not ((per_row or tiled) and _is_pad(sch, blk)):
                schedule_spatial_block(sch, blk, lanes)
        if inlined and SPLIT_BORDER:
            return _split_border_columns(sch, wo, exts[2] // wr)
        return sch


def _lanes(target: Any, channels: int) -> int | None:
    """Vector lanes over channels: the target's float32 width, or half of it when the channels
    are not a multiple of the full width; None below 4 lanes or when neither divides."""
    lanes = vector_lanes(target, 32)
    if channels % lanes:
        lanes //= 2
    return None if lanes < 4 or channels % lanes else lanes


def _input_tile_width(exts: list[int], stride: int, lanes: int) -> int:
    """Output pixels per register tile when the input is tiled: the largest divisor of the output
    width up to :data:`MAX_ROW_TILE` whose input window (``(wr-1)*stride + kw`` vectors) stays
    under :data:`INPUT_TILE_BYTES`."""
    ok = [w for w in range(MAX_ROW_TILE, 0, -1)
          if exts[2] % w == 0 and ((w - 1) * stride + exts[5]) * lanes * 4 < INPUT_TILE_BYTES]
    return ok[0] if ok else 1


def _tile_input(sch: Any, red: Any, exts: list[int], stride: int, lanes: int) -> bool:
    """Whether the padded input is computed per kernel row of each register tile (:data:`TILE_INPUT`):
    a convolution (not pooling) with exactly one pad producer and a window that fits."""
    if not TILE_INPUT or len(exts) != 7 or stride != 1 or not _unit_steps(sch, red):
        return False
    pads = [b for b in sch.get_producers(red) if _is_pad(sch, b)]
    if len(pads) != 1:
        return False
    return ((_input_tile_width(exts, stride, lanes) - 1) * stride + exts[5]) * lanes * 4 < INPUT_TILE_BYTES


def _unit_steps(sch: Any, red: Any) -> bool:
    """Whether the data read of the depthwise block ``red`` moves by one pixel per output pixel
    and per kernel tap in both spatial dims (stride 1, dilation 1)."""
    from tvm import tirx
    from tvm.sym.pattern import detect_linear_equation

    stmt = sch.get(red)
    _, h, w, _, ry, rx = (iv.var for iv in stmt.iter_vars[:6])
    data = [r.region for r in stmt.reads if len(r.region) == 4 and _uses(r.region[1].min, h)]
    if len(data) != 1:
        return False
    coefs = [detect_linear_equation(data[0][d].min, [v]) for d, v in ((1, h), (1, ry), (2, w), (2, rx))]
    return all(len(c) == 2 and isinstance(c[0], tirx.IntImm) and int(c[0]) == 1 for c in coefs)


def _rows_parallel(flops: float, exts: list[int]) -> bool:
    """Whether the ``(n, h)`` loop runs on the thread pool: from ``threads.worth_parallel(flops)``,
    and for a pooling layer (six loops, no weight) only when it writes at least
    :data:`POOL_PARALLEL_MIN_ELEMENTS` output elements.

    Shapes it is for: the max pool after ResNet's stem at batch 1 (3x3 stride 2, 112x112x64 ->
    56x56x64: 3.6 MFLOP, above the 2 MFLOP threshold, but one compare per load, ~25 us on one
    thread). A pool reads its input once and does no FMAs, so the FLOP threshold (sized for
    kernels that run at the FMA rate on cached data) overrates its work; on 2 threads it ran at
    2.5x its 1-thread time (0.024 -> 0.060 ms, quiet machine). 2^18 elements (1 MiB written)
    keeps that layer on one thread and the same pool at batch 8 (1.6M elements) parallel.

    A depthwise convolution's FLOP threshold is scaled by :data:`PARALLEL_PEAK_FRACTION` (0.4):
    it does ``k*k`` FMAs per loaded input vector and runs at 40-56 GFLOP/s on one thread (Zen 4,
    MobileNetV2's layers at batch 1 and 8, thread CPU time: 32 on 56x56 49, 96 on 28x28 45,
    192 on 7x7 44, 432 on 3x3 56), 0.34-0.48 of the 118 GFLOP/s FMA peak the threshold is sized
    for, so at equal FLOPs it runs 2-3x longer than a GEMM and covers the fork/join sooner.
    Shapes it moves to the pool: depthwise layers of 0.8-2 MFLOP, i.e. 20-37 us on one thread
    (mobilenet b1's 32 on 56x56 and 96 on 28x28 stride 2, heldout_mbv2 b1's 24 on 48x48 and 96 /
    144 on 24x24 / 12x12, b8's 192 on 7x7, 576 on 4x4, 288 on 6x6, 432 on 3x3); those of 6-14 us
    (0.3-0.7 MFLOP) stay on one thread. Pooling keeps the plain threshold (no FMAs at all, and
    its element bound above)."""
    if len(exts) == 6:  # pooling
        big = not POOL_PARALLEL_MIN_ELEMENTS or exts[0] * exts[1] * exts[2] * exts[3] >= POOL_PARALLEL_MIN_ELEMENTS
        return big and worth_parallel(flops)
    return worth_parallel(flops, PARALLEL_PEAK_FRACTION)


def _split_border_columns(sch: Any, wo: Any, tiles: int) -> Any:
    """The schedule with the column-tile loop ``wo`` (``tiles`` iterations) run as three loops:
    its first tile, the interior tiles, its last tile; ``sch`` itself when ``tiles`` < 3.

    Shapes it is for: depthwise convolutions and poolings whose padding is inlined
    (:data:`PAD_INLINE`) and whose output width spans at least 3 register tiles (MobileNet's
    28x28-112x112 maps, ResNet's 56x56 max pool; 7x7 and 14x14 maps are 1-2 tiles of 7: no
    change). Inlined, every tap's vector load carries a bounds check on its row and column; in
    the interior loop the column check is provably true for every iteration and TVM's
    simplifier drops it at lowering (the row check stays, one per kernel row, hoisted out of the
    unrolled pixels), as MLAS/XNNPACK run border and interior pixels through separate paths. A
    border wider than one tile (a 5x5 kernel on a map with 1-pixel tiles) keeps its check in the
    next tiles: slower there, never wrong, the condition is unchanged. Measured (1 thread, thread
    CPU time, interleaved with the unsplit build): mobilenet b8's depthwise class 0.90x the
    unsplit time (kernel_profile, 15 runs); single layers at b8 0.88-1.06x (noisy, load ~4).

    How: TVM's ``loop_partition`` primitive crashes (segfault in TVM 0.27) on a loop holding
    more than one block (here the init, update and write-back blocks), so the loop is copied in
    the PrimFunc itself (same body, bounds [0, 1), [1, tiles - 1), [tiles - 1, tiles)) and
    ``s_tir.transform.ConvertSSA`` gives each copy its own variables."""
    if tiles < 3:
        return sch
    import tvm
    from tvm import s_tir, tirx

    target = sch.get(wo)

    def rebuild(stmt: Any) -> Any:
        if isinstance(stmt, tirx.For):
            if stmt.same_as(target):
                return tirx.SeqStmt([tirx.For(
                    stmt.loop_var, tirx.const(lo, str(stmt.extent.ty)), tirx.const(n, str(stmt.extent.ty)),
                    stmt.kind, stmt.body, stmt.thread_binding, stmt.annotations)
                    for lo, n in ((0, 1), (1, tiles - 2), (tiles - 1, 1))])
            return tirx.For(stmt.loop_var, stmt.min, stmt.extent, stmt.kind, rebuild(stmt.body),
                            stmt.thread_binding, stmt.annotations)
        if isinstance(stmt, tirx.SeqStmt):
            return tirx.SeqStmt([rebuild(x) for x in stmt.seq])
        if isinstance(stmt, s_tir.SBlockRealize):
            b = stmt.block
            block = s_tir.SBlock(b.iter_vars, b.reads, b.writes, b.name_hint, rebuild(b.body), b.init,
                                 b.alloc_buffers, b.match_buffers, b.annotations)
            return s_tir.SBlockRealize(stmt.iter_values, stmt.predicate, block)
        return stmt

    func = sch.mod["main"]
    func = func.with_body(rebuild(func.body))
    mod = s_tir.transform.ConvertSSA()(tvm.IRModule({"main": func}))  # the copies' variables, renamed
    return s_tir.Schedule(mod)


def _match_depthwise(sch: Any) -> tuple[Any, Any, list[Any], list[int], int] | None:
    """(root, reduction block, its 7 loops, their extents, the vertical stride) for an NHWC depthwise conv block, or
    None. Checks: loops (n, h, w, c, ry, rx, rc) with rc of extent 1; the output indexed by
    (n, h, w, c); two reads, one using (h, ry) in dim 1, (w, rx) in dim 2, c in dim 3 only, the
    other (the weight) using c only in its last dim and neither h nor w. With :data:`POOLING`,
    also a pooling block: loops (n, h, w, c, ry, rx) and the data read only."""
    from tvm import tirx

    root = sch.get_sblock("root")
    reds = [b for b in sch.get_child_blocks(root)
            if any(iv.iter_type == tirx.IterVar.CommReduce for iv in sch.get(b).iter_vars)]
    if len(reds) != 1:
        return None
    red = reds[0]
    stmt = sch.get(red)
    ivs = list(stmt.iter_vars)
    kinds = "".join("S" if iv.iter_type == tirx.IterVar.DataPar else "R" for iv in ivs)
    loops = sch.get_loops(red)
    pooling = POOLING and kinds == "SSSSRR"
    if (kinds != "SSSSRRR" and not pooling) or len(loops) != len(kinds) or stmt.init is None or len(stmt.writes) != 1:
        return None
    if str(stmt.writes[0].source.dtype) != "float32":
        return None
    exts = [const_extent(sch, lp) for lp in loops]
    if any(e is None for e in exts) or (not pooling and exts[6] != 1):
        return None
    n, h, w, c, ry, rx = (iv.var for iv in ivs[:6])
    out = stmt.writes[0].region
    if not all(_uses(out[i].min, v) for i, v in enumerate((n, h, w, c))):
        return None
    reads = [r for r in stmt.reads if not r.source.same_as(stmt.writes[0].source)]
    if len(reads) != (1 if pooling else 2):
        return None
    data = [r for r in reads if len(r.region) == 4 and _uses(r.region[1].min, h) and _uses(r.region[2].min, w)]
    weight = [r for r in reads if r not in data]
    if len(data) != 1 or len(weight) != (0 if pooling else 1):
        return None
    d, wt = data[0].region, (weight[0].region if weight else [])
    if not (_uses(d[1].min, ry) and _uses(d[2].min, rx) and _uses(d[3].min, c)):
        return None
    if _uses(d[1].min, c) or _uses(d[2].min, c) or any(_uses(r.min, c) for r in wt[:-1]):
        return None
    if wt and (not _uses(wt[-1].min, c) or any(_uses(r.min, v) for r in wt for v in (h, w))):
        return None
    from tvm.sym.pattern import detect_linear_equation

    coef = detect_linear_equation(d[1].min, [h])
    if len(coef) != 2:
        return None
    return root, red, loops, exts, int(coef[0])


def _inline_pads(sch: Any, red: Any) -> bool:
    """Inline the pad producers of ``red`` into it; True when there was one and every one
    inlined (a failed ``compute_inline`` changes nothing: TVM checks a primitive before it acts)."""
    pads = [b for b in sch.get_producers(red) if _is_pad(sch, b)]
    try:
        for blk in pads:
            sch.compute_inline(blk)
    except Exception:  # noqa: BLE001 - e.g. a pad read by another block too
        return False
    return bool(pads)


def _is_pad(sch: Any, blk: Any) -> bool:
    """A spatial block that writes an intermediate buffer with a conditional (padding) value."""
    from tvm import tirx

    stmt = sch.get(blk)
    if any(iv.iter_type != tirx.IterVar.DataPar for iv in stmt.iter_vars):
        return False
    body = stmt.body
    return isinstance(body, tirx.BufferStore) and "if_then_else" in str(body.value)


def _vectorize_innermost(sch: Any, blk: Any, lanes: int) -> None:
    loops = sch.get_loops(blk)
    ext = const_extent(sch, loops[-1]) if loops else None
    if ext is None or ext % lanes:
        return
    if ext > lanes:
        _, v = sch.split(loops[-1], factors=[None, lanes])
        sch.vectorize(v)
    else:
        sch.vectorize(loops[-1])
