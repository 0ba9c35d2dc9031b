"""Relax rewrite: an inference batch norm after a convolution costs one add, not four ops and a
division per element.

``DecomposeOpsForInference`` turns ``BatchNormalization`` into
``(x - mean) / sqrt(var + eps) * gamma + beta``; after ``FoldConstant`` the four right-hand
operands are constants, but each output element still pays a subtract, a *division*, a multiply
and an add in the conv's epilogue. For a depthwise conv (9 FMAs per element, memory-bound) the
division alone (AVX-512 ``vdivps``: ~5 cycles per vector on Zen 4, 16 on Skylake) costs about
as much as the convolution. ORT folds BN into the conv weights; so do we, on the Relax module:

1. ``add(multiply(divide(subtract(x, c1), c2), c3), c4)`` with constants ``c1..c4`` ->
   ``add(multiply(x, k), b)`` with ``k = c3 / c2``, ``b = c4 - c1 * c3 / c2`` (numpy, float32).
2. When ``x`` is ``conv2d(data, W)`` (or ``conv2d(data, W) + bias``, bias constant) with a constant ``W`` in ``HWIO`` (``OIHW``) layout and ``k``
   varies only along the output channels (the output's channel axis) -> ``add(conv2d(data, W * k), b)``:
   the scale goes into the weights (``W[..., o] * k[o]``) and the bias becomes ``bias * k + b``,
   as in ONNX Runtime's Conv+BN fusion.

Rounding: ``W * k`` and ``b`` are rounded once to float32 instead of per element at run time;
results differ from the unfolded form by a few ulps (well inside rtol 1e-4). Runs after
``FoldConstant`` (the operands must be constants) and before ``LegalizeOps``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

_OUT_CHANNEL_AXIS = {("NHWC", "HWIO"): (3, 3), ("NCHW", "OIHW"): (1, 0)}  # (output axis, weight axis)


def _affine_pattern() -> tuple[Any, Any, list[Any]]:
    from tvm.relax.dpl import is_const, is_op, wildcard

    x = wildcard()
    c = [is_const() for _ in range(4)]
    pat = is_op("relax.add")(is_op("relax.multiply")(is_op("relax.divide")(is_op("relax.subtract")(x, c[0]), c[1]), c[2]), c[3])
    return pat, x, c


def _conv_with_scale(conv: Any, k: np.ndarray) -> Any | None:
    """conv2d(data, W * k) when ``conv`` is a conv2d with a constant weight and ``k`` a
    per-output-channel scale in the conv's layout; None otherwise (rule 2 does not apply)."""
    import tvm
    from tvm import relax

    if not isinstance(conv, relax.Call) or not conv.op.same_as(tvm.ir.Op.get("relax.nn.conv2d")) or \
            not isinstance(conv.args[1], type(relax.const(0.0))):
        return None
    a = conv.attrs
    axes = _OUT_CHANNEL_AXIS.get((str(a.out_layout or a.data_layout), str(a.kernel_layout)))
    if axes is None or (a.out_dtype is not None and str(a.out_dtype) not in ("", "float32", "void")):
        return None
    w = conv.args[1].value.numpy()
    out_axis, w_axis = axes
    rank = 4
    kk = np.broadcast_to(k, np.broadcast_shapes(k.shape, (1,) * rank)) if k.ndim <= rank else None
    if kk is None or kk.ndim != rank or any(d != 1 for i, d in enumerate(kk.shape) if i != out_axis):
        return None
    scale = kk.reshape(-1) if kk.shape[out_axis] == w.shape[w_axis] else None
    if scale is None:
        return None
    shape = [1] * rank
    shape[w_axis] = scale.size
    w2 = (w * scale.reshape(shape)).astype(w.dtype)
    return relax.Call(conv.op, [conv.args[0], relax.const(w2)], conv.attrs, conv.ty_args)


def fold_batchnorm(func: Any) -> Any:
    """Rules 1-2 on one Relax function."""
    from tvm import relax
    from tvm.relax.dpl import rewrite_call

    pat, x, c = _affine_pattern()

    def rewrite(expr: Any, m: Any) -> Any:
        c1, c2, c3, c4 = (m[ci].value.numpy() for ci in c)
        if any(v.dtype != np.float32 for v in (c1, c2, c3, c4)):
            return expr
        k = (c3 / c2).astype(np.float32)
        b = (c4 - c1 * k).astype(np.float32)
        conv = m[x]
        value = _bound_value(func, conv)
        bias = _conv_bias(func, value)
        if bias is not None:  # x = conv2d(..) + bias: (conv + bias) * k + b = conv(W k) + (bias k + b)
            value, b = bias[0], (bias[1] * k + b).astype(np.float32)
        folded = _conv_with_scale(value, k)
        if folded is not None:
            return relax.op.add(folded, relax.const(b))
        return relax.op.add(relax.op.multiply(conv, relax.const(k)), relax.const(m[c[3]].value.numpy() - c1 * k))

    return rewrite_call(pat, rewrite, func)


def _conv_bias(func: Any, value: Any) -> tuple[Any, np.ndarray] | None:
    """(the conv2d call, its bias) when ``value`` is ``add(conv2d(..), constant)``."""
    import tvm
    from tvm import relax

    if not isinstance(value, relax.Call) or not value.op.same_as(tvm.ir.Op.get("relax.add")):
        return None
    lhs, rhs = value.args
    if not isinstance(rhs, type(relax.const(0.0))):
        return None
    conv = _bound_value(func, lhs)
    if not isinstance(conv, relax.Call) or not conv.op.same_as(tvm.ir.Op.get("relax.nn.conv2d")):
        return None
    return conv, rhs.value.numpy()


def _bound_value(func: Any, expr: Any) -> Any:
    """The expression a dataflow variable is bound to in ``func`` (``expr`` itself otherwise)."""
    from tvm import relax

    if not isinstance(expr, relax.Var):
        return expr
    for block in func.body.blocks:
        for binding in block.bindings:
            if binding.var.same_as(expr) and isinstance(binding, relax.VarBinding):
                return binding.value
    return expr


def fold_batchnorm_pass() -> Any:
    """:func:`fold_batchnorm` over every Relax function of a module."""
    from .clip_as_max_min import function_pass

    return function_pass("FoldBatchNormAffine", fold_batchnorm)
