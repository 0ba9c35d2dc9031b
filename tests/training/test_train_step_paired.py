"""``benchmarks/train_step.py --paired-env``: each configuration runs once with the environment
as it is and once with the knob set, in fresh processes (the environment is what reaches them),
the order alternating per round, and the environment is restored afterwards. The measurement is
replaced by a recorder (no training runs here)."""

from __future__ import annotations

from tests.bench_scripts import load as load_script

KNOB = "PARTITIONER_TEST_PAIRED_KNOB"


def _script():
    return load_script("train_step", "train_step_paired")


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


def test_paired_table_takes_medians_over_rounds_and_stays_out_of_the_main_table(tmp_path) -> None:
    """``--markdown --paired``: per configuration the median of each setting's rounds and their
    ratio; the main table (``--markdown``) skips ``*_paired.json`` (it has no ``results``)."""
    import json

    ts = _script()
    rows = [{"round": i, "setting": s, "label": "1 rank, 1 thread", "load": [1.0 + i], "median_step_s": t}
            for i, (s, t) in enumerate([("default", 0.30), ("env", 0.40), ("default", 0.10), ("env", 0.50),
                                        ("default", 0.20), ("env", 0.45)])]
    doc = {"model": "mlp", "backend": "onnxruntime", "env": "X=0", "steps": 2, "rows": rows}
    (tmp_path / "train_step_mlp_onnxruntime_paired.json").write_text(json.dumps(doc))
    table = ts.paired_markdown(tmp_path).splitlines()
    assert len(table) == 3
    cells = [c.strip() for c in table[2].strip("|").split("|")]
    assert cells[4:8] == ["3", "200.0", "450.0", "0.44"] and cells[8] == "1.0-6.0"
    assert len(ts.markdown(tmp_path).splitlines()) == 2  # header only: the paired file is not a full run
