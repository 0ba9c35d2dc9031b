"""Gradients of data movement and reductions: Reshape, Flatten, Squeeze, Unsqueeze, Transpose,
Concat, Split, Slice, Gather, ReduceMean, ReduceSum.

Shapes are static, so every target shape and index set is a constant folded at build time.
"""

from __future__ import annotations

import numpy as np

from partitioner.training.autodiff import GradContext, MissingGradientError, register_gradient


@register_gradient("Reshape", "Flatten", "Squeeze", "Unsqueeze")
def reshape(g: GradContext) -> list:
    return [g.op("Reshape", g.dy[0], g.ints(g.shape(g.x[0])))] + [None] * (len(g.x) - 1)


@register_gradient("Transpose")
def transpose(g: GradContext) -> list:
    rank = len(g.shape(g.x[0]))
    perm = g.attr("perm") or list(reversed(range(rank)))
    return [g.op("Transpose", g.dy[0], perm=[int(i) for i in np.argsort(perm)])]


@register_gradient("Concat")
def concat(g: GradContext) -> list:
    axis = int(g.attr("axis"))
    sizes = [g.shape(v)[axis] for v in g.x]
    parts = g.op("Split", g.dy[0], g.ints(sizes), axis=axis, _outputs=len(sizes))
    parts = parts if isinstance(parts, tuple) else (parts,)
    return [p if need else None for p, need in zip(parts, g.needs)]


@register_gradient("Split")
def split(g: GradContext) -> list:
    axis = int(g.attr("axis", 0))
    dys = [g.dy_or_zeros(i) for i in range(len(g.y))]
    return [g.op("Concat", *dys, axis=axis)] + [None] * (len(g.x) - 1)


@register_gradient("Slice")
def slice_(g: GradContext) -> list:
    """Pad dy back when every step is 1; otherwise scatter it to its flat positions."""
    x, dy = g.x[0], g.dy[0]
    sx = g.shape(x)
    consts = [g.const_input(i) for i in range(1, 5)]
    if consts[0] is None or consts[1] is None or any(c is None for c, v in zip(consts[2:], g.x[3:5]) if v is not None):
        raise MissingGradientError(f"node {g.node.name!r} (Slice): starts/ends/axes/steps must be constants")
    starts, ends = consts[0].tolist(), consts[1].tolist()
    axes = consts[2].tolist() if consts[2] is not None else list(range(len(starts)))
    steps = consts[3].tolist() if consts[3] is not None else [1] * len(starts)
    index = [slice(None)] * len(sx)
    for s, e, a, st in zip(starts, ends, axes, steps):
        index[int(a) % len(sx)] = slice(*slice(int(s), int(e), int(st)).indices(sx[int(a) % len(sx)]))
    if all(int(st) == 1 for st in steps):
        lo = [index[i].start or 0 for i in range(len(sx))]
        hi = [sx[i] - (index[i].stop if index[i].stop is not None else sx[i]) for i in range(len(sx))]
        return [g.op("Pad", dy, g.ints(lo + hi)), None, None, None, None][: len(g.x)]
    flat = np.arange(int(np.prod(sx)), dtype=np.int64).reshape(sx)[tuple(index)].reshape(-1)
    zeros = g.const(np.zeros(int(np.prod(sx))), name="zeros")
    dx = g.op("ScatterElements", zeros, g.const(flat, name="slice_index"), g.op("Reshape", dy, g.ints([-1])), axis=0)
    return [g.op("Reshape", dx, g.ints(sx)), None, None, None, None][: len(g.x)]


@register_gradient("Gather")
def gather(g: GradContext) -> list:
    """Rows of dy are added into a zero table at their indices (axis 0: an embedding lookup). On
    another axis ``a`` (a ViT's class token: ``Gather(x, 0, axis=1)``) the same on the table with
    ``a`` moved first: dy's index dimensions moved to the front, the scatter-add, the result moved
    back (two transposes; none on axis 0)."""
    data, indices = g.x
    sd = g.shape(data)
    r, q = len(sd), len(g.shape(indices))
    a = int(g.attr("axis", 0)) % r
    idx = g.op("Unsqueeze", indices, g.ints([-1]))
    if a == 0:
        return [g.op("ScatterND", g.const(np.zeros(sd), name="zeros"), idx, g.dy[0], reduction="add"), None]
    first = [sd[a], *sd[:a], *sd[a + 1:]]  # the table with axis a first
    dy = g.op("Transpose", g.dy[0], perm=[*range(a, a + q), *range(a), *range(a + q, r + q - 1)])
    dx = g.op("ScatterND", g.const(np.zeros(first), name="zeros"), idx, dy, reduction="add")
    return [g.op("Transpose", dx, perm=[*range(1, a + 1), 0, *range(a + 1, r)]), None]


def _reduce_axes(g: GradContext, rank: int) -> list[int]:
    axes = g.const_input(1) if len(g.x) > 1 else None
    if axes is None:
        axes = g.attr("axes")
    if axes is None or len(axes) == 0:
        return [] if int(g.attr("noop_with_empty_axes", 0)) else list(range(rank))
    return sorted(int(a) % rank for a in np.asarray(axes).reshape(-1))


def _reduce_grad(g: GradContext, scale: float | None) -> list:
    sx = g.shape(g.x[0])
    axes = _reduce_axes(g, len(sx))
    kept = [1 if i in axes else d for i, d in enumerate(sx)]
    dy = g.op("Reshape", g.dy[0], g.ints(kept))
    if scale is not None:
        dy = g.op("Mul", dy, g.scalar(scale))
    return [g.op("Expand", dy, g.ints(sx))] + [None] * (len(g.x) - 1)


@register_gradient("ReduceSum")
def reduce_sum(g: GradContext) -> list:
    return _reduce_grad(g, None)


@register_gradient("ReduceMean")
def reduce_mean(g: GradContext) -> list:
    sx = g.shape(g.x[0])
    count = int(np.prod([sx[a] for a in _reduce_axes(g, len(sx))]))
    return _reduce_grad(g, 1.0 / max(count, 1))


def _resize_consts(g: GradContext) -> list[np.ndarray | None]:
    """roi, scales, sizes as constants (None where absent); anything computed has no rule."""
    consts = [g.const_input(i) if i < len(g.x) and g.x[i] is not None else None for i in range(1, 4)]
    if any(v is not None and c is None for v, c in zip(g.x[1:4], consts)):
        raise MissingGradientError(f"node {g.node.name!r} (Resize): roi/scales/sizes must be constants")
    return [None if c is None or c.size == 0 else np.asarray(c) for c in consts]


def _run_resize(attrs: dict, x: np.ndarray, roi=None, scales=None, sizes=None) -> np.ndarray:
    """One float64 Resize on ONNX's reference evaluator (the spec's own arithmetic)."""
    import onnx
    from onnx import helper, numpy_helper
    from onnx.reference import ReferenceEvaluator

    consts = {"roi": roi, "scales": scales, "sizes": sizes}
    inits = [numpy_helper.from_array(np.asarray(c, np.int64 if k == "sizes" else np.float32), k)
             for k, c in consts.items() if c is not None]
    node = helper.make_node("Resize", ["x"] + [k if c is not None else "" for k, c in consts.items()], ["y"], **attrs)
    model = helper.make_model(helper.make_graph([node], "resize_probe", [helper.make_tensor_value_info(
        "x", onnx.TensorProto.DOUBLE, list(x.shape))], [helper.make_tensor_value_info("y", onnx.TensorProto.DOUBLE, None)],
        initializer=inits), opset_imports=[helper.make_opsetid("", 18)])
    return ReferenceEvaluator(model).run(None, {"x": x})[0]


def _full_rank(values: np.ndarray | None, axes: list[int], rank: int, fill: list) -> np.ndarray | None:
    """``values`` given for ``axes`` (Resize's opset-18 ``axes``) spread to every axis."""
    if values is None:
        return None
    values = np.asarray(values).reshape(-1)
    groups = len(values) // len(axes)  # roi holds starts then ends
    full = np.array([f for f in fill for _ in range(rank)], dtype=values.dtype)
    for k in range(groups):
        for j, a in enumerate(axes):
            full[k * rank + a] = values[k * len(axes) + j]
    return full


def _resize_matrices(g: GradContext) -> dict[int, np.ndarray]:
    """Linear and cubic Resize are separable: y = x times one (out x in) matrix A_d on each resized
    axis d. A_d is read off ONNX's reference Resize run on a probe that holds an identity matrix on
    (e, d), e another axis kept at scale 1 (so column j of A_d is the response to input j), every
    other axis of size 1. Other axes' size and roi are the identity there, so the probe has the
    node's own coordinate mode, cubic coefficients, antialias and exclude_outside."""
    attrs = {k: a.value for k, a in g.node.attributes.items()}
    sx, sy = g.shape(g.x[0]), g.shape(g.y[0])
    rank = len(sx)
    axes = [int(a) % rank for a in attrs.pop("axes", range(rank))]
    roi, scales, sizes = _resize_consts(g)
    policy = attrs.get("keep_aspect_ratio_policy", "stretch")
    if sizes is not None and (policy.decode() if isinstance(policy, bytes) else policy) != "stretch":
        raise MissingGradientError(f"node {g.node.name!r} (Resize): keep_aspect_ratio_policy {policy} has no rule")
    if rank < 2:
        raise MissingGradientError(f"node {g.node.name!r} (Resize): a rank-1 resize has no gradient rule")
    attrs["extrapolation_value"] = 0.0  # tf_crop_and_resize: outside the crop y is constant, dy drops
    roi = _full_rank(roi, axes, rank, [0.0, 1.0])
    scales = _full_rank(scales, axes, rank, [1.0])
    sizes = _full_rank(sizes, axes, rank, [1]) if sizes is not None else None
    crop = attrs.get("coordinate_transformation_mode") in ("tf_crop_and_resize", b"tf_crop_and_resize")
    mats = {}
    for d in range(rank):
        if sx[d] == sy[d] and not crop and (scales is None or scales[d] == 1.0):
            continue  # the identity on this axis
        e = 0 if d else 1
        probe = [1] * rank
        probe[d], probe[e] = sx[d], sx[d]
        x = np.eye(sx[d]).reshape([sx[d] if i in (d, e) else 1 for i in range(rank)])
        p_roi = None if roi is None else roi.copy()
        if p_roi is not None:
            p_roi[e], p_roi[rank + e] = 0.0, 1.0
        p_scales = None if scales is None else np.where(np.arange(rank) == d, scales, 1.0)
        p_sizes = None if sizes is None else np.where(np.arange(rank) == d, sizes, probe)
        y = _run_resize(attrs, x, p_roi, p_scales, p_sizes)
        if y.shape[d] != sy[d] or y.shape[e] != sx[d]:
            raise MissingGradientError(f"node {g.node.name!r} (Resize): probe of axis {d} gave shape {y.shape}")
        mats[d] = np.moveaxis(y, (d, e), (0, 1)).reshape(sy[d], sx[d])  # A_d[i, j]: output i, input j
    return mats


def _apply_transposed(g: GradContext, dy, d: int, rank: int, a: np.ndarray):
    """dy contracted with A on axis d: out[..., j, ...] = sum_i A[i, j] dy[..., i, ...] (one MatMul)."""
    if d == rank - 1:
        return g.op("MatMul", dy, g.const(a, name="resize_weights"))
    if d == rank - 2:
        return g.op("MatMul", g.const(a.T.copy(), name="resize_weights"), dy)
    perm = [i for i in range(rank) if i != d] + [d]
    t = g.op("MatMul", g.op("Transpose", dy, perm=perm), g.const(a, name="resize_weights"))
    return g.op("Transpose", t, perm=[int(i) for i in np.argsort(perm)])


@register_gradient("Resize")
def resize(g: GradContext) -> list:
    """Nearest-neighbour Resize (constant scales or sizes): each output copied one input element,
    so dx adds dy into those elements. Which element is found at build time by running the
    forward Resize on the element indices (onnx.reference, float64: exact for any index below
    2**53), then a ScatterElements(add) routes dy. Linear and cubic Resize (a U-Net's bilinear
    upsampling) are linear maps separable by axis: dx is dy times each axis's transposed
    interpolation matrix (``_resize_matrices``), one MatMul per resized axis; for the x2 and x0.5
    spatial resizes of decoders these matrices are a few KiB."""
    mode = g.attr("mode", "nearest")
    mode = mode.decode() if isinstance(mode, bytes) else mode
    sx = g.shape(g.x[0])
    if mode in ("linear", "cubic"):
        dx = g.dy[0]
        for d, a in _resize_matrices(g).items():
            dx = _apply_transposed(g, dx, d, len(sx), a)
        return [dx, None, None, None][: len(g.x)]
    if mode != "nearest":
        raise MissingGradientError(f"node {g.node.name!r} (Resize): mode {mode} has no gradient rule")
    roi, scales, sizes = _resize_consts(g)
    attrs = {k: a.value for k, a in g.node.attributes.items()}
    index = np.arange(int(np.prod(sx)), dtype=np.float64).reshape(sx)
    taken = _run_resize(attrs, index, roi, scales, sizes).astype(np.int64).reshape(-1)
    zeros = g.const(np.zeros(int(np.prod(sx))), name="zeros")
    dx = g.op("ScatterElements", zeros, g.const(taken, name="resize_index"), g.op("Reshape", g.dy[0], g.ints([-1])),
              axis=0, reduction="add")
    return [g.op("Reshape", dx, g.ints(sx)), None, None, None][: len(g.x)]
