"""Backends turn a per-rank program (an ONNX model that may contain ``partitioner.comm`` nodes)
into something that runs: ONNX Runtime (the reference) and TVM (the product).

Contract of a backend module (``backends.<name>``):

- ``NAME: str`` and ``FILE_SUFFIX: str`` (the per-rank file it writes, e.g. ``".so"``).
- ``build(program: onnx.ModelProto, out_path: pathlib.Path, *, target=None, options=None) -> dict``
  writes the per-rank file and returns build facts for the manifest (JSON-able).
- ``load(program: onnx.ModelProto, path: pathlib.Path, *, threads: int = 1) -> RankExecutable``.

A ``RankExecutable`` has ``run(feeds: dict[str, np.ndarray], comm: Communicator) ->
dict[str, np.ndarray]`` that runs the program once (one micro-batch) and returns the graph outputs.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from partitioner.core.errors import UsageError

BACKENDS = ("tvm", "onnxruntime")


def get_backend(name: str) -> ModuleType:
    if name not in BACKENDS:
        raise UsageError(f"unknown backend {name!r}; choose one of: {', '.join(BACKENDS)}")
    return importlib.import_module(f"backends.{name}")
