"""Every backend module satisfies the :class:`backends.Backend` protocol (the contract in
backends/__init__.py), and an unknown name is a usage error."""

from __future__ import annotations

import pytest

import backends
from partitioner.core.errors import UsageError


@pytest.mark.parametrize("name", backends.BACKENDS)
def test_every_backend_module_satisfies_the_protocol(name: str) -> None:
    mod = backends.get_backend(name)
    assert isinstance(mod, backends.Backend)
    assert mod.NAME == name
    assert mod.FILE_SUFFIX.startswith(".")


def test_unknown_backend_is_a_usage_error() -> None:
    with pytest.raises(UsageError, match="unknown backend 'nosuch'"):
        backends.get_backend("nosuch")
