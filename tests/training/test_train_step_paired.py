"""``benchmarks/train_step.py --paired-env``: each configuration runs once with the environment
as it is and once with the knob set, in fresh processes (the environment is what reaches them),
the order alternating per round, and the environment is restored afterwards. The measurement is
replaced by a recorder (no training runs here)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
KNOB = "PARTITIONER_TEST_PAIRED_KNOB"


def _script():
    spec = importlib.util.spec_from_file_location("train_step_paired", ROOT / "benchmarks" / "train_step.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_paired_runs_alternate_and_restore_the_environment(monkeypatch) -> None:
    import os

    mod = _script()
    monkeypatch.setenv(KNOB, "1")
    seen = []

    def record(fn, args):
        seen.append((args[2], os.environ.get(KNOB)))
        return {"median_step_s": 0.1}

    monkeypatch.setattr(mod, "_in_fresh_process", record)
    monkeypatch.setattr(mod, "CASES", mod.QUICK)
    labels = ["1 rank, 1 thread", "2 ranks data (MPI)"]
    rows = mod.run_paired("mlp", "onnxruntime", 1, f"{KNOB}=0", labels, rounds=2)
    assert seen == [(labels[0], "1"), (labels[0], "0"), (labels[1], "1"), (labels[1], "0"),
                    (labels[0], "0"), (labels[0], "1"), (labels[1], "0"), (labels[1], "1")]
    assert [r["setting"] for r in rows] == ["default", "env"] * 2 + ["env", "default"] * 2
    assert os.environ[KNOB] == "1"
