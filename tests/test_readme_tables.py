"""The README's result tables are exactly what benchmarks/readme_tables.py renders from the JSON
in benchmarks/results/ (CI runs the same check in .ci/run), and the check does catch a
hand-edited figure."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from tests.bench_scripts import load as load_script

ROOT = Path(__file__).resolve().parents[1]


def _tables():
    return load_script("readme_tables")


def test_readme_tables_are_current() -> None:
    assert _tables().main(["--check"]) == 0, "run: .venv/bin/python benchmarks/readme_tables.py"


def test_check_catches_a_hand_edited_figure(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mod = _tables()
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    first = mod.PATTERN.search(text)
    assert first, "README.md has generated tables"
    body = first.group("body")
    edited_body = re.sub(r"\d", lambda m: str((int(m.group()) + 1) % 10), body, count=1)
    assert edited_body != body
    edited = tmp_path / "README.md"  # the first table alone (the others are checked by the test above)
    block = first.group(0)
    edited.write_text(block.replace(body, edited_body, 1), encoding="utf-8")
    monkeypatch.setattr(mod, "README", edited)
    assert mod.main(["--check"]) == 1
    edited.write_text(block, encoding="utf-8")  # and the same table unedited passes, so it was the edit
    assert mod.main(["--check"]) == 0
