"""Conv ``auto``'s cached times are used only with the schedules they were measured with
(``backends/tvm/conv_algorithms.py`` rule 2, :func:`schedules_fingerprint`)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from backends.tvm import conv_algorithms as ca
from backends.tvm.schedules import contraction

P = {"data": [1, 6, 6, 8], "weight": [3, 3, 8, 8], "strides": (1, 1), "dilation": (1, 1), "padding": (1, 1, 1, 1),
     "im2col": True, "winograd": True}


@pytest.fixture
def timed(monkeypatch: pytest.MonkeyPatch) -> list[dict]:
    """Every measurement (no real timing): im2col 2x faster than direct."""
    calls: list[dict] = []

    def fake(p, target):
        calls.append(p)
        return {"direct": 1.0, "im2col": 0.5, "winograd": 2.0}

    monkeypatch.setattr(ca, "_time_candidates", fake)
    monkeypatch.setattr(ca, "_MEASURED", {})
    return calls


def test_an_entry_of_the_same_schedules_is_read_and_one_of_others_measured_again(tmp_path: Path, timed,
                                                                                  monkeypatch) -> None:
    cache = tmp_path / ca.CACHE_FILE
    assert ca.measure(P, None, cache) == ("im2col", "measured")
    (entry,) = json.loads(cache.read_text()).values()
    assert entry["schedules"] == ca.schedules_fingerprint()
    ca._MEASURED.clear()  # a new process: the file's times, no measurement
    assert ca.measure(P, None, cache) == ("im2col", "cache") and len(timed) == 1
    # the same file under another setting of a schedule module: measured again and rewritten
    ca._MEASURED.clear()
    monkeypatch.setattr(contraction, "REGISTER_FILE_TILE", not contraction.REGISTER_FILE_TILE)
    changed = ca.schedules_fingerprint()
    assert changed != entry["schedules"]
    assert ca.measure(P, None, cache) == ("im2col", "measured") and len(timed) == 2
    (entry2,) = json.loads(cache.read_text()).values()
    assert entry2["schedules"] == changed
    # the process cache is per fingerprint too: back to the first setting, nothing is reused from the second
    monkeypatch.setattr(contraction, "REGISTER_FILE_TILE", not contraction.REGISTER_FILE_TILE)
    assert ca.measure(P, None, cache) == ("im2col", "measured") and len(timed) == 3


def test_an_entry_with_times_but_no_fingerprint_is_measured_again(tmp_path: Path, timed) -> None:
    cache = tmp_path / ca.CACHE_FILE
    cache.write_text(json.dumps({ca._key(P): {"fastest": "winograd",
                                              "seconds": {"direct": 1.0, "im2col": 2.0, "winograd": 0.1}}}))
    assert ca.measure(P, None, cache) == ("im2col", "measured") and len(timed) == 1
    # an entry with no times at all (a hand-written choice) keeps its choice, as documented
    ca._MEASURED.clear()
    cache.write_text(json.dumps({ca._key(P): {"fastest": "winograd"}}))
    assert ca.measure(P, None, cache) == ("winograd", "cache") and len(timed) == 1


def test_the_parallel_threshold_is_part_of_the_fingerprint(monkeypatch) -> None:
    from backends.tvm.schedules import threads

    before = ca.schedules_fingerprint()
    monkeypatch.setenv(threads.ENV, "123456.0")
    assert ca.schedules_fingerprint() != before


def _module(path: Path, text: str, monkeypatch: pytest.MonkeyPatch):
    path.write_text(text)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, path.stem, module)  # removed again after the test
    spec.loader.exec_module(module)
    return module


def test_the_code_digest_ignores_docstrings_and_comments_not_code(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(ca, "_CODE_DIGESTS", {})
    a = _module(tmp_path / "fp_a.py", '"""Doc."""\nTILE = 4\n\n\ndef f(x):\n    """Old doc."""\n    return x * TILE\n',
                monkeypatch)
    b = _module(tmp_path / "fp_b.py", '"""Other doc."""\n# a comment\nTILE = 4\n\n\ndef f(x):\n'
                '    """New doc, longer."""\n    return x * TILE  # why\n', monkeypatch)
    c = _module(tmp_path / "fp_c.py", '"""Doc."""\nTILE = 4\n\n\ndef f(x):\n    """Old doc."""\n    return x + TILE\n', monkeypatch)
    for m in (a, b, c):
        m.__name__ = "fp"  # one name: the digest is cached per module name, cleared between the three
        ca._CODE_DIGESTS.clear()
        m.digest = ca._code_digest(m)
    assert a.digest == b.digest
    assert a.digest != c.digest
