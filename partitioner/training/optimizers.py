"""Optimizers as update rules emitted into the step: SGD, momentum SGD and Adam(W).

Each optimizer is plain data (a frozen dataclass: learning rate, weight decay, ...), so the
step's hyper-parameters are constants of the graph. ``state(weight)`` names the per-weight
state it keeps (``W.<slot>`` in, ``W.<slot>.next`` out, zeros at the start); Adam also keeps a
global step count ``optimizer.step`` for its bias correction. Rules (g = gradient, W weight):

- SGD: ``W' = W - lr * (g + wd * W)``.
- Momentum (PyTorch's form): ``v' = mu * v + g + wd * W``; ``W' = W - lr * v'``.
- AdamW (decoupled weight decay; Adam is ``weight_decay=0``): ``m' = b1 m + (1-b1) g``,
  ``v' = b2 v + (1-b2) g^2``, ``W' = W - lr * (m'/(1-b1^t) / (sqrt(v'/(1-b2^t)) + eps) + wd W)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import onnx_ir as ir

from partitioner.core.errors import UsageError
from partitioner.training.autodiff import Emitter

STEP_NAME = "optimizer.step"


@dataclass(frozen=True)
class SGD:
    lr: float = 0.01
    weight_decay: float = 0.0

    slots: ClassVar[tuple[str, ...]] = ()
    uses_step: ClassVar[bool] = False

    def update(self, em: Emitter, w: ir.Value, g: ir.Value, state: dict[str, ir.Value],
               step: ir.Value | None) -> tuple[ir.Value, dict[str, ir.Value]]:
        if self.weight_decay:
            g = em.op("Add", g, em.op("Mul", w, em.scalar(self.weight_decay)))
        return em.op("Sub", w, em.op("Mul", g, em.scalar(self.lr)), _name=f"{w.name}.next"), {}


@dataclass(frozen=True)
class Momentum:
    lr: float = 0.01
    momentum: float = 0.9
    weight_decay: float = 0.0

    slots: ClassVar[tuple[str, ...]] = ("velocity",)
    uses_step: ClassVar[bool] = False

    def update(self, em, w, g, state, step):
        if self.weight_decay:
            g = em.op("Add", g, em.op("Mul", w, em.scalar(self.weight_decay)))
        v = em.op("Add", em.op("Mul", state["velocity"], em.scalar(self.momentum)), g,
                  _name=f"{w.name}.velocity.next")
        return em.op("Sub", w, em.op("Mul", v, em.scalar(self.lr)), _name=f"{w.name}.next"), {"velocity": v}


@dataclass(frozen=True)
class AdamW:
    lr: float = 1e-3
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0

    slots: ClassVar[tuple[str, ...]] = ("m", "v")
    uses_step: ClassVar[bool] = True

    def update(self, em, w, g, state, step):
        b1, b2 = self.beta1, self.beta2
        m = em.op("Add", em.op("Mul", state["m"], em.scalar(b1)), em.op("Mul", g, em.scalar(1 - b1)),
                  _name=f"{w.name}.m.next")
        v = em.op("Add", em.op("Mul", state["v"], em.scalar(b2)), em.op("Mul", em.op("Mul", g, g), em.scalar(1 - b2)),
                  _name=f"{w.name}.v.next")
        c1 = em.op("Sub", em.scalar(1.0), em.op("Pow", em.scalar(b1), step))
        c2 = em.op("Sub", em.scalar(1.0), em.op("Pow", em.scalar(b2), step))
        denom = em.op("Add", em.op("Sqrt", em.op("Div", v, c2)), em.scalar(self.eps))
        upd = em.op("Div", em.op("Div", m, c1), denom)
        if self.weight_decay:
            upd = em.op("Add", upd, em.op("Mul", w, em.scalar(self.weight_decay)))
        return em.op("Sub", w, em.op("Mul", upd, em.scalar(self.lr)), _name=f"{w.name}.next"), {"m": m, "v": v}


Optimizer = SGD | Momentum | AdamW
OPTIMIZERS = ("sgd", "momentum", "adam", "adamw")


def make_optimizer(name: str, lr: float, weight_decay: float = 0.0, momentum: float = 0.9) -> Optimizer:
    """The optimizer a CLI name stands for (``adam`` and ``adamw`` are both AdamW)."""
    if not lr > 0:  # also refuses NaN
        raise UsageError(f"--lr {lr}: the learning rate must be positive")
    if name == "sgd":
        return SGD(lr=lr, weight_decay=weight_decay)
    if name == "momentum":
        return Momentum(lr=lr, momentum=momentum, weight_decay=weight_decay)
    if name in ("adam", "adamw"):
        return AdamW(lr=lr, weight_decay=weight_decay)
    raise UsageError(f"unknown optimizer {name!r}; choose one of {', '.join(OPTIMIZERS)}")
