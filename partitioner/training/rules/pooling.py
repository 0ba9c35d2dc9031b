"""Gradients of pooling: MaxPool, AveragePool, GlobalAveragePool, GlobalMaxPool.

MaxPool's Indices output is not imported by TVM, so its gradient is built from patches: every
window is extracted with a Conv whose kernels are one-hot (input padded with a large negative
value first, so padding never wins), the first maximum of each window is picked with ArgMax
(ties, e.g. windows of ReLU zeros, route the whole gradient to one element as ORT and PyTorch
do), and the routed gradient is put back with the transposed Conv of the same one-hot kernels.
AveragePool's gradient is a depthwise ConvTranspose with a constant 1/count kernel; counts that
exclude padding are folded into a constant divisor map (shapes are static).
"""

from __future__ import annotations

import numpy as np

from partitioner.training.autodiff import GradContext, MissingGradientError, register_gradient

_NEG = -1e30


def _pool_attrs(g: GradContext, spatial: int) -> tuple[list[int], list[int], list[int], list[int]]:
    if g.attr("auto_pad", "NOTSET") not in ("NOTSET", b"NOTSET") or int(g.attr("ceil_mode", 0)):
        raise MissingGradientError(f"node {g.node.name!r} ({g.node.op_type}): auto_pad/ceil_mode have no gradient "
                                   "rule; give explicit pads")
    kernel = list(g.attr("kernel_shape"))
    strides = g.attr("strides") or [1] * spatial
    pads = g.attr("pads") or [0] * (2 * spatial)
    dilations = g.attr("dilations") or [1] * spatial
    return kernel, list(strides), list(pads), list(dilations)


def _one_hot_kernels(g: GradContext, kernel: list[int]):
    k = int(np.prod(kernel))
    return g.const(np.eye(k).reshape([k, 1, *kernel]), name="eye_kernels"), k


@register_gradient("MaxPool")
def max_pool(g: GradContext) -> list:
    if len(g.y) > 1 and g.y[1].uses():
        raise MissingGradientError(f"node {g.node.name!r} (MaxPool): the Indices output has no gradient rule")
    x, dy = g.x[0], g.dy[0]
    sx, sy = g.shape(x), g.shape(g.y[0])
    n, c, *spatial = sx
    nsp = len(spatial)
    kernel, strides, pads, dilations = _pool_attrs(g, nsp)
    eye, k = _one_hot_kernels(g, kernel)
    xr = g.op("Reshape", x, g.ints([n * c, 1, *spatial]))
    if any(pads):
        xr = g.op("Pad", xr, g.ints([0, 0, *pads[:nsp], 0, 0, *pads[nsp:]]), g.scalar(_NEG))
    patches = g.op("Conv", xr, eye, strides=strides, dilations=dilations)  # [n*c, k, *sy]
    first = g.op("ArgMax", patches, axis=1, keepdims=1, select_last_index=0)  # [n*c, 1, *sy]
    idx = g.const(np.arange(k, dtype=np.int64).reshape([1, k] + [1] * nsp), name="arange")
    onehot = g.op("CastLike", g.op("Equal", first, idx), dy)
    routed = g.op("Mul", onehot, g.op("Reshape", dy, g.ints([n * c, 1, *sy[2:]])))
    padded = [spatial[i] + pads[i] + pads[i + nsp] for i in range(nsp)]
    full = [(sy[2 + i] - 1) * strides[i] + dilations[i] * (kernel[i] - 1) + 1 for i in range(nsp)]
    outpad = [padded[i] - full[i] for i in range(nsp)]
    dx = g.op("ConvTranspose", routed, eye, strides=strides, dilations=dilations,
              output_padding=outpad if any(outpad) else None)
    if any(pads):
        dx = g.op("Slice", dx, g.ints(pads[:nsp]), g.ints([pads[i] + spatial[i] for i in range(nsp)]),
                  g.ints(range(2, 2 + nsp)))
    return [g.op("Reshape", dx, g.ints(list(sx)))]


@register_gradient("AveragePool")
def average_pool(g: GradContext) -> list:
    x, dy = g.x[0], g.dy[0]
    sx, sy = g.shape(x), g.shape(g.y[0])
    _n, c, *spatial = sx
    nsp = len(spatial)
    kernel, strides, pads, dilations = _pool_attrs(g, nsp)
    # the number of elements each output averaged: the full window, or only the unpadded part
    if int(g.attr("count_include_pad", 0)) or not any(pads):
        counts = np.full(sy[2:], float(np.prod(kernel)))
    else:
        ones = np.pad(np.ones(spatial), [(pads[i], pads[i + nsp]) for i in range(nsp)])
        counts = np.zeros(sy[2:])
        for out_idx in np.ndindex(*sy[2:]):
            window = tuple(slice(o * s, o * s + d * (k - 1) + 1, d)
                           for o, s, k, d in zip(out_idx, strides, kernel, dilations))
            counts[out_idx] = ones[window].sum()
    scaled = g.op("Div", dy, g.const(counts, name="pool_counts"))
    w = g.const(np.ones([c, 1, *kernel]), name="ones_kernel")
    padded = [spatial[i] + pads[i] + pads[i + nsp] for i in range(nsp)]
    full = [(sy[2 + i] - 1) * strides[i] + dilations[i] * (kernel[i] - 1) + 1 for i in range(nsp)]
    outpad = [padded[i] - full[i] for i in range(nsp)]
    dx = g.op("ConvTranspose", scaled, w, strides=strides, dilations=dilations, group=c,
              output_padding=outpad if any(outpad) else None)
    if any(pads):
        dx = g.op("Slice", dx, g.ints(pads[:nsp]), g.ints([pads[i] + spatial[i] for i in range(nsp)]),
                  g.ints(range(2, 2 + nsp)))
    return [dx]


@register_gradient("GlobalAveragePool")
def global_average_pool(g: GradContext) -> list:
    sx = g.shape(g.x[0])
    scaled = g.op("Mul", g.dy[0], g.scalar(1.0 / float(np.prod(sx[2:]))))
    return [g.op("Expand", scaled, g.ints(list(sx)))]


@register_gradient("GlobalMaxPool")
def global_max_pool(g: GradContext) -> list:
    """Gradient to the first maximum of each channel (flattened ArgMax, as MaxPool)."""
    x = g.x[0]
    sx = g.shape(x)
    n, c = sx[:2]
    flat = g.op("Reshape", x, g.ints([n, c, -1]))
    first = g.op("ArgMax", flat, axis=2, keepdims=1, select_last_index=0)
    idx = g.const(np.arange(int(np.prod(sx[2:])), dtype=np.int64).reshape(1, 1, -1), name="arange")
    onehot = g.op("CastLike", g.op("Equal", first, idx), g.dy[0])
    routed = g.op("Mul", onehot, g.op("Reshape", g.dy[0], g.ints([n, c, 1])))
    return [g.op("Reshape", routed, g.ints(list(sx)))]
