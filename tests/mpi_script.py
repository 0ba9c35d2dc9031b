"""Run a test file as a 2-rank MPI script and read what each rank wrote.

The MPI tests here are their own scripts: run under ``mpiexec -n 2`` with an output folder as
their first argument, each rank writes ``rank<N>.json`` there; the pytest side launches them and
asserts on those reports (:func:`rank_reports`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def rank_reports(script: str, out: Path, timeout: float, tail: int = 2000, ranks: int = 2) -> list[Any]:
    """Launch ``script`` on ``ranks`` MPI ranks with ``out`` as its argument (the project on
    ``PYTHONPATH``), assert it exited 0 (the last ``tail`` characters of its stderr otherwise), and
    return each rank's ``rank<N>.json``, in rank order."""
    from partitioner.runtime.launch import find_mpiexec

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([find_mpiexec(), "-n", str(ranks), sys.executable, script, str(out)], env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-tail:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(ranks)]
