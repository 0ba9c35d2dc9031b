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
import pathlib
from typing import Any, Protocol, runtime_checkable

from partitioner.core.errors import UsageError

BACKENDS = ("tvm", "onnxruntime")


@runtime_checkable
class RankExecutable(Protocol):
    """One rank's program, loaded: runs one micro-batch."""

    def run(self, feeds: dict[str, Any], comm: Any) -> dict[str, Any]: ...


@runtime_checkable
class Backend(Protocol):
    """The contract above, as a type: every ``backends.<name>`` module satisfies it."""

    NAME: str
    FILE_SUFFIX: str

    def build(self, program: Any, out_path: pathlib.Path, *, target: Any = None, options: Any = None) -> dict: ...

    def load(self, program: Any, path: pathlib.Path | None = None, *, threads: int = 1) -> RankExecutable: ...


def get_backend(name: str) -> Backend:
    if name not in BACKENDS:
        raise UsageError(f"unknown backend {name!r}; choose one of: {', '.join(BACKENDS)}")
    return importlib.import_module(f"backends.{name}")
