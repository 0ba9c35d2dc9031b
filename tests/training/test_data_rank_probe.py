"""``benchmarks/data_rank_probe.py``'s co-location arrangement (no model built: fake workers)."""

from __future__ import annotations

import threading
from tests.bench_scripts import load as load_script


def _probe():
    return load_script("data_rank_probe")


class _Worker:
    """A worker's pipe end: records the commands; a spinner answers only once ``stop`` is set."""

    def __init__(self, stop: threading.Event, rows: list) -> None:
        self.stop, self.rows, self.sent = stop, rows, []

    def send(self, msg) -> None:  # noqa: ANN001
        self.sent.append(msg)

    def recv(self):  # noqa: ANN201
        if self.sent[-1][0] == "spin":
            assert self.stop.is_set(), "the spinner was asked for its answer before being told to stop"
            return []
        return self.rows


def test_alone_runs_one_worker_while_the_other_spins_until_stopped() -> None:
    mod = _probe()
    stop = threading.Event()
    measured = _Worker(stop, [(0.2, 0.2, 0.21), (0.19, 0.19, 0.2)])
    spinner = _Worker(stop, [])
    rows, foreign = mod._measure([measured], "1 rank, batch 8", 2, False, spinner, stop)
    assert spinner.sent == [("spin", 0, False)]
    assert measured.sent == [("1 rank, batch 8", 2, False)]
    assert [r[:3] for r in rows] == measured.rows and all(r[3] == [] for r in rows)
    assert isinstance(foreign, float)


def test_together_runs_both_workers_and_no_spinner() -> None:
    mod = _probe()
    stop = threading.Event()
    a, b = _Worker(stop, [(0.2, 0.2, 0.2)]), _Worker(stop, [(0.3, 0.3, 0.3)])
    rows, _ = mod._measure([a, b], "1 rank, batch 16", 1, True)
    assert a.sent == b.sent == [("1 rank, batch 16", 1, True)]
    assert [r[0] for r in rows] == [0.2, 0.3]
    assert not stop.is_set()


def test_busy_seconds_grows_while_this_process_computes() -> None:
    mod = _probe()
    before = mod._busy_seconds()
    x = 0
    for i in range(3_000_000):
        x += i
    assert mod._busy_seconds() > before


def test_raise_priority_zero_changes_nothing() -> None:
    import os

    mod = _probe()
    nice = os.nice(0)
    mod.raise_priority(0)
    assert os.nice(0) == nice
