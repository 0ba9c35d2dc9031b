"""The launcher's rank watcher on a training run (``runtime/launch.py`` rule 6).

The watcher scans the whole process tree (about 2 ms of CPU) on every 5 ms poll until it has
recognised every rank by its worker module, then about once a second. Training ranks run
``partitioner.training.mpi_worker``, which it did not recognise: it scanned on every poll for the
whole run (1.75 ms of CPU every 5 ms, measured), about a quarter of a core taken from the two cores the ranks are pinned to (the
measured gap between a data-parallel rank's wall and CPU time, docs/training.md).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import numpy as np

import models_zoo
from partitioner.runtime import launch


def test_training_ranks_are_recognised_and_the_tree_scan_stops(tmp_path, monkeypatch) -> None:
    import onnx

    from partitioner.training import train

    watchers: list = []

    class Recording(launch._RankWatcher):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self.scans = 0
            watchers.append(self)

        def start(self) -> None:
            self.started = time.perf_counter()
            super().start()

        def stop(self) -> None:
            self.ended = time.perf_counter()
            super().stop()

        def _scan(self) -> None:
            self.scans += 1
            super()._scan()

    monkeypatch.setattr(launch, "_RankWatcher", Recording)
    model = tmp_path / "mlp.onnx"
    onnx.save(models_zoo.build("mlp", batch=8, hidden=32, in_features=16), str(model))
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "d.npz", x=rng.standard_normal((40, 16)).astype(np.float32), y=rng.integers(0, 10, 40))
    train(str(model), str(tmp_path / "d.npz"), loss="cross_entropy", optimizer="sgd", lr=0.1, batch=8, epochs=2,
          devices=2, progress=False, out_dir=tmp_path / "m", launcher="mpi")
    (w,) = watchers
    assert sorted(w.rank_of.values()) == [0, 1], "the training ranks were not recognised"
    assert w.ended - w.started > 0.5, "the run was too short to tell a scan on every poll from rare rescans"
    # found within the first polls (the ranks start within 20 of them), then about one rescan a
    # second (every RESCAN_POLLS-th 5 ms poll, or each blocked wait of rule 7)
    assert w.scans <= 20 + 2 * (w.ended - w.started), f"{w.scans} tree scans in {w.ended - w.started:.1f} s"


def _fake_ranks(module: str) -> subprocess.Popen:
    """A process whose two children look like ranks 0 and 1 of ``module`` (command line, PMI_RANK)."""
    sleeper = f"{sys.executable} -c 'import time; time.sleep(30)' {module}"
    return subprocess.Popen(["sh", "-c", f"PMI_RANK=0 {sleeper} & PMI_RANK=1 {sleeper} & wait"],
                            start_new_session=True)


def test_watcher_blocks_on_the_ranks_and_still_names_the_first_to_end() -> None:
    """Rule 7: once both ranks are known the watcher stops waking every 5 ms (each wake-up
    preempted a pinned rank: docs/training.md), yet a rank's end is recorded at once. With
    ``PIDFD_WATCH = False`` it polls about 60 times in the 0.3 s below (the test fails)."""
    if not hasattr(os, "pidfd_open"):
        import pytest

        pytest.skip("no os.pidfd_open on this system: rule 7 falls back to the 5 ms poll")
    proc = _fake_ranks("fake_rank_module")
    w = launch._RankWatcher(proc, 2, module="fake_rank_module")
    w.start()
    try:
        deadline = time.perf_counter() + 10
        while len(w.rank_of) < 2 and time.perf_counter() < deadline:
            time.sleep(0.01)
        assert sorted(w.rank_of.values()) == [0, 1], "the fake ranks were not recognised"
        time.sleep(0.1)  # the watcher settles into its blocked wait
        polls = w._polls
        time.sleep(0.3)
        assert w._polls - polls <= 2, f"{w._polls - polls} polls in 0.3 s with every rank known"
        (pid1,) = [pid for pid, r in w.rank_of.items() if r == 1]
        os.kill(pid1, 9)
        time.sleep(0.05)
        assert w.first_gone() == [1], f"rank 1's end not recorded within 50 ms: gone {w.gone}"
    finally:
        w.stop()
        os.killpg(proc.pid, 9)
        proc.wait()


def test_a_rank_killed_during_the_tree_scan_is_not_tied_with_the_first_to_die() -> None:
    """Rule 8: rank 1 dies; mpiexec then kills rank 0 while the watcher scans the tree (about
    2 ms). Liveness read before the scan records rank 1 alone first. Reading it after the scan
    (the old order) put both on one poll, and the run failed naming no rank (a CI failure)."""
    proc = _fake_ranks("fake_rank_module")
    w = launch._RankWatcher(proc, 2, module="fake_rank_module")
    try:
        deadline = time.perf_counter() + 10
        while len(w.rank_of) < 2 and time.perf_counter() < deadline:
            w.poll()
            time.sleep(0.01)
        assert sorted(w.rank_of.values()) == [0, 1], "the fake ranks were not recognised"
        pid_of = {r: pid for pid, r in w.rank_of.items()}

        def _gone(pid: int) -> None:
            end = time.perf_counter() + 5
            while launch._RankWatcher._running(pid) and time.perf_counter() < end:
                time.sleep(0.005)

        os.kill(pid_of[1], 9)
        _gone(pid_of[1])
        scan = w._scan

        def scan_while_mpiexec_kills_rank0() -> None:
            os.kill(pid_of[0], 9)
            _gone(pid_of[0])
            scan()

        w._scan = scan_while_mpiexec_kills_rank0
        w.poll(rescan=True)
        w._scan = scan
        w.poll()
        assert w.first_gone() == [1], f"rank 1 not named alone: gone {w.gone}"
    finally:
        w.stop()
        os.killpg(proc.pid, 9)
        proc.wait()
