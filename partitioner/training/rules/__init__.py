"""Gradient rules, one module per op family; importing this package registers all of them."""

from __future__ import annotations

from partitioner.training.rules import activations, comm, elementwise, linear, normalization, pooling, shape_ops

__all__ = ["activations", "comm", "elementwise", "linear", "normalization", "pooling", "shape_ops"]
