"""Pass registry: pass classes by name, so the CLI can run ``--passes a,b,c``.

Rule: every pass module decorates its class with ``@register("<name>")``; the decorator sets
the class attribute ``name`` and adds the class to :data:`REGISTRY`. Names are unique.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import onnx_ir as ir

from partitioner.core.errors import UsageError

REGISTRY: dict[str, type[ir.passes.PassBase]] = {}

_P = TypeVar("_P", bound=type)


def register(name: str) -> Callable[[_P], _P]:
    """Class decorator: register a pass class under ``name`` (and set ``cls.name``)."""

    def decorate(cls: _P) -> _P:
        existing = REGISTRY.get(name)
        if existing is not None and existing is not cls:
            raise UsageError(
                f"pass name '{name}' is registered twice ({existing.__qualname__} and {cls.__qualname__})"
            )
        cls.name = name  # type: ignore[attr-defined]
        REGISTRY[name] = cls  # type: ignore[assignment]
        return cls

    return decorate


def get_pass(name: str) -> type[ir.passes.PassBase]:
    """The pass class registered as ``name``; UsageError listing the valid names otherwise."""
    try:
        return REGISTRY[name]
    except KeyError:
        valid = ", ".join(sorted(REGISTRY))
        raise UsageError(f"unknown pass '{name}'; valid passes: {valid}") from None


def pass_name(pass_: object) -> str:
    """The registered name of a pass instance, or its class name when it is not registered."""
    return getattr(pass_, "name", None) or type(pass_).__name__
