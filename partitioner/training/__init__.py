"""Training from an ONNX graph: autodiff rules per op, losses, optimizers and the step builder.

- :func:`build_training_graph` ``(model, loss, trainable, optimizer)`` -> the training step as
  one onnx-ir model of standard ops (see :mod:`partitioner.training.step`).
- :class:`SGD`, :class:`Momentum`, :class:`AdamW` (:mod:`partitioner.training.optimizers`).
- :func:`train` (:mod:`partitioner.training.loop`): the single- or multi-rank training loop.
"""

from __future__ import annotations

from typing import Any

from partitioner.training.autodiff import GRADIENTS, MissingGradientError, register_gradient
from partitioner.training.optimizers import SGD, AdamW, Momentum, make_optimizer
from partitioner.training.step import (
    TrainingSignature,
    build_training_graph,
    initial_state,
    signature,
    step_program,
)

__all__ = [
    "GRADIENTS",
    "SGD",
    "AdamW",
    "MissingGradientError",
    "Momentum",
    "TrainingSignature",
    "build_training_graph",
    "initial_state",
    "make_optimizer",
    "register_gradient",
    "signature",
    "step_program",
    "train",
]


def __getattr__(name: str) -> Any:
    if name == "train":
        from partitioner.training.loop import train

        return train
    raise AttributeError(name)
