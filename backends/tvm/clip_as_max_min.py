"""Relax rewrite: clamps written as compare + select become ``maximum`` / ``minimum``, so that
``ConvertLayout`` carries the conv's NHWC layout through them and they fuse into its epilogue.

Why: ``lower.py`` imports ``Clip(x, lo, hi)`` with constant bounds as
``Where(Less(x, lo), lo, x)`` then ``Where(Greater(t, hi), hi, t)`` (TVM's own Clip import is an
opaque ``emit_te`` call). But ``relax.where`` has no layout-inference rule in TVM 0.27, so
``ConvertLayout`` wraps every such ReLU6 in NHWC -> NCHW -> NHWC transposes: MobileNetV2 paid
two full-tensor transposes per conv, and the clamp never fused into the conv before it (checked
on a depthwise conv + BN + ReLU6: the clamp was its own kernel with two transposes).
``maximum``/``minimum`` are binary elementwise ops with a layout rule.

Rules (``c`` a constant, ``x`` any expression, both the same value in the two places):

1. ``where(less(x, c), c, x)``    -> ``maximum(x, c)``
2. ``where(greater(x, c), c, x)`` -> ``minimum(x, c)``
3. after ``ConvertLayout``: ``maximum(x, c)`` -> ``maximum(c, x)`` (and ``minimum``), for any
   constant ``c`` (also one ConvertLayout transposed).

The variable goes first for ``ConvertLayout`` (its binary rule takes the first operand's layout;
constant first, it kept NCHW and added transposes), the constant goes first in the end: TVM lowers ``maximum(a, b)`` to a select that returns ``b``
when the compare is false, so a NaN ``x`` stays NaN (as ONNX Clip and the select form do; checked
on llvm: ``maximum(0, nan) = nan`` while ``maximum(nan, 0) = 0``). For every other input the
two forms return the same value.
"""

from __future__ import annotations

from typing import Any


def _patterns() -> list[tuple[Any, Any, Any, Any]]:
    from tvm import relax
    from tvm.relax.dpl import is_const, is_op, wildcard

    out = []
    for cmp, op in (("relax.less", relax.op.maximum), ("relax.greater", relax.op.minimum)):
        x, c = wildcard(), is_const()
        out.append((is_op("relax.where")(is_op(cmp)(x, c), c, x), x, c, op))
    return out


def _constant_like() -> Any:
    """A constant, or a constant that ConvertLayout transposed (folded later)."""
    from tvm.relax.dpl import is_const, is_op

    c = is_const()
    return c | is_op("relax.permute_dims")(c)


def rewrite_clamps(func: Any) -> Any:
    """Rules 1-2 on one Relax function, variable first (see :func:`constant_first`)."""
    from tvm.relax.dpl import rewrite_call

    for pattern, x, c, op in _patterns():
        func = rewrite_call(pattern, lambda _expr, m, x=x, c=c, op=op: op(m[x], m[c]), func)
    return func


def constant_first(func: Any) -> Any:
    """``maximum(x, c)`` / ``minimum(x, c)`` with a constant ``c`` -> ``maximum(c, x)`` /
    ``minimum(c, x)``: the NaN-preserving order (module docstring). Run after ``ConvertLayout``:
    with the constant first, ``ConvertLayout`` gave the op the constant's (NCHW) layout and
    wrapped it in transposes; with the variable first it keeps the conv's NHWC."""
    from tvm import relax
    from tvm.relax.dpl import is_op, wildcard, rewrite_call

    for name, op in (("relax.maximum", relax.op.maximum), ("relax.minimum", relax.op.minimum)):
        x, c = wildcard(), _constant_like()
        func = rewrite_call(is_op(name)(x, c), lambda _e, m, x=x, c=c, op=op: op(m[c], m[x]), func)
    return func


def function_pass(name: str, rewrite: Any) -> Any:
    """A module pass named ``name`` that replaces every Relax function ``f`` of a module with
    ``rewrite(f)`` (also used by :mod:`backends.tvm.fold_batchnorm` and :func:`backends.tvm.pipeline.legalize_passes`)."""
    import tvm
    from tvm import relax

    @tvm.transform.module_pass(opt_level=0, name=name)
    def _pass(mod: Any, _ctx: Any) -> Any:
        for gv, func in list(mod.functions_items()):
            if isinstance(func, relax.Function):
                mod[gv] = rewrite(func)
        return mod

    return _pass


def clamp_passes(layout_passes: list[Any]) -> list[Any]:
    """``layout_passes`` (ConvertLayout) between the two rewrites."""
    return [function_pass("ClampAsMaxMin", rewrite_clamps), *layout_passes,
            function_pass("ClampConstantFirst", constant_first)]
