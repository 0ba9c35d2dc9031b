"""Regenerate the README's result tables from the JSON in benchmarks/results/.

Each table sits between ``<!-- table: SCRIPT -->`` and ``<!-- /table -->`` in README.md, and is
what ``python benchmarks/SCRIPT.py --markdown`` prints (``SCRIPT`` with a slash is a path from
the repository root, e.g. ``tests/conformance/run_conformance``) (each script renders its own JSON). So no
figure in the README is typed by hand.

    .venv/bin/python benchmarks/readme_tables.py          # rewrite README.md
    .venv/bin/python benchmarks/readme_tables.py --check  # exit 1 if README.md is stale
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PATTERN = re.compile(r"(<!-- table: (?P<script>[\w./-]+)(?P<args>[^>]*?) -->\n)(?P<body>.*?)(<!-- /table -->)", re.S)


def render(script: str, args: str) -> str:
    path = ROOT / f"{script}.py" if "/" in script else ROOT / "benchmarks" / f"{script}.py"
    cmd = [sys.executable, str(path), "--markdown", *args.split()]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=120)
    if proc.returncode != 0:
        raise SystemExit(f"readme_tables: {' '.join(cmd)} failed: {proc.stderr.strip().splitlines()[-1:]}")
    return proc.stdout.rstrip("\n") + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="regenerate README tables from benchmarks/results/*.json")
    ap.add_argument("--check", action="store_true", help="exit 1 when README.md differs from the generated tables")
    args = ap.parse_args(argv)
    text = README.read_text(encoding="utf-8")
    # each table is its own script's process (about half a second of imports): run them side by side
    with ThreadPoolExecutor(max_workers=4) as pool:
        tables = PATTERN.finditer(text)
        bodies = iter(list(pool.map(lambda m: render(m.group("script"), m.group("args")), tables)))
    new = PATTERN.sub(lambda m: m.group(1) + next(bodies) + m.group(5), text)
    if args.check:
        if new != text:
            print("README.md tables are stale: run benchmarks/readme_tables.py", file=sys.stderr)
            return 1
        return 0
    README.write_text(new, encoding="utf-8")
    print(f"README.md: {len(PATTERN.findall(text))} table(s) regenerated")
    return 0


if __name__ == "__main__":
    sys.exit(main())
