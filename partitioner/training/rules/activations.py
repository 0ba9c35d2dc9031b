"""Gradients of activations: Relu, LeakyRelu, Clip, Sigmoid, Tanh, Gelu, Softmax, LogSoftmax."""

from __future__ import annotations

import math
import os

from partitioner.training.autodiff import GradContext, register_gradient


def _mask(g: GradContext, cond, dy):
    return g.op("Where", cond, dy, g.op("CastLike", g.scalar(0.0), dy))


#: Relu's mask from its output, ``y > 0`` (the same set as ``x > 0``: ``y = max(x, 0)``), not its
#: input (session 18). A conv net's ReLU output is kept for the next conv's weight gradient anyway,
#: so the backward pass no longer needs the ReLU's input (a BatchNormalization output): a pipeline
#: stage stashes one activation less per BN-ReLU (and TVM's ``F`` writes and transposes one NCHW
#: output less per micro-batch). ``PARTITIONER_TRAIN_RELU_MASK_FROM_OUTPUT=0`` turns it off.
RELU_MASK_FROM_OUTPUT = os.environ.get("PARTITIONER_TRAIN_RELU_MASK_FROM_OUTPUT", "1") != "0"


@register_gradient("Relu")
def relu(g: GradContext) -> list:
    x = g.y[0] if RELU_MASK_FROM_OUTPUT else g.x[0]  # y > 0 exactly where x > 0 (RELU_MASK_FROM_OUTPUT)
    return [_mask(g, g.op("Greater", x, g.op("CastLike", g.scalar(0.0), x)), g.dy[0])]


@register_gradient("LeakyRelu")
def leaky_relu(g: GradContext) -> list:
    x, dy = g.x[0], g.dy[0]
    pos = g.op("Greater", x, g.op("CastLike", g.scalar(0.0), x))
    return [g.op("Where", pos, dy, g.op("Mul", dy, g.scalar(g.attr("alpha", 0.01))))]


@register_gradient("Clip")
def clip(g: GradContext) -> list:
    """Gradient flows where min < x < max (ReLU6 is Clip(0, 6))."""
    x = g.x[0]
    cond = None
    for i, cmp in ((1, "Greater"), (2, "Less")):
        if len(g.x) > i and g.x[i] is not None:
            c = g.op(cmp, x, g.x[i])
            cond = c if cond is None else g.op("And", cond, c)
    return [_mask(g, cond, g.dy[0]) if cond is not None else g.dy[0], None, None][: len(g.x)]


@register_gradient("Sigmoid")
def sigmoid(g: GradContext) -> list:
    y = g.y[0]
    return [g.op("Mul", g.dy[0], g.op("Mul", y, g.op("Sub", g.op("CastLike", g.scalar(1.0), y), y)))]


@register_gradient("Tanh")
def tanh(g: GradContext) -> list:
    y = g.y[0]
    return [g.op("Mul", g.dy[0], g.op("Sub", g.op("CastLike", g.scalar(1.0), y), g.op("Mul", y, y)))]


@register_gradient("Gelu")
def gelu(g: GradContext) -> list:
    """Exact Gelu: d/dx x*Phi(x) = Phi(x) + x*phi(x). (The tanh approximation is not handled.)"""
    x = g.x[0]
    phi_cdf = g.op("Mul", g.op("Add", g.op("Erf", g.op("Mul", x, g.scalar(1 / math.sqrt(2)))), g.scalar(1.0)),
                   g.scalar(0.5))
    pdf = g.op("Mul", g.op("Exp", g.op("Mul", g.op("Mul", x, x), g.scalar(-0.5))), g.scalar(1 / math.sqrt(2 * math.pi)))
    return [g.op("Mul", g.dy[0], g.op("Add", phi_cdf, g.op("Mul", x, pdf)))]


@register_gradient("Softmax")
def softmax(g: GradContext) -> list:
    """dx = y * (dy - sum(dy * y, axis))."""
    y, dy = g.y[0], g.dy[0]
    axis = g.attr("axis", -1)
    s = g.op("ReduceSum", g.op("Mul", dy, y), g.ints([axis]), keepdims=1)
    return [g.op("Mul", y, g.op("Sub", dy, s))]


@register_gradient("LogSoftmax")
def log_softmax(g: GradContext) -> list:
    """dx = dy - exp(y) * sum(dy, axis)."""
    y, dy = g.y[0], g.dy[0]
    s = g.op("ReduceSum", dy, g.ints([g.attr("axis", -1)]), keepdims=1)
    return [g.op("Sub", dy, g.op("Mul", g.op("Exp", y), s))]
