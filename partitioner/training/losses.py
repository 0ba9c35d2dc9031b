"""Losses: each emits the scalar loss and its gradient w.r.t. the model output in one go.

- ``cross_entropy``: logits ``[N, C]`` or ``[N, ..., C]`` (classes on the last axis), integer
  labels of the leading shape. A classifier head that keeps its spatial axes at 1, ``[N, C, 1,
  ..., 1]`` (SqueezeNet's and DenseNet's exported outputs), has its classes on axis 1: it is read as
  ``[N, C]`` and its labels are ``[N]`` (on the last axis it would be one class, a loss of 0).
  loss = mean over samples of ``-log_softmax(logits)[label]``; d loss / d logits = ``(softmax - onehot) / count``. The one-hot is ``Equal(labels, arange)``,
  so no OneHot/SoftmaxCrossEntropyLoss op is needed by either backend.
- ``mse``: labels of the output's shape and float type; loss = mean((y - t)^2), gradient
  ``2 (y - t) / count``.

A loss that does not fit the output is a :class:`LossMismatchError` (exit 2), raised before any
node is built.

An output that is already probabilities, a ``Softmax`` over the class axis (8 of onnx's 9 real
architectures end in one), takes cross_entropy as ``-log p[label]``: computed from the Softmax's
input, the logits (:func:`loss_input`), where the formula above gives the same value stably. Taken
on the probabilities themselves, log_softmax would squash them (a 1000-class loss stuck near
ln 1000 whatever the weights).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from partitioner.core.errors import UsageError
from partitioner.training.autodiff import Emitter, shape_of

LOSSES = ("cross_entropy", "mse")


class LossMismatchError(UsageError):
    """The loss does not fit the model's output (shape, type or rank)."""


@dataclass(frozen=True)
class LossSpec:
    """The label input a loss needs: its name, shape and element type."""

    name: str
    shape: tuple[int, ...]
    dtype: ir.DataType


def logits_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape cross_entropy reads the output as: ``[N, C]`` for ``[N, C, 1, ..., 1]`` (module
    docstring), the output's own shape otherwise."""
    if len(shape) > 2 and shape[1] > 1 and all(d == 1 for d in shape[2:]):
        return tuple(shape[:2])
    return tuple(shape)


def loss_input(loss: str, output: ir.Value) -> ir.Value:
    """The value the loss reads: the logits feeding ``output`` when cross_entropy meets a Softmax
    over the class axis (module docstring), ``output`` itself otherwise. The backward is seeded
    there, so the Softmax is left out of it."""
    if loss != "cross_entropy":
        return output
    value, node = output, output.producer()
    if node is not None and node.op_type in ("Reshape", "Flatten") and node.inputs[0] is not None and \
            shape_of(node.inputs[0]) == logits_shape(shape_of(output)):
        value = node.inputs[0]  # [N, C] back to [N, C, 1, 1] (ONNX's version converter wraps Softmax-9 so)
        node = value.producer()
    if node is None or node.op_type != "Softmax" or node.domain not in ("", "ai.onnx"):
        return output
    shape = shape_of(value)
    class_axis = len(logits_shape(shape)) - 1
    a = node.attributes.get("axis")
    if a is not None:
        axis = int(a.value)
    else:  # opset 13 on: -1; before: 1 (over the dims from 1 on flattened)
        opset = node.version or (node.graph.opset_imports.get("", 13) if node.graph is not None else 13)
        axis = -1 if opset >= 13 else 1
    if axis % len(shape) != class_axis:  # (before opset 13 the dims after it are 1: logits_shape)
        return output
    return node.inputs[0]


def label_spec(loss: str, output: ir.Value, label_name: str = "labels") -> LossSpec:
    shape = shape_of(output)
    if not (output.dtype and output.dtype.is_floating_point()):
        raise LossMismatchError(f"loss {loss}: output {output.name!r} is {output.dtype}, not a float tensor")
    if loss == "cross_entropy":
        if len(shape) < 2:
            raise LossMismatchError(f"loss cross_entropy: output {output.name!r} has shape {list(shape)}; it needs "
                                    "[batch, ..., classes] logits (use --loss mse for regression outputs)")
        return LossSpec(label_name, logits_shape(shape)[:-1], ir.DataType.INT64)
    if loss == "mse":
        return LossSpec(label_name, shape, output.dtype)
    raise UsageError(f"unknown loss {loss!r}; choose one of {', '.join(LOSSES)}")


def emit_loss(loss: str, em: Emitter, output: ir.Value, labels: ir.Value) -> tuple[ir.Value, ir.Value]:
    """Emit ``loss`` on ``output`` against ``labels``; returns (loss scalar, d loss / d output)."""
    em.tag = "loss"
    shape = shape_of(output)
    if loss == "cross_entropy":
        logits = logits_shape(shape)
        count = int(np.prod(logits[:-1]))
        classes = logits[-1]
        if logits != shape:  # [N, C, 1, ..., 1] read as [N, C]; the gradient reshaped back
            output = em.op("Reshape", output, em.ints(logits))
        logp = em.op("LogSoftmax", output, axis=-1)
        arange = em.const(np.arange(classes, dtype=np.int64), name="classes")
        onehot = em.op("CastLike", em.op("Equal", em.op("Unsqueeze", labels, em.ints([-1])), arange), output)
        picked = em.op("ReduceSum", em.op("Mul", onehot, logp), em.ints(range(len(logits))), keepdims=0)
        value = em.op("Mul", picked, em.scalar(-1.0 / count), _name="loss")
        grad = em.op("Mul", em.op("Sub", em.op("Exp", logp), onehot), em.scalar(1.0 / count))
        return value, (em.op("Reshape", grad, em.ints(shape)) if logits != shape else grad)
    if loss == "mse":
        count = int(np.prod(shape))
        diff = em.op("Sub", output, labels)
        value = em.op("Mul", em.op("ReduceSum", em.op("Mul", diff, diff), em.ints(range(len(shape))), keepdims=0),
                      em.scalar(1.0 / count), _name="loss")
        grad = em.op("Mul", diff, em.scalar(2.0 / count))
        return value, grad
    raise UsageError(f"unknown loss {loss!r}; choose one of {', '.join(LOSSES)}")
