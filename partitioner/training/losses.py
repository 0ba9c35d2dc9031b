"""Losses: each emits the scalar loss and its gradient w.r.t. the model output in one go.

- ``cross_entropy``: logits ``[N, C]`` or ``[N, ..., C]`` (classes on the last axis), integer
  labels of the leading shape. loss = mean over samples of ``-log_softmax(logits)[label]``;
  d loss / d logits = ``(softmax - onehot) / count``. The one-hot is ``Equal(labels, arange)``,
  so no OneHot/SoftmaxCrossEntropyLoss op is needed by either backend.
- ``mse``: labels of the output's shape and float type; loss = mean((y - t)^2), gradient
  ``2 (y - t) / count``.

A loss that does not fit the output is a :class:`LossMismatchError` (exit 2), raised before any
node is built.
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


def label_spec(loss: str, output: ir.Value, label_name: str = "labels") -> LossSpec:
    shape = shape_of(output)
    if not (output.dtype and output.dtype.is_floating_point()):
        raise LossMismatchError(f"loss {loss}: output {output.name!r} is {output.dtype}, not a float tensor")
    if loss == "cross_entropy":
        if len(shape) < 2:
            raise LossMismatchError(f"loss cross_entropy: output {output.name!r} has shape {list(shape)}; it needs "
                                    "[batch, ..., classes] logits (use --loss mse for regression outputs)")
        return LossSpec(label_name, shape[:-1], ir.DataType.INT64)
    if loss == "mse":
        return LossSpec(label_name, shape, output.dtype)
    raise UsageError(f"unknown loss {loss!r}; choose one of {', '.join(LOSSES)}")


def emit_loss(loss: str, em: Emitter, output: ir.Value, labels: ir.Value) -> tuple[ir.Value, ir.Value]:
    """Emit ``loss`` on ``output`` against ``labels``; returns (loss scalar, d loss / d output)."""
    em.tag = "loss"
    shape = shape_of(output)
    if loss == "cross_entropy":
        count = int(np.prod(shape[:-1]))
        classes = shape[-1]
        logp = em.op("LogSoftmax", output, axis=-1)
        arange = em.const(np.arange(classes, dtype=np.int64), name="classes")
        onehot = em.op("CastLike", em.op("Equal", em.op("Unsqueeze", labels, em.ints([-1])), arange), output)
        picked = em.op("ReduceSum", em.op("Mul", onehot, logp), em.ints(range(len(shape))), keepdims=0)
        value = em.op("Mul", picked, em.scalar(-1.0 / count), _name="loss")
        grad = em.op("Mul", em.op("Sub", em.op("Exp", logp), onehot), em.scalar(1.0 / count))
        return value, grad
    if loss == "mse":
        count = int(np.prod(shape))
        diff = em.op("Sub", output, labels)
        value = em.op("Mul", em.op("ReduceSum", em.op("Mul", diff, diff), em.ints(range(len(shape))), keepdims=0),
                      em.scalar(1.0 / count), _name="loss")
        grad = em.op("Mul", diff, em.scalar(2.0 / count))
        return value, grad
    raise UsageError(f"unknown loss {loss!r}; choose one of {', '.join(LOSSES)}")
