"""Registers the ``fuzz`` marker (the long campaign is marked ``fuzz`` and ``slow``)."""

from __future__ import annotations


def pytest_configure(config) -> None:  # noqa: ANN001 - pytest's hook signature
    config.addinivalue_line("markers", "fuzz: the long differential fuzzing campaign (FUZZ_EXAMPLES examples)")
