"""Checks on builder arguments: a bad value is a :class:`UsageError` naming the argument."""

from __future__ import annotations

from partitioner.core.errors import UsageError


def positive_int(model: str, name: str, value: object) -> int:
    """``value`` as an int >= 1, else a UsageError that names the model and the argument."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UsageError(f"{model}: {name} must be a positive integer, got {value!r}")
    return value


def positive_float(model: str, name: str, value: object) -> float:
    """``value`` as a float > 0, else a UsageError that names the model and the argument."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise UsageError(f"{model}: {name} must be a positive number, got {value!r}")
    return float(value)


def seed_int(model: str, value: object) -> int:
    """A seed is any int >= 0."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise UsageError(f"{model}: seed must be a non-negative integer, got {value!r}")
    return value


def require(condition: bool, message: str) -> None:
    """Raise a UsageError with ``message`` unless ``condition`` holds."""
    if not condition:
        raise UsageError(message)
