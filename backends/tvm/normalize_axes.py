"""Relax rewrite: negative ``squeeze`` / ``expand_dims`` axes made non-negative before ConvertLayout.

Rules:

1. A ``relax.squeeze`` whose input rank is known and whose ``axis`` holds a negative entry gets
   ``axis + rank`` for it; a ``relax.expand_dims`` gets ``axis + rank_out`` (``rank_out`` = input
   rank + number of axes, as ONNX ``Unsqueeze`` counts). The call computes the same tensor.
2. Everything else is left untouched; a module without such a call comes back as it is.

Why: TVM 0.27's ``ConvertLayout`` (``InferLayoutSqueeze``) indexes its layout with the raw axis,
so ``squeeze(x, axis=[-1])`` makes it allocate from a negative size and the whole build dies with
``std::bad_alloc`` and no op named. PyTorch exporters write ``Squeeze(axes=[-1])`` (silero-vad's
decoder); the ONNX importer passes the constant axes through unchanged.
"""

from __future__ import annotations

from typing import Any


def _rank(expr: Any) -> int | None:
    from tvm import relax

    ty = getattr(expr, "ty", None)  # TVM 0.27: relax.TensorType (struct_info before)
    if isinstance(ty, relax.TensorType) and ty.ndim >= 0:
        return int(ty.ndim)
    return None


def _fixed_axes(axes: Any, rank: int) -> list[int] | None:
    """``axes`` with negative entries wrapped by ``rank``; None when none is negative."""
    values = [int(a) for a in axes]
    if all(a >= 0 for a in values):
        return None
    return [a + rank if a < 0 else a for a in values]


def normalize_axes(mod: Any) -> Any:
    """Rules 1-2 over every Relax function of ``mod``; returns the (possibly new) module."""
    from tvm import relax
    from tvm.relax.expr_functor import PyExprMutator, mutator

    squeeze, expand = relax.op.squeeze, relax.op.expand_dims
    ops = {"relax.squeeze", "relax.expand_dims"}

    @mutator
    class _Normalize(PyExprMutator):
        def __init__(self, module: Any) -> None:
            super().__init__(module)
            self.module = module

        def transform(self) -> Any:
            for gv, func in self.module.functions_items():
                if isinstance(func, relax.Function):
                    self.builder_.update_func(gv, self.visit_expr(func))
            return self.builder_.get()

        def visit_call_(self, call: Any) -> Any:  # noqa: N802 - TVM's method name
            call = super().visit_call_(call)
            op = getattr(call, "op", None)
            if not isinstance(call, relax.Call) or getattr(op, "name", None) not in ops:
                return call
            axes = call.attrs.axis
            rank = _rank(call.args[0])
            if axes is None or rank is None:
                return call
            if op.name == "relax.squeeze":
                fixed = _fixed_axes(axes, rank)
                return call if fixed is None else squeeze(call.args[0], fixed)
            fixed = _fixed_axes(axes, rank + len(axes))
            return call if fixed is None else expand(call.args[0], fixed)

    return _Normalize(mod).transform()


def normalize_axes_pass() -> Any:
    """:func:`normalize_axes` as a module pass, for a ``tvm.transform.Sequential``."""
    import tvm

    return tvm.transform.module_pass(lambda mod, _ctx: normalize_axes(mod), opt_level=0,
                                     name="NormalizeNegativeAxes")
