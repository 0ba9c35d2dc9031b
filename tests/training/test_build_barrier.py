"""MPI training ranks wait for each other's builds before the first step (``training/loop.py``
rule 7): a rank that builds slowly must not make the others' first receive or AllReduce run past
the step's deadline (``$PARTITIONER_COMM_TIMEOUT``), and the build wait has its own deadline.

The slow build is the fault hook's ``kind:slow`` at ``built`` (``runtime/fault.py``): rank 0
sleeps after building, as a rank does whose TVM build takes longer on a loaded machine.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest

import models_zoo
from partitioner.core.errors import RunFailed, UsageError
from partitioner.runtime.fault import Fault


def _train(tmp_path, **kw):
    from partitioner.training import train

    model = tmp_path / "mlp.onnx"
    onnx.save(models_zoo.build("mlp", batch=8, hidden=32, in_features=16), str(model))
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "d.npz", x=rng.standard_normal((16, 16)).astype(np.float32), y=rng.integers(0, 10, 16))
    return train(str(model), str(tmp_path / "d.npz"), loss="cross_entropy", optimizer="sgd", lr=0.1, batch=8,
                 epochs=1, devices=2, progress=False, out_dir=tmp_path / "run", launcher="mpi", **kw)


def test_a_slow_builder_does_not_time_out_the_other_rank(tmp_path, monkeypatch) -> None:
    # rank 0 arrives 4 s after rank 1; the step's deadline is 1.5 s. Without the barrier rank 1's
    # first AllReduce times out (this test failed so before rule 7).
    monkeypatch.setenv("PARTITIONER_COMM_TIMEOUT", "1.5")
    monkeypatch.setenv("PARTITIONER_FAULT", "rank:0,at:built,kind:slow,seconds:4")
    history = _train(tmp_path).history
    losses = [h["loss"] for h in history]
    assert len(losses) == 2 and all(np.isfinite(losses))


def test_the_build_wait_has_its_own_deadline(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("PARTITIONER_BUILD_WAIT", "1")
    monkeypatch.setenv("PARTITIONER_FAULT", "rank:0,at:built,kind:slow,seconds:6")
    with pytest.raises(RunFailed, match="waiting for every rank to finish building: timed out after 1 s"):
        _train(tmp_path)
    assert not (tmp_path / "run" / "model.onnx").exists()


@pytest.mark.parametrize("value", ["soon", "0", "-3"])
def test_a_bad_build_wait_is_refused_before_any_rank_starts(tmp_path, monkeypatch, value) -> None:
    monkeypatch.setenv("PARTITIONER_BUILD_WAIT", value)
    with pytest.raises(UsageError, match="PARTITIONER_BUILD_WAIT"):
        _train(tmp_path)
    assert not (tmp_path / "run" / "rank0").exists()


def test_slow_fault_parses() -> None:
    f = Fault.parse("rank:1,at:built,kind:slow,seconds:2.5")
    assert (f.rank, f.at, f.kind, f.seconds) == (1, "built", "slow", 2.5)
