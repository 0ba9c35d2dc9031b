"""``benchmarks/idle_wake.py --awake``: two kinds of pause taking turns run by run in one process,
one row per kind, and the awake pause really keeps a second process spinning through it."""

from __future__ import annotations

import os
import time

import pytest

from benchmarks import idle_wake


class _Guard:
    def __init__(self) -> None:
        self.dropped, self.events = 0, []


def test_kinds_of_pause_take_turns_and_get_a_row_each() -> None:
    """Runs alternate asleep/awake (``awake`` (0, 1)); each row holds its own kind's runs only
    (here each run takes as long as its kind number says) and the guard's per-run records."""
    calls: list[tuple[float, int]] = []
    watched: list = []
    current = {"kind": 0}

    def pause(gap: float, kind: int) -> None:
        calls.append((gap, kind))
        current["kind"] = kind

    guard = _Guard()

    def run() -> None:
        time.sleep(0.002 + 0.01 * current["kind"])
        watched.append((current["kind"] * 3, 1.0, True))
        if current["kind"]:  # every awake run drops (the guard keeps its last events only)
            guard.dropped += 1
            guard.events = (guard.events + [{"n": guard.dropped}])[-2:]

    rows = idle_wake._pauses_and_runs("m", 1, 6, 0.05, 0.0, 2, (0, 1), guard, watched, run, pause)
    assert calls == [(0.05, 0), (0.05, 1)] * 3
    assert [r["awake"] for r in rows] == [0, 1] and [r["runs"] for r in rows] == [3, 3]
    assert all(len(r["ms_per_run"]) == 6 for r in rows)  # 3 pauses x burst 2
    assert rows[0]["median_ms"] < 10 < rows[1]["median_ms"]
    assert rows[0]["switches_per_judged_run"] == [0] * 6 and rows[1]["switches_per_judged_run"] == [3] * 6
    assert rows[0]["guard_drops"] == 0 and rows[1]["guard_drops"] == 6
    assert [e["n"] for e in rows[1]["drop_events"]] == [1, 2, 3, 4, 5, 6]


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs 2 CPUs: the spinner spins on the other one")
def test_an_awake_pause_keeps_a_spinner_busy_and_a_sleeping_one_does_not() -> None:
    """``_Pause``: through an awake pause the spinner process burns CPU (its /proc CPU time grows
    by a good share of the pause); through an asleep pause it stays asleep."""
    pause = idle_wake._Pause(True)
    try:
        pid = pause.proc.pid  # started: _Pause waits for the spawned interpreter to be ready
        time.sleep(0.2)  # its start-up's last CPU is not counted below

        def cpu_s() -> float:
            fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

        c0 = cpu_s()
        pause(0.5, 0)
        asleep = cpu_s() - c0
        c0 = cpu_s()
        pause(0.5, 1)
        awake = cpu_s() - c0
        assert asleep < 0.05, asleep
        assert awake > 0.1, awake  # a fifth of the pause at least, even with both cores loaded
    finally:
        pause.close()
    assert not pause.proc.is_alive()
