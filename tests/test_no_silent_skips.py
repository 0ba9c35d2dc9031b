"""A broken install must fail the suite, never turn into skips.

Rule: no test imports tvm or one of our own packages through ``pytest.importorskip``; they are
imported directly, so a missing or broken tvm / partitioner shows up as an import error.
"""

from __future__ import annotations

import re
from pathlib import Path

TESTS = Path(__file__).resolve().parent
OURS = ("tvm", "partitioner", "passes", "backends", "models_zoo", "tests")
CALL = re.compile(r"importorskip\(\s*['\"]([\w.]+)['\"]")


def test_no_importorskip_on_tvm_or_our_modules() -> None:
    offenders = []
    for path in sorted(TESTS.rglob("*.py")):
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            for mod in CALL.findall(line):
                if mod.split(".")[0] in OURS:
                    offenders.append(f"{path.relative_to(TESTS)}:{lineno} importorskip({mod!r})")
    assert not offenders, "import these directly: " + "; ".join(offenders)
