"""Load a benchmark script (``benchmarks/<name>.py``) as a module, for tests of its functions."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


def load(name: str, module_name: str | None = None) -> ModuleType:
    """A fresh module from ``benchmarks/<name>.py``, registered under ``module_name`` (default ``name``)."""
    spec = importlib.util.spec_from_file_location(module_name or name, ROOT / "benchmarks" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
