"""partitioner: an ONNX graph compiler and auto-partitioner.

Public API (heavy parts are imported on first use):

- ``load(path | ModelProto | zoo name, batch=None, shapes=None, constants=None) -> onnx_ir.Model``
- ``Cluster.resolve("cpu:2" | "h200x8" | "cluster.json")``
- ``partition(model, cluster, strategy=...)`` / ``auto_partition(model, cluster, ...)``
- ``compile(model, cluster=..., strategy=..., target=...) -> Artifact``; ``load_artifact(dir)``
- ``train(model, data, loss=..., optimizer=..., lr=..., batch=..., epochs=..., devices=...)``
"""

from __future__ import annotations

from typing import Any

from partitioner.core.errors import PartitionerError
from partitioner.load import load

__version__ = "0.1.0"

_LAZY = {
    "Cluster": ("partitioner.cluster", "Cluster"),
    "partition": ("partitioner.partition", "partition"),
    "auto_partition": ("partitioner.partition", "auto_partition"),
    "compile": ("partitioner.compiler", "compile"),
    "load_artifact": ("partitioner.compiler", "load_artifact"),
    "Artifact": ("partitioner.compiler", "Artifact"),
    "run_pipeline": ("passes", "run_pipeline"),
    "train": ("partitioner.training.loop", "train"),
}

__all__ = ["PartitionerError", "load", "__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'partitioner' has no attribute {name!r}")
