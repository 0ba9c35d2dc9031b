"""``partitioner.core.env.env_number``: a knob read when used, a bad value one UsageError line."""

from __future__ import annotations

import pytest

from partitioner.core.env import env_number
from partitioner.core.errors import UsageError

NAME = "PARTITIONER_TEST_KNOB"


def test_unset_gives_the_default_and_a_good_value_is_parsed(monkeypatch) -> None:
    monkeypatch.delenv(NAME, raising=False)
    assert env_number(NAME, 5, int, lambda v: v >= 1, "a whole number") == 5
    monkeypatch.setenv(NAME, "12")
    assert env_number(NAME, 5, int, lambda v: v >= 1, "a whole number") == 12
    monkeypatch.setenv(NAME, "0.25")
    assert env_number(NAME, 1.0, float, lambda v: v > 0, "seconds") == 0.25


@pytest.mark.parametrize("raw, why", [("x", "does not parse"), ("0", "fails the check"), ("", "empty")])
def test_a_bad_value_names_the_variable_and_what_it_expects(monkeypatch, raw, why) -> None:
    monkeypatch.setenv(NAME, raw)
    with pytest.raises(UsageError) as err:
        env_number(NAME, 5, int, lambda v: v >= 1, "a whole number (>= 1)")
    assert str(err.value) == f"${NAME}={raw!r}: expected a whole number (>= 1)", why
    assert UsageError.exit_code == 2
