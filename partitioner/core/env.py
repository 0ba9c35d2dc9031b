"""Numbers read from environment variables (the knobs a user sets for one run).

A knob is read when it is used, never at import: a bad value must not break ``import`` of the
module that reads it (every command imports most modules). A bad value is a :class:`UsageError`
(one line, exit 2) that names the variable and what it expects.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TypeVar

from partitioner.core.errors import UsageError

T = TypeVar("T", int, float)


def env_number(name: str, default: T, parse: Callable[[str], T], ok: Callable[[T], bool], expected: str) -> T:
    """``$name`` parsed by ``parse`` (``int`` or ``float``) when set, else ``default``; a value that
    does not parse or fails ``ok`` raises ``UsageError("$name='value': expected <expected>")``."""
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        value = parse(raw)
    except ValueError:
        raise UsageError(f"${name}={raw!r}: expected {expected}") from None
    if not ok(value):
        raise UsageError(f"${name}={raw!r}: expected {expected}")
    return value
