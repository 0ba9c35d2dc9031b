"""Gradients of contractions: MatMul, Gemm, Conv and ConvTranspose (groups, strides, pads,
dilations).

Conv's input gradient is a ConvTranspose of dY with the same weight; its weight gradient is a
Conv of the input (batch and channel axes swapped, groups folded into channels) with dY as the
kernel, strides and dilations exchanged, and the result sliced to the kernel size (padding can
leave a larger window). ConvTranspose is Conv's input gradient, so its rules are the same two
with the roles of x and dy exchanged.

Rule (GEMM weight gradient, :data:`GEMM_WEIGHT_GRAD`): a 2-D Conv of one group with at most
:data:`GEMM_MAX_OFFSETS` kernel offsets (3x3, 1x1, 3x1, ...: every ResNet/UNet/MobileNet
pointwise conv) takes its weight gradient as one MatMul over an im2col of the input:
``dW[o, (c, k)] = dY[o, (n, i)] @ cols[(n, i), (c, k)]``, ``cols`` the input (padded) sliced at
each kernel offset k with the conv's strides and dilations. ONNX Runtime runs the Conv form
(a kernel as large as the whole output-gradient map) far below its GEMM rate: one thread, CPU
time, the zoo resnet's convs at micro-batch 2: layer1 1.09 -> 0.64 ms, layer3 1.68 -> 0.63,
layer4 6.13 -> 1.70, layer4's stride-2 conv 4.47 -> 0.69; at batch 8 layer1 4.74 -> 3.57, layer4
7.73 -> 3.01. The 7x7 stem on 3 channels (49 offsets) ran 0.77 -> 1.14 ms, slower (its im2col
is 49 input copies for a small GEMM), hence the offset limit; grouped and 1-D/3-D convs keep the
Conv form. ``PARTITIONER_TRAIN_GEMM_WGRAD=0`` turns the rule off.

Rule (im2col layout, :data:`IM2COL_CHANNELS_FIRST`): when the columns have at least as many rows
as the weight gradient has output channels (``N*Ho*Wo >= O``: the columns at least as large as
``dW``; a pipeline micro-batch's early layers, resnet-18's layer1-2 at 2 images), they are built
as ``cols^T [C*K, N*Ho*Wo]``: the padded input's planes moved to ``[C, N, Hp, Wp]``, each kernel
offset's slice stacked on axis 1 (``[C, K, N, Ho, Wo]``, whose reshape is free), then ``dW^T =
cols^T @ dY^T`` and ``dW`` transposed back (weight-sized). The other form stacks the offsets on
axis 2 of ``[N, C, K, Ho, Wo]`` and transposes those K-times-larger columns to ``[N*Ho*Wo, C*K]``;
TVM fuses that into one kernel whose innermost axis is the offset (a select over K inputs per
element): resnet's stage-0 ``B`` at 2 images spent 32 of 146 ms of kernels a step in such
kernels (``benchmarks/pipeline_runner_profile.py --top``). When ``dW`` is larger than the
columns (layer3-4 at 2 images) the transposes of ``dW`` and ``dY`` cost more than the columns'
one, so those keep the other form. Measured (``benchmarks/pipeline_wgrad_forms.py``, a one-conv
training step per shape, 3x3 pad 1, both forms interleaved, thread CPU medians, one thread, TVM
conv_algorithm auto, load 9.9-11.0; channels first against the other form): TVM at batch 2 layer1 (64 ch, 16x16)
1.58 / 1.86 ms, layer2 (128, 8x8) 1.11 / 1.31, layer3 (256, 4x4, not taken) 3.51 / 1.75, layer4
(512, 2x2, not taken) 13.75 / 5.03; TVM at batch 16 layer1 11.66 / 13.46, layer3 9.10 / 8.67
(``N*Ho*Wo = O``: taken, 5% slower); ONNX Runtime at batch 2 layer1 1.76 / 2.04, layer2 1.87 /
1.93, at batch 16 layer1 12.70 / 15.49, layer2 10.18 / 11.07, layer3 11.43 / 10.29 (taken, 10%
slower). Default off: the conv-level gain did not show at the step level. Paired
``benchmarks/pipeline_stages.py --model resnet --backend tvm --baseline
partitioner.training.rules.linear.IM2COL_CHANNELS_FIRST=False`` (stage runners alone, thread CPU,
medians; on / off): 7 rounds, load 8.3-10.5, stage 0 243.7 / 248.1 ms, stage 1 174.6 / 175.8; 11
rounds, load 3.7-7.3, stage 0 219.0 / 217.0, stage 1 152.3 / 156.1.
``PARTITIONER_TRAIN_IM2COL_CHANNELS_FIRST=1`` turns the rule on.

Rule (NHWC im2col, :data:`IM2COL_NHWC`, session 18): where the columns are at least as large as
dW (``N*Ho*Wo >= O``: a pipeline micro-batch's early layers, resnet-18's stem-to-layer2 at 2 images,
layer1-3 at batch 16) the columns are built channels last: ``x`` to [N, H, W, C], padded on H and
W, each offset's slice [N, Ho, Wo, C] concatenated on the channel axis (``[N, Ho, Wo, K*C]``, whose
reshape to ``cols [N*Ho*Wo, K*C]`` is free), ``dY [O, N*Ho*Wo] @ cols`` = [O, kh, kw, C], one
weight-sized transpose to OIHW. The copies then run along whole channel rows: TVM's Injective rule
splits the concat into one vector copy per offset (``backends/tvm/schedules/injective.py``,
``CONCAT_THROUGH_RESHAPE``), and a stage's ``B`` that reads an NHWC stash skips the first
transpose (``nhwc_stash`` rule 5). For any backend (the step graph does not know its backend).
Measured (``benchmarks/im2col_forms_micro.py``, 1 thread, thread CPU per call, Intel AVX-512,
load 2.5-4.1; NCHW form / this form): TVM layer1 at 2 images 1086.6 / 158.7 us, layer2 833.2 /
82.1, layer1 at batch 16 11855.8 / 1929.7; ONNX Runtime 974.7 / 587.8, 659.1 / 242.3, 12090.4 /
8440.7. The resnet's stage 0 at 2 images (``benchmarks/stage_kernels_ab.py``, load 4.5-5.7):
kernels 302.1 -> 238.0 ms a step, the im2col 66.4 -> 9.3 ms. ``PARTITIONER_TRAIN_IM2COL_NHWC=0``
turns it off; the channels-first rule, an explicit opt-in, wins where both are on.

Rule (flat MatMul weight gradient, :data:`MATMUL_FLAT_WEIGHT_GRAD`): ``y = a @ W`` with ``a``
batched ``[*B, M, K]`` and ``W`` 2-D ``[K, N]`` (every transformer projection: bert's q/k/v/o and
MLP weights on ``[batch, tokens, hidden]``) takes ``dW = a^T @ dy`` summed over ``*B`` as one 2-D
GEMM over the flattened rows: ``Gemm(Reshape(a, [B*M, K]), Reshape(dy, [B*M, N]), transA=1)``.
The batched form is a batched MatMul to a ``[*B, K, N]`` intermediate (B weight-sized copies)
and a ReduceSum over the batch, a memory-bound pass ONNX Runtime runs slowly; the flat form is
one call with no intermediate (the Reshapes are free views). Batched ``W`` (attention's q @ k^T)
keeps the batched form: its gradient is not summed. Measured (ONNX Runtime, one thread, CPU time
on a loaded machine, docs/training.md): bert's 256x1024 MLP weight gradient at 64 tokens, batch
4 / 16 / 32: 2.8 -> 1.9, 11.6 -> 7.3, 15.1 -> 15.0 ms (the batched form is slow at small batches:
a data rank's or a micro-batch's); the zoo bert's step at batch 16 166 -> 135 ms, at batch 32
297 -> 287, its 1-rank peak memory 404 -> 268 MiB. ``PARTITIONER_TRAIN_FLAT_MATMUL_WGRAD=0``
turns the rule off.
"""

from __future__ import annotations

import os

import numpy as np

from partitioner.training.autodiff import GradContext, register_gradient


#: the GEMM weight gradient rule (module docstring); ``PARTITIONER_TRAIN_GEMM_WGRAD=0`` turns it off
GEMM_WEIGHT_GRAD = os.environ.get("PARTITIONER_TRAIN_GEMM_WGRAD", "1") != "0"
#: the GEMM weight gradient's columns built channels last (module docstring, rule "NHWC im2col",
#: session 18); ``PARTITIONER_TRAIN_IM2COL_NHWC=0`` turns it off (in MPI ranks too).
#: :data:`IM2COL_CHANNELS_FIRST` (off by default, an explicit opt-in) wins where both apply.
IM2COL_NHWC = os.environ.get("PARTITIONER_TRAIN_IM2COL_NHWC", "1") != "0"
#: the most kernel offsets (kh x kw) whose im2col copies the GEMM form pays (module docstring)
GEMM_MAX_OFFSETS = 9
#: the GEMM weight gradient's columns built channels first (module docstring, rule "im2col
#: layout"); default OFF: no step-level win in paired runs; ``PARTITIONER_TRAIN_IM2COL_CHANNELS_FIRST=1``
#: turns it on (in MPI ranks too)
IM2COL_CHANNELS_FIRST = os.environ.get("PARTITIONER_TRAIN_IM2COL_CHANNELS_FIRST", "0") == "1"
#: that form only where ``N*Ho*Wo >= this x O`` (the columns at least as large as dW; 0: everywhere,
#: as ``benchmarks/pipeline_wgrad_forms.py`` sets it to time both forms on every shape)
IM2COL_MIN_ROWS_PER_CHANNEL = 1
#: the flat MatMul weight gradient rule (module docstring); ``PARTITIONER_TRAIN_FLAT_MATMUL_WGRAD=0``
#: turns it off (a batched MatMul + ReduceSum; the environment reaches MPI ranks, for paired runs)
MATMUL_FLAT_WEIGHT_GRAD = os.environ.get("PARTITIONER_TRAIN_FLAT_MATMUL_WGRAD", "1") != "0"


def _swap_last(g: GradContext, v, rank: int):
    perm = list(range(rank))
    perm[-1], perm[-2] = perm[-2], perm[-1]
    return g.op("Transpose", v, perm=perm)


@register_gradient("MatMul")
def matmul(g: GradContext) -> list:
    """y = a @ b (batched, broadcasting): da = dy @ b^T, db = a^T @ dy, each summed to shape."""
    a, b = g.x
    dy = g.dy[0]
    sa, sb, sy = g.shape(a), g.shape(b), g.shape(g.y[0])
    if len(sa) < 2 or len(sb) < 2:
        a2 = g.op("Reshape", a, g.ints([1, sa[0]])) if len(sa) == 1 else a
        b2 = g.op("Reshape", b, g.ints([sb[0], 1])) if len(sb) == 1 else b
        sa2 = (1, sa[0]) if len(sa) == 1 else sa
        sb2 = (sb[0], 1) if len(sb) == 1 else sb
        sy2 = sa2[:-1] + sb2[-1:] if len(sa2) >= len(sb2) else sb2[:-2] + sa2[-2:-1] + sb2[-1:]
        dy = g.op("Reshape", dy, g.ints(list(sy2)))
        a, b, sa_full, sb_full, sy = a2, b2, sa, sb, sy2
        sa, sb = sa2, sb2
    else:
        sa_full, sb_full = sa, sb
    da = db = None
    if g.needs[0]:
        da = g.op("MatMul", dy, _swap_last(g, b, len(sb)))
        da_shape = sy[:-1] + (sb[-2],)
        da = g.reduce_to(da, da_shape, sa) if len(da_shape) >= len(sa) else da
        if sa != sa_full:
            da = g.op("Reshape", da, g.ints(list(sa_full)))
    if g.needs[1] and MATMUL_FLAT_WEIGHT_GRAD and len(sb_full) == 2 and len(sa) >= 3:
        rows = int(np.prod(sa[:-1]))
        a2 = g.op("Reshape", a, g.ints([rows, sa[-1]]))
        dy2 = g.op("Reshape", dy, g.ints([rows, sy[-1]]))
        db = g.op("Gemm", a2, dy2, transA=1)
    elif g.needs[1]:
        db = g.op("MatMul", _swap_last(g, a, len(sa)), dy)
        db_shape = sy[:-2] + (sa[-1], sy[-1])
        db = g.reduce_to(db, db_shape, sb) if len(db_shape) >= len(sb) else db
        if sb != sb_full:
            db = g.op("Reshape", db, g.ints(list(sb_full)))
    return [da, db]


@register_gradient("Gemm")
def gemm(g: GradContext) -> list:
    """y = alpha * op(A) @ op(B) + beta * C, op = transpose when transA/transB."""
    a, b = g.x[0], g.x[1]
    dy = g.dy[0]
    alpha, beta = float(g.attr("alpha", 1.0)), float(g.attr("beta", 1.0))
    ta, tb = int(g.attr("transA", 0)), int(g.attr("transB", 0))
    da = db = dc = None
    if g.needs[0]:
        da = (g.op("Gemm", b, dy, alpha=alpha, transA=tb, transB=1) if ta
              else g.op("Gemm", dy, b, alpha=alpha, transB=1 - tb))
    if g.needs[1]:
        db = (g.op("Gemm", dy, a, alpha=alpha, transA=1, transB=ta) if tb
              else g.op("Gemm", a, dy, alpha=alpha, transA=1 - ta))
    if len(g.x) > 2 and g.x[2] is not None and g.needs[2]:
        scaled = g.op("Mul", dy, g.scalar(beta)) if beta != 1.0 else dy
        dc = g.reduce_to(scaled, g.shape(g.y[0]), g.shape(g.x[2]))
    return [da, db, dc]


def _conv_attrs(g: GradContext, spatial: int) -> tuple[list[int], list[int], list[int], int]:
    if g.attr("auto_pad", "NOTSET") not in ("NOTSET", b"NOTSET", "VALID", b"VALID"):
        from partitioner.training.autodiff import MissingGradientError

        raise MissingGradientError(f"node {g.node.name!r} ({g.node.op_type}): auto_pad SAME_* has no gradient "
                                   "rule; give explicit pads")
    strides = g.attr("strides") or [1] * spatial
    dilations = g.attr("dilations") or [1] * spatial
    pads = g.attr("pads") or [0] * (2 * spatial)
    return list(strides), list(dilations), list(pads), int(g.attr("group", 1))


def weight_grad(g: GradContext, x, sx, dy, sdy, kernel, strides, dilations, pads, group):
    """dW[m, c, k] = sum_{n, i} x[n, g*Cg + c, i*s + k*d - p] * dy[n, m, i] as one Conv.

    x [N, G*Cg, *S] -> [Cg, G*N, *S] (a grouped conv over batches), dy [N, M, *S'] -> [M, N, *S']
    as the kernel; strides and dilations swap roles. The window can exceed the kernel when the
    padding is uneven, so the result is sliced to ``kernel`` before [Cg, M, k] -> [M, Cg, k].
    """
    n, c, *spatial = sx
    cg = c // group
    xr = g.op("Reshape", x, g.ints([n, group, cg, *spatial]))
    xr = g.op("Transpose", xr, perm=[2, 1, 0, *range(3, 3 + len(spatial))])
    xr = g.op("Reshape", xr, g.ints([cg, group * n, *spatial]))
    k = g.op("Transpose", dy, perm=[1, 0, *range(2, 2 + len(spatial))])
    out = g.op("Conv", xr, k, strides=dilations, dilations=strides, pads=pads, group=group)
    nsp = len(spatial)
    out_sp = [(spatial[i] + pads[i] + pads[i + nsp] - (sdy[2 + i] - 1) * strides[i] - 1) // dilations[i] + 1
              for i in range(nsp)]
    if out_sp != list(kernel):
        out = g.op("Slice", out, g.ints([0] * nsp), g.ints(kernel), g.ints(range(2, 2 + nsp)))
    return g.op("Transpose", out, perm=[1, 0, *range(2, 2 + nsp)])


def weight_grad_gemm(g: GradContext, x, sx, dy, sdy, kernel, strides, dilations, pads):
    """The GEMM weight gradient (module docstring) of a 2-D, one-group Conv: x [N, C, H, W]
    padded, sliced at each kernel offset (with the strides, from the offset x dilation) into
    [N, C, K, Ho, Wo], laid out as cols [N*Ho*Wo, C*K]; dY [N, O, Ho, Wo] as [O, N*Ho*Wo]."""
    n, c = sx[0], sx[1]
    o, ho, wo = sdy[1], sdy[2], sdy[3]
    large = n * ho * wo >= IM2COL_MIN_ROWS_PER_CHANNEL * o  # the columns at least as large as dW
    first = IM2COL_CHANNELS_FIRST and large  # module docstring; an explicit opt-in, so it wins
    if IM2COL_NHWC and large and not first:
        return _weight_grad_gemm_nhwc(g, x, sx, dy, sdy, kernel, strides, dilations, pads)
    if any(pads):
        x = g.op("Pad", x, g.ints([0, 0, pads[0], pads[1], 0, 0, pads[2], pads[3]]))
    if first:
        x = g.op("Transpose", x, perm=[1, 0, 2, 3])  # [C, N, Hp, Wp]: whole planes moved
    parts = []
    for kh in range(kernel[0]):
        for kw in range(kernel[1]):
            start = [kh * dilations[0], kw * dilations[1]]
            end = [start[0] + (ho - 1) * strides[0] + 1, start[1] + (wo - 1) * strides[1] + 1]
            piece = g.op("Slice", x, g.ints(start), g.ints(end), g.ints([2, 3]), g.ints(strides))
            parts.append(g.op("Unsqueeze", piece, g.ints([1 if first else 2])))
    if first:  # cols^T [C, K, N, Ho, Wo] = [C*K, N*Ho*Wo]: no transpose of the columns
        cols_t = g.op("Concat", *parts, axis=1) if len(parts) > 1 else parts[0]
        cols_t = g.op("Reshape", cols_t, g.ints([c * len(parts), n * ho * wo]))
        d2t = g.op("Reshape", g.op("Transpose", dy, perm=[0, 2, 3, 1]), g.ints([n * ho * wo, o]))
        dw_t = g.op("MatMul", cols_t, d2t)  # [C*K, O]
        return g.op("Reshape", g.op("Transpose", dw_t, perm=[1, 0]), g.ints([o, c, *kernel]))
    cols = g.op("Concat", *parts, axis=2) if len(parts) > 1 else parts[0]  # [N, C, K, Ho, Wo]
    cols = g.op("Transpose", cols, perm=[0, 3, 4, 1, 2])
    cols = g.op("Reshape", cols, g.ints([n * ho * wo, c * len(parts)]))
    d2 = g.op("Reshape", g.op("Transpose", dy, perm=[1, 0, 2, 3]), g.ints([o, n * ho * wo]))
    return g.op("Reshape", g.op("MatMul", d2, cols), g.ints([o, c, *kernel]))


def _weight_grad_gemm_nhwc(g: GradContext, x, sx, dy, sdy, kernel, strides, dilations, pads):
    """Rule "NHWC im2col" (module docstring): x moved to [N, H, W, C] first, padded on H and W,
    each kernel offset's slice [N, Ho, Wo, C] concatenated on the channel axis (``[N, Ho, Wo,
    K*C]``, whose reshape to ``cols [N*Ho*Wo, K*C]`` is free); ``dW' = dY[O, N*Ho*Wo] @ cols`` is [O, kh, kw, C]
    and goes to OIHW by one weight-sized transpose (taken only where dW is no larger than the
    columns)."""
    n, c = sx[0], sx[1]
    o, ho, wo = sdy[1], sdy[2], sdy[3]
    x = g.op("Transpose", x, perm=[0, 2, 3, 1])  # [N, H, W, C]: what TVM's NHWC convs already hold
    if any(pads):
        x = g.op("Pad", x, g.ints([0, pads[0], pads[1], 0, 0, pads[2], pads[3], 0]))
    parts = []
    for kh in range(kernel[0]):
        for kw in range(kernel[1]):
            start = [kh * dilations[0], kw * dilations[1]]
            end = [start[0] + (ho - 1) * strides[0] + 1, start[1] + (wo - 1) * strides[1] + 1]
            parts.append(g.op("Slice", x, g.ints(start), g.ints(end), g.ints([1, 2]), g.ints(strides)))
    # a channel concat on the innermost axis (the Injective rule's one vector copy per input)
    cols = g.op("Concat", *parts, axis=3) if len(parts) > 1 else parts[0]  # [N, Ho, Wo, K*C]
    cols = g.op("Reshape", cols, g.ints([n * ho * wo, len(parts) * c]))
    d2 = g.op("Reshape", g.op("Transpose", dy, perm=[1, 0, 2, 3]), g.ints([o, n * ho * wo]))
    dw = g.op("Reshape", g.op("MatMul", d2, cols), g.ints([o, *kernel, c]))  # [O, kh, kw, C]
    return g.op("Transpose", dw, perm=[0, 3, 1, 2])


def _output_padding(in_sp, out_sp, kernel, strides, dilations, pads) -> list[int]:
    """ConvTranspose's output_padding that recovers the forward input size."""
    n = len(in_sp)
    return [in_sp[i] - ((out_sp[i] - 1) * strides[i] - pads[i] - pads[i + n] + dilations[i] * (kernel[i] - 1) + 1)
            for i in range(n)]


@register_gradient("Conv")
def conv(g: GradContext) -> list:
    x, w = g.x[0], g.x[1]
    dy = g.dy[0]
    sx, sw, sy = g.shape(x), g.shape(w), g.shape(g.y[0])
    strides, dilations, pads, group = _conv_attrs(g, len(sx) - 2)
    if g.attr("auto_pad", "NOTSET") in ("VALID", b"VALID"):
        pads = [0] * (2 * (len(sx) - 2))
    kernel = list(sw[2:])
    dx = dw = db = None
    if g.needs[0]:
        op = _output_padding(sx[2:], sy[2:], kernel, strides, dilations, pads)
        dx = g.op("ConvTranspose", dy, w, strides=strides, dilations=dilations, pads=pads, group=group,
                  output_padding=op if any(op) else None)
    if g.needs[1] and GEMM_WEIGHT_GRAD and group == 1 and len(kernel) == 2 and \
            kernel[0] * kernel[1] <= GEMM_MAX_OFFSETS:
        dw = weight_grad_gemm(g, x, sx, dy, sy, kernel, strides, dilations, pads)
    elif g.needs[1]:
        dw = weight_grad(g, x, sx, dy, sy, kernel, strides, dilations, pads, group)
    if len(g.x) > 2 and g.x[2] is not None and g.needs[2]:
        db = g.op("ReduceSum", dy, g.ints([0, *range(2, len(sy))]), keepdims=0)
    return [dx, dw, db]


@register_gradient("ConvTranspose")
def conv_transpose(g: GradContext) -> list:
    """y = ConvTranspose(x, W): dx = Conv(dy, W), dW = weight_grad(input=dy, grad=x)."""
    x, w = g.x[0], g.x[1]
    dy = g.dy[0]
    sx, sw, sy = g.shape(x), g.shape(w), g.shape(g.y[0])
    if g.attr("output_shape") is not None:
        from partitioner.training.autodiff import MissingGradientError

        raise MissingGradientError(f"node {g.node.name!r} (ConvTranspose): output_shape has no gradient rule; "
                                   "give pads and output_padding")
    strides, dilations, pads, group = _conv_attrs(g, len(sx) - 2)
    kernel = list(sw[2:])
    dx = dw = db = None
    if g.needs[0]:
        dx = g.op("Conv", dy, w, strides=strides, dilations=dilations, pads=pads, group=group)
        n = len(kernel)
        full = [(sy[2 + i] + pads[i] + pads[i + n] - dilations[i] * (kernel[i] - 1) - 1) // strides[i] + 1
                for i in range(n)]
        if full != list(sx[2:]):
            dx = g.op("Slice", dx, g.ints([0] * n), g.ints(sx[2:]), g.ints(range(2, 2 + n)))
    if g.needs[1]:
        dw = weight_grad(g, dy, sy, x, sx, kernel, strides, dilations, pads, group)
    if len(g.x) > 2 and g.x[2] is not None and g.needs[2]:
        db = g.op("ReduceSum", dy, g.ints([0, *range(2, len(sy))]), keepdims=0)
    return [dx, dw, db]
