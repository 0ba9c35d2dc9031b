"""``mpi_worker`` rule 2 (``$PARTITIONER_RANK_NICE``: a rank's niceness and its autogroup's) and
``benchmarks/train_step.py``'s ``ForeignCpu`` (other processes' share of the cores while a
configuration ran: this process tree's CPU, children included, is not counted as foreign)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.bench_scripts import load as load_script

ROOT = Path(__file__).resolve().parents[2]

_CHILD = """
import os, sys
from pathlib import Path
from partitioner.training.mpi_worker import apply_rank_nice
os.setsid()  # an autogroup of its own (as hydra_pmi_proxy gives every rank)
got = apply_rank_nice()
group = Path('/proc/self/autogroup').read_text() if Path('/proc/self/autogroup').exists() else ''
print(got, os.getpriority(os.PRIO_PROCESS, 0), group.strip())
"""


def _child(env_value: str | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PARTITIONER_RANK_NICE"}
    env["PYTHONPATH"] = str(ROOT)
    if env_value is not None:
        env["PARTITIONER_RANK_NICE"] = env_value
    return subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, env=env, timeout=60)


def test_rank_nice_sets_the_niceness_and_the_autogroups() -> None:
    base = os.getpriority(os.PRIO_PROCESS, 0)
    want = min(19, base + 3)
    out = _child(str(want))
    assert out.returncode == 0, out.stderr
    got, prio, group = out.stdout.strip().split(maxsplit=2)
    assert int(got) == want and int(prio) == want
    if group:  # kernels with autogroups: "/autogroup-N nice K"
        assert group.endswith(f"nice {want}"), group


def test_rank_nice_unset_or_zero_changes_nothing() -> None:
    base = os.getpriority(os.PRIO_PROCESS, 0)
    for value in (None, "", "0"):
        out = _child(value)
        assert out.returncode == 0, out.stderr
        got, prio = out.stdout.split()[:2]
        assert int(got) == 0 and int(prio) == base


def test_rank_nice_rejects_a_non_integer() -> None:
    from partitioner.training.mpi_worker import apply_rank_nice

    with pytest.raises(ValueError, match="PARTITIONER_RANK_NICE='high': expected an integer"):
        apply_rank_nice("high")


def test_foreign_cpu_counts_a_busy_child_as_ours() -> None:
    """A child that burns ~0.6 s of CPU during the window is in this tree's CPU, not the foreign
    share; the share is a fraction of all cores."""
    mod = load_script("train_step", "train_step_foreign")
    with mod.ForeignCpu(interval=0.05) as fc:
        child = subprocess.Popen([sys.executable, "-c",
                                  "import time\nt=time.process_time()\nwhile time.process_time()-t<0.6: pass\n"
                                  "time.sleep(0.3)"])
        child.wait(timeout=60)
        time.sleep(0.1)
    ours = sum(v - fc._first.get(k, 0.0) for k, v in fc._last.items())
    assert ours >= 0.5, ours
    assert fc.share is not None and 0.0 <= fc.share <= 1.0


def _mpi_train(tmp_path, out: str, **kw):
    import numpy as np
    import onnx

    import models_zoo
    from partitioner.training import train

    model = tmp_path / "mlp.onnx"
    if not model.exists():
        onnx.save(models_zoo.build("mlp", batch=8, hidden=32, in_features=16), str(model))
        rng = np.random.default_rng(0)
        np.savez(tmp_path / "d.npz", x=rng.standard_normal((24, 16)).astype(np.float32), y=rng.integers(0, 10, 24))
    return train(str(model), str(tmp_path / "d.npz"), out_dir=tmp_path / out, loss="cross_entropy", optimizer="sgd",
                 lr=0.1, batch=8, epochs=1, devices=2, progress=False, **kw)


def test_mpi_ranks_at_another_niceness_train_alike_and_a_bad_value_names_the_rank(tmp_path, monkeypatch) -> None:
    """Under mpiexec every rank applies ``$PARTITIONER_RANK_NICE`` (rule 2): the losses equal the
    in-process ranks' (rtol 1e-5, atol 1e-6); a value that is no integer fails the run with the
    rank's one-line message."""
    import numpy as np

    from partitioner.core.errors import RunFailed

    threads = _mpi_train(tmp_path, "t")
    monkeypatch.setenv("PARTITIONER_RANK_NICE", str(min(19, os.getpriority(os.PRIO_PROCESS, 0) + 2)))
    mpi = _mpi_train(tmp_path, "m", launcher="mpi")
    np.testing.assert_allclose([h["loss"] for h in mpi.history], [h["loss"] for h in threads.history],
                               rtol=1e-5, atol=1e-6)
    monkeypatch.setenv("PARTITIONER_RANK_NICE", "high")
    with pytest.raises(RunFailed, match=r"rank \d: train: \$PARTITIONER_RANK_NICE='high': expected an integer"):
        _mpi_train(tmp_path, "bad", launcher="mpi")
