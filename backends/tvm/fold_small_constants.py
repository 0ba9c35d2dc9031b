"""Fold small constant computations with numpy before TVM's ``FoldConstant``.

Rules:

1. A call of one of the ops in :func:`_numpy_ops` whose arguments are all known is replaced by a
   ``relax.const`` of its value, computed with numpy. Known: a ``relax.Constant`` (bound to a
   variable or inline), a value an earlier rule folded, and ``shape_to_tensor`` of a shape whose
   dimensions are all static (a variable of a static ``R.Shape`` type, e.g. ``shape_of`` of a
   statically shaped tensor). Only results of at most :data:`MAX_ELEMENTS` elements are folded;
   the value must have the call's static shape and dtype, else the call stays as it is.
2. Pure data movement of a constant (:data:`MOVEMENT`: ``permute_dims``, ``reshape``,
   ``expand_dims``, ``squeeze``) is folded at any size: ``ConvertLayout`` writes a
   ``permute_dims`` on every conv weight (OIHW -> HWIO), and ``FoldConstant`` compiled one
   transpose kernel per weight shape (SLANet: 77 convolutions, ~150 s of its build, loaded).
3. Everything else is left to TVM's ``FoldConstant``, which runs after this pass (the pipeline
   runs this pass first and again right before ``FoldConstant``).

Why: TVM 0.27's ONNX importer writes a ``Gather`` with a constant index as a chain of small
constant ops (the index's negative-value normalisation: ``shape_to_tensor``, ``take``, ``less``,
``add``, ``where``), and ``FoldConstant`` evaluates each by legalizing it and compiling it with
LLVM: about 0.1-0.2 s a call (loaded machine), so a 128-step LSTM expanded with one ``Gather``
a step spent 127 s there, and an unrolled decoder with thousands of such calls far longer.
numpy does the same arithmetic in microseconds.
"""

from __future__ import annotations

from typing import Any

import numpy as np

MAX_ELEMENTS = 4096


# pure data movement of a constant: folded at any size (the result is no larger than the constant)
MOVEMENT = frozenset({"relax.permute_dims", "relax.reshape", "relax.expand_dims", "relax.squeeze"})


def _reshape(call: Any, args: list[np.ndarray]) -> np.ndarray:
    """reshape/expand_dims/squeeze: the data in the call's static result shape."""
    return args[0].reshape([int(d) for d in call.ty.shape.values])


def _numpy_ops() -> dict[str, Any]:
    take_modes = {"wrap": "wrap", "clip": "clip", "fast": "raise"}
    return {
        "relax.add": lambda c, a: np.add(*a), "relax.subtract": lambda c, a: np.subtract(*a),
        "relax.multiply": lambda c, a: np.multiply(*a), "relax.less": lambda c, a: np.less(*a),
        "relax.less_equal": lambda c, a: np.less_equal(*a), "relax.greater": lambda c, a: np.greater(*a),
        "relax.greater_equal": lambda c, a: np.greater_equal(*a), "relax.equal": lambda c, a: np.equal(*a),
        "relax.not_equal": lambda c, a: np.not_equal(*a), "relax.where": lambda c, a: np.where(*a),
        "relax.logical_and": lambda c, a: np.logical_and(*a), "relax.logical_or": lambda c, a: np.logical_or(*a),
        "relax.logical_not": lambda c, a: np.logical_not(*a), "relax.shape_to_tensor": lambda c, a: a[0],
        "relax.permute_dims": lambda c, a: np.transpose(
            a[0], None if c.attrs.axes is None else [int(x) for x in c.attrs.axes]),
        "relax.reshape": _reshape, "relax.expand_dims": _reshape, "relax.squeeze": _reshape,
        "relax.take": lambda c, a: np.take(a[0], a[1], axis=int(c.attrs.axis) if c.attrs.axis is not None else None,
                                           mode=take_modes.get(str(c.attrs.mode), "raise")),
    }


def _static_tensor(ty: Any) -> tuple[tuple[int, ...], str] | None:
    from tvm import relax

    if not isinstance(ty, relax.TensorType) or ty.shape is None:
        return None
    try:
        return tuple(int(d) for d in ty.shape.values), str(ty.dtype)
    except (AttributeError, TypeError):
        return None


def fold_small_constants_pass() -> Any:
    """Rules 1-2 as a Relax function pass (every Relax function of the module)."""
    import tvm
    from tvm import relax
    from tvm.relax.expr_functor import PyExprMutator, mutator

    ops = _numpy_ops()

    @mutator
    class _Fold(PyExprMutator):
        def _known(self, arg: Any) -> np.ndarray | None:
            if isinstance(arg, relax.Var):
                ty = arg.ty
                if isinstance(ty, relax.ShapeType):  # e.g. shape_of(x) of a statically shaped x
                    try:
                        return None if ty.values is None else np.array([int(v) for v in ty.values], dtype=np.int64)
                    except TypeError:
                        return None
                arg = self.lookup_binding(arg)
            if isinstance(arg, tvm.ir.GenericConst):
                return arg.value.numpy()
            if isinstance(arg, relax.ShapeExpr):
                try:
                    return np.array([int(v) for v in arg.values], dtype=np.int64)
                except TypeError:
                    return None
            return None

        def visit_call_(self, call: Any) -> Any:  # noqa: N802 - TVM's method name
            call = super().visit_call_(call)
            name = getattr(call.op, "name", None)
            fn = ops.get(name) if isinstance(name, str) else None
            want = _static_tensor(call.ty) if fn is not None else None
            if want is None or (name not in MOVEMENT and int(np.prod(want[0], dtype=np.int64)) > MAX_ELEMENTS):
                return call
            args = [self._known(a) for a in call.args[:1]] if name in MOVEMENT else [self._known(a) for a in call.args]
            if any(a is None for a in args):
                return call
            try:
                value = np.asarray(fn(call, args))
            except (ValueError, IndexError, TypeError):
                return call
            if value.shape != want[0] or str(value.dtype) != want[1]:
                return call
            return relax.const(value, want[1])

    @tvm.transform.module_pass(opt_level=0, name="FoldSmallConstants")
    def fold(mod: Any, _ctx: Any) -> Any:
        folder = _Fold(mod)
        for gv, func in list(mod.functions.items()):
            if isinstance(func, relax.Function):
                folder.builder_.update_func(gv, folder.visit_expr(func))
        return folder.builder_.get()

    return fold


__all__ = ["MAX_ELEMENTS", "fold_small_constants_pass"]
