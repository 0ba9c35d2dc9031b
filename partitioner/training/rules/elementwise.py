"""Gradients of broadcasting arithmetic and unary math: Add, Sub, Mul, Div, Neg, Pow, Sqrt, Exp,
Log, Reciprocal, Where, Identity, Cast, Dropout, Expand, Sum.

Binary ops broadcast numpy-style, so each input's gradient is summed back to its own shape
(``GradContext.reduce_to``).
"""

from __future__ import annotations

import math

from partitioner.training.autodiff import GradContext, register_gradient


def _both(g: GradContext, da, db) -> list:
    a, b = g.x[0], g.x[1]
    out = g.shape(g.y[0])
    return [g.reduce_to(da(), out, g.shape(a)) if g.needs[0] else None,
            g.reduce_to(db(), out, g.shape(b)) if g.needs[1] else None]


@register_gradient("Add")
def add(g: GradContext) -> list:
    dy = g.dy[0]
    return _both(g, lambda: dy, lambda: dy)


@register_gradient("Sub")
def sub(g: GradContext) -> list:
    dy = g.dy[0]
    return _both(g, lambda: dy, lambda: g.op("Neg", dy))


@register_gradient("Mul")
def mul(g: GradContext) -> list:
    a, b = g.x[0], g.x[1]
    dy = g.dy[0]
    return _both(g, lambda: g.op("Mul", dy, b), lambda: g.op("Mul", dy, a))


@register_gradient("Div")
def div(g: GradContext) -> list:
    """y = a / b: da = dy / b, db = -dy * y / b."""
    b, y, dy = g.x[1], g.y[0], g.dy[0]
    return _both(g, lambda: g.op("Div", dy, b), lambda: g.op("Neg", g.op("Div", g.op("Mul", dy, y), b)))


@register_gradient("Pow")
def pow_(g: GradContext) -> list:
    """y = a^b: da = dy * b * a^(b-1), db = dy * y * log(a)."""
    a, b, y, dy = g.x[0], g.x[1], g.y[0], g.dy[0]

    def da():
        bm1 = g.op("Sub", b, g.op("CastLike", g.scalar(1.0), b))
        return g.op("Mul", dy, g.op("CastLike", g.op("Mul", b, g.op("Pow", a, bm1)), dy))

    return _both(g, da, lambda: g.op("Mul", dy, g.op("Mul", y, g.op("Log", a))))


@register_gradient("Neg")
def neg(g: GradContext) -> list:
    return [g.op("Neg", g.dy[0])]


@register_gradient("Identity", "Dropout")
def identity(g: GradContext) -> list:
    """Dropout is built in inference mode (ratio unused): the step stays deterministic, so ORT,
    TVM and every rank agree bit for bit; its gradient is the identity. Tensor parallelism's f
    (an Identity named ``tp.f.*``) AllReduces it instead (:mod:`.comm`)."""
    if g.node.op_type == "Identity" and (g.node.name or "").startswith("tp.f."):
        from partitioner.training.rules.comm import f_backward

        return [f_backward(g)]
    return [g.dy[0]] + [None] * (len(g.x) - 1)


@register_gradient("Cast")
def cast(g: GradContext) -> list:
    return [g.op("CastLike", g.dy[0], g.x[0])]


@register_gradient("Expand")
def expand(g: GradContext) -> list:
    return [g.reduce_to(g.dy[0], g.shape(g.y[0]), g.shape(g.x[0])), None]


@register_gradient("Sum")
def sum_(g: GradContext) -> list:
    out = g.shape(g.y[0])
    return [g.reduce_to(g.dy[0], out, g.shape(v)) if need else None for v, need in zip(g.x, g.needs)]


@register_gradient("Sqrt")
def sqrt(g: GradContext) -> list:
    return [g.op("Div", g.op("Mul", g.dy[0], g.scalar(0.5)), g.y[0])]


@register_gradient("Exp")
def exp(g: GradContext) -> list:
    return [g.op("Mul", g.dy[0], g.y[0])]


@register_gradient("Log")
def log(g: GradContext) -> list:
    return [g.op("Div", g.dy[0], g.x[0])]


@register_gradient("Reciprocal")
def reciprocal(g: GradContext) -> list:
    return [g.op("Neg", g.op("Mul", g.dy[0], g.op("Mul", g.y[0], g.y[0])))]


@register_gradient("Erf")
def erf(g: GradContext) -> list:
    """d erf(x) = 2/sqrt(pi) * exp(-x^2)."""
    x = g.x[0]
    e = g.op("Exp", g.op("Neg", g.op("Mul", x, x)))
    return [g.op("Mul", g.dy[0], g.op("Mul", e, g.scalar(2.0 / math.sqrt(math.pi))))]


@register_gradient("Where")
def where(g: GradContext) -> list:
    c, a, b = g.x
    dy = g.dy[0]
    zero = g.op("CastLike", g.scalar(0.0), dy)
    out = g.shape(g.y[0])
    return [None,
            g.reduce_to(g.op("Where", c, dy, zero), out, g.shape(a)) if g.needs[1] else None,
            g.reduce_to(g.op("Where", c, zero, dy), out, g.shape(b)) if g.needs[2] else None]
