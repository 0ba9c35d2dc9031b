"""Gradients of LayerNormalization, LRN and of BatchNormalization in inference form.

BatchNormalization in *training* mode (batch statistics, running stats updated) is not a rule:
:mod:`partitioner.training.batchnorm` rewrites it into ReduceMean/Sub/Mul/Sqrt/Div before the
backward pass, and those ops' rules differentiate it. A BatchNormalization left in inference
form (frozen statistics) is an affine map per channel, differentiated here.
"""

from __future__ import annotations

import numpy as np

from partitioner.training.autodiff import GradContext, register_gradient


@register_gradient("LayerNormalization")
def layer_norm(g: GradContext) -> list:
    """xhat = (x - mean) * rstd over axes [axis, rank); y = xhat * scale + bias.

    dscale = sum(dy * xhat), dbias = sum(dy) over the leading axes;
    dx = rstd * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat)), dxhat = dy * scale.
    """
    x, scale = g.x[0], g.x[1]
    dy = g.dy[0]
    sx = g.shape(x)
    rank = len(sx)
    axis = int(g.attr("axis", -1)) % rank
    eps = float(g.attr("epsilon", 1e-5))
    norm_axes = g.ints(range(axis, rank))
    mean = g.op("ReduceMean", x, norm_axes, keepdims=1)
    xc = g.op("Sub", x, mean)
    var = g.op("ReduceMean", g.op("Mul", xc, xc), norm_axes, keepdims=1)
    rstd = g.op("Reciprocal", g.op("Sqrt", g.op("Add", var, g.scalar(eps))))
    xhat = g.op("Mul", xc, rstd)
    dx = dscale = dbias = None
    if g.needs[0]:
        dxhat = g.op("Mul", dy, scale)
        m1 = g.op("ReduceMean", dxhat, norm_axes, keepdims=1)
        m2 = g.op("ReduceMean", g.op("Mul", dxhat, xhat), norm_axes, keepdims=1)
        dx = g.op("Mul", rstd, g.op("Sub", g.op("Sub", dxhat, m1), g.op("Mul", xhat, m2)))
    if g.needs[1]:
        dscale = g.reduce_to(g.op("Mul", dy, xhat), sx, g.shape(scale))
    if len(g.x) > 2 and g.x[2] is not None and g.needs[2]:
        dbias = g.reduce_to(dy, sx, g.shape(g.x[2]))
    return [dx, dscale, dbias]


@register_gradient("BatchNormalization")
def batch_norm_inference(g: GradContext) -> list:
    """Inference form: y = (x - mean) * scale / sqrt(var + eps) + b, per channel (axis 1)."""
    x, scale, _bias, mean, var = g.x[:5]
    dy = g.dy[0]
    if int(g.attr("training_mode", 0)):
        from partitioner.training.autodiff import MissingGradientError

        raise MissingGradientError(f"node {g.node.name!r}: BatchNormalization training_mode=1 is rewritten by the "
                                   "training builder; differentiate the rewritten graph")
    sx = g.shape(x)
    bshape = g.ints([1, sx[1]] + [1] * (len(sx) - 2))
    axes = g.ints([0, *range(2, len(sx))])
    inv = g.op("Reciprocal", g.op("Sqrt", g.op("Add", var, g.scalar(float(g.attr("epsilon", 1e-5))))))
    dx = g.op("Mul", dy, g.op("Reshape", g.op("Mul", scale, inv), bshape)) if g.needs[0] else None
    dscale = dbias = None
    if g.needs[1]:
        xhat = g.op("Mul", g.op("Sub", x, g.op("Reshape", mean, bshape)), g.op("Reshape", inv, bshape))
        dscale = g.op("ReduceSum", g.op("Mul", dy, xhat), axes, keepdims=0)
    if g.needs[2]:
        dbias = g.op("ReduceSum", dy, axes, keepdims=0)
    return [dx, dscale, dbias, None, None]


def _channel_window_sum(g: GradContext, v, shape, before: int, after: int):
    """``out[n, c, ...] = sum(v[n, c - before .. c + after, ...])`` (zero outside): one Conv of a
    ones kernel over the channel axis of ``v`` viewed as ``[N, 1, C, rest]``."""
    n, c = shape[:2]
    rest = int(np.prod(shape[2:])) if len(shape) > 2 else 1
    flat = g.op("Reshape", v, g.ints([n, 1, c, rest]))
    size = before + after + 1
    out = g.op("Conv", flat, g.const(np.ones([1, 1, size, 1]), name="ones_window"), kernel_shape=[size, 1],
               pads=[before, 0, after, 0])
    return g.op("Reshape", out, g.ints(list(shape)))


@register_gradient("LRN")
def lrn(g: GradContext) -> list:
    """Local response normalisation (AlexNet, GoogLeNet, ZFNet): ``y = x * s^-beta``, ``s = bias +
    alpha / size * S``, ``S[c]`` the sum of ``x^2`` over channels ``c - lo .. c + hi`` (``lo =
    floor((size-1)/2)``, ``hi = ceil((size-1)/2)``, ONNX's window). Each ``x[c']`` enters ``S[c]`` of
    every ``c`` whose window holds it, the window mirrored (``hi`` before, ``lo`` after), so
    ``dx = dy * s^-beta - (2 alpha beta / size) * x * mirrored_sum(dy * x * s^(-beta-1))``; ``s``
    is recomputed from ``x``."""
    x, dy = g.x[0], g.dy[0]
    sx = g.shape(x)
    size = int(g.attr("size"))
    alpha, beta, bias = float(g.attr("alpha", 1e-4)), float(g.attr("beta", 0.75)), float(g.attr("bias", 1.0))
    lo, hi = (size - 1) // 2, size // 2
    square_sum = _channel_window_sum(g, g.op("Mul", x, x), sx, lo, hi)
    s = g.op("Add", g.op("Mul", square_sum, g.scalar(alpha / size)), g.scalar(bias))
    s_beta = g.op("Pow", s, g.scalar(-beta))  # s^-beta
    t = g.op("Div", g.op("Mul", g.op("Mul", dy, x), s_beta), s)  # dy * x * s^(-beta-1)
    back = _channel_window_sum(g, t, sx, hi, lo)
    spread = g.op("Mul", g.op("Mul", x, back), g.scalar(2.0 * alpha * beta / size))
    return [g.op("Sub", g.op("Mul", dy, s_beta), spread)]
