"""The launcher's rank watcher on a training run (``runtime/launch.py`` rule 6).

The watcher scans the whole process tree (about 2 ms of CPU) on every 5 ms poll until it has
recognised every rank by its worker module, then about once a second. Training ranks run
``partitioner.training.mpi_worker``, which it did not recognise: it scanned on every poll for the
whole run (1.75 ms of CPU every 5 ms, measured), about a quarter of a core taken from the two cores the ranks are pinned to (the
measured gap between a data-parallel rank's wall and CPU time, docs/training.md).
"""

from __future__ import annotations

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
    assert w._polls > 40, "the run was too short to tell a scan on every poll from a scan on every 20th"
    # found within the first polls (the ranks start within 20 of them), then the rare rescans
    assert w.scans <= w._polls // launch.RESCAN_POLLS + 20, f"{w.scans} tree scans in {w._polls} polls"
