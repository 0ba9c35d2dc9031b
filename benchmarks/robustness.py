"""The README's robustness table, generated from what the suites record:

- differential fuzzing: ``benchmarks/results/fuzz_summary.json`` (written by ``make fuzz``);
- hostile inputs: the catalogue in ``tests/hostile/hostile_testkit.py`` (each class is a test
  through the API and through the CLI: exit 2, one line, bounded time and memory);
- regressions: the minimised models in ``tests/fuzz/test_regressions.py``.

    python benchmarks/robustness.py --markdown
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def hostile_classes() -> list[str]:
    """Case names registered in the catalogue (read from the source, no import needed)."""
    tree = ast.parse((ROOT / "tests" / "hostile" / "hostile_testkit.py").read_text())
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "HostileCase" and node.args:
            if isinstance(node.args[0], ast.Constant):
                names.append(node.args[0].value)
    return sorted(set(names))


def regression_tests() -> int:
    tree = ast.parse((ROOT / "tests" / "fuzz" / "test_regressions.py").read_text())
    return sum(1 for n in tree.body if isinstance(n, ast.FunctionDef) and n.name.startswith("test_"))


def split_counts(fuzz: dict) -> tuple[dict[str, int], int]:
    """Matched examples that were really split over 2+ ranks, per strategy, and the matched ones
    that split nothing (``auto`` chose ``single``).

    A summary written since the campaign records it (``split``, ``matched_unsplit``) is read as
    is. An older summary has only per-strategy ``ok`` counts and ``auto_chose``: every non-auto
    plan there ran on its 2-4 ranks (the fuzzer draws 2-4 devices and a strategy refuses rather
    than shrink), and auto's ``single`` choices are subtracted from auto's ``ok``.
    """
    if "split" in fuzz:
        return dict(fuzz["split"]), sum(fuzz.get("matched_unsplit", {}).values())
    ok = {k: v.get("ok", 0) for k, v in fuzz["strategies_exercised"].items()}
    unsplit = int(fuzz.get("auto_chose", {}).get("single", 0))
    if "auto" in ok:
        ok["auto"] -= unsplit
    return ok, unsplit


def markdown() -> str:
    fuzz = json.loads((ROOT / "benchmarks" / "results" / "fuzz_summary.json").read_text())
    split, unsplit = split_counts(fuzz)
    tvm = (f"{fuzz['tvm_split']} split examples also through TVM" if "tvm_split" in fuzz
           else f"{fuzz.get('tvm', {}).get('ok', 0)} examples also through TVM (split or not: not recorded)")
    lines = ["| suite | figure |", "|---|---|",
             f"| differential fuzzing (random graphs x random plans vs ONNX Runtime) | {fuzz['examples_run']} examples, "
             f"{sum(split.values())} split over 2-4 ranks and matched "
             f"({', '.join(f'{k} {v}' for k, v in sorted(split.items()))}); not counted: "
             f"{unsplit} where auto chose 1 rank, {fuzz.get('not_applicable', 0)} refused by the strategy; "
             f"{tvm} |",
             f"| mismatches / crashes in that run | {fuzz['mismatches_found']} / {fuzz['crashes_found']} |",
             "| bugs found by fuzzing, fixed and kept as minimised regression tests (docs/fuzzing.md) | "
             f"{regression_tests()} tests |",
             f"| hostile-input classes refused (exit 2, one line, < 10 s of CPU, bounded memory, no reads outside the model's folder) | "
             f"{len(hostile_classes())} |"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--markdown", action="store_true", help="print the README table")
    ap.parse_args(argv)
    print(markdown())
    return 0


if __name__ == "__main__":
    sys.exit(main())
