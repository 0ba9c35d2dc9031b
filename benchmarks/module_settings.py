"""``MODULE.ATTR=VALUE`` settings for before/after runs of the benchmarks: a schedule rule's or a
runtime's module-level switch changed around one call, so both sides are built or run in the
same process and timed in the same interleaved rounds (``per_device.py --runtime-baseline`` /
``--build-baseline``, ``gemm.py --variant``)."""

from __future__ import annotations

import ast
import importlib
from typing import Any, Callable

Setting = tuple[Any, str, Any]


def parse_settings(items: list[str]) -> tuple[list[Setting], list[Setting]]:
    """``MODULE.ATTR=VALUE`` items (VALUE a Python literal) as (module, attr, value) triples: the
    values in force now and the ones asked for."""
    now, asked = [], []
    for item in items:
        target, value = item.split("=", 1)
        mod_name, attr = target.rsplit(".", 1)
        mod = importlib.import_module(mod_name)
        if not hasattr(mod, attr):
            raise SystemExit(f"error: {mod_name} has no setting {attr!r}")
        now.append((mod, attr, getattr(mod, attr)))
        asked.append((mod, attr, ast.literal_eval(value)))
    return now, asked


def with_settings(fn: Callable[[], Any], settings: list[Setting]) -> Callable[[], Any]:
    """``fn`` run with ``settings`` set (and the previous values put back after each call)."""
    def run() -> Any:
        saved = [(mod, attr, getattr(mod, attr)) for mod, attr, _ in settings]
        for mod, attr, value in settings:
            setattr(mod, attr, value)
        try:
            return fn()
        finally:
            for mod, attr, value in saved:
                setattr(mod, attr, value)

    return run
