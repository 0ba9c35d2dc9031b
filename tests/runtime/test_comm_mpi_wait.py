"""Rule 9 of :mod:`partitioner.runtime.comm_mpi`: with ``BACKGROUND_SLEEP_WAIT`` on (off by
default: measured no better) a background thread's waits sleep-poll and never yield the core;
the main thread's waits, and every wait with the knob off, keep the spin / yield / sleep policy.

The clock is a fake that every poll and every sleep advances, so the policy is checked without
any timing: the fake request completes once 5 ms of fake time have passed."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest

from partitioner.runtime import comm_mpi


class _FakeTime:
    """``perf_counter`` and ``sleep`` over a fake clock; ``sleep`` records its argument."""

    def __init__(self) -> None:
        self.now = 0.0
        self.naps: list[float] = []

    def perf_counter(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.naps.append(s)
        self.now += s


class _Request:
    """An MPI request whose ``Test`` succeeds once ``done_at`` seconds of fake time have passed;
    every poll costs ``poll_s`` of fake time."""

    def __init__(self, clock: _FakeTime, done_at: float, poll_s: float = 2e-6) -> None:
        self.clock, self.done_at, self.poll_s = clock, clock.now + done_at, poll_s

    def Test(self, status=None) -> bool:  # noqa: N802 - mpi4py's name
        self.clock.now += self.poll_s
        return self.clock.now >= self.done_at


def _wait_counting(monkeypatch, background: bool) -> tuple[int, list[float]]:
    """Run one ``_wait`` on a request that completes after 5 ms, on a background thread or on the
    main thread; return the number of ``sched_yield`` calls and the sleeps."""
    clock = _FakeTime()
    yields = [0]
    monkeypatch.setattr(comm_mpi, "time", clock)
    monkeypatch.setattr(comm_mpi.os, "sched_yield", lambda: yields.__setitem__(0, yields[0] + 1))
    comm = comm_mpi.MPICommunicator.__new__(comm_mpi.MPICommunicator)  # _wait needs no MPI
    comm.timeout_s = 30.0
    errors: list[BaseException] = []

    def wait() -> None:
        try:
            comm._wait(_Request(clock, 5e-3), "test")
        except BaseException as e:  # noqa: BLE001 - re-raised on the test's thread
            errors.append(e)

    if background:
        t = threading.Thread(target=wait, name="allreduce_0")
        t.start()
        t.join()
    else:
        wait()
    if errors:
        raise errors[0]
    return yields[0], clock.naps


def test_background_wait_sleeps_and_never_yields(monkeypatch):
    monkeypatch.setattr(comm_mpi, "BACKGROUND_SLEEP_WAIT", True)
    yields, naps = _wait_counting(monkeypatch, background=True)
    assert yields == 0
    assert naps and all(0 < s <= 2e-4 for s in naps)


def test_main_thread_wait_keeps_spin_then_yield(monkeypatch):
    monkeypatch.setattr(comm_mpi, "BACKGROUND_SLEEP_WAIT", True)
    yields, naps = _wait_counting(monkeypatch, background=False)
    assert yields > 0
    assert naps == []  # done at 5 ms, inside the 10 ms yield window


def test_knob_off_gives_background_threads_the_main_policy(monkeypatch):  # the default
    monkeypatch.setattr(comm_mpi, "BACKGROUND_SLEEP_WAIT", False)
    yields, naps = _wait_counting(monkeypatch, background=True)
    assert yields > 0 and naps == []


def test_knob_reads_the_environment():
    code = "from partitioner.runtime import comm_mpi; print(comm_mpi.BACKGROUND_SLEEP_WAIT)"
    base = {k: v for k, v in os.environ.items() if k != comm_mpi.BACKGROUND_SLEEP_ENV}
    out = {v: subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                             env={**base, **({comm_mpi.BACKGROUND_SLEEP_ENV: v} if v else {})}).stdout.strip()
           for v in ("", "0", "1")}
    assert out == {"": "False", "0": "False", "1": "True"}


@pytest.mark.parametrize("background", [False, True])
def test_wait_times_out_on_either_thread(monkeypatch, background):
    clock = _FakeTime()
    monkeypatch.setattr(comm_mpi, "time", clock)
    monkeypatch.setattr(comm_mpi.os, "sched_yield", lambda: None)
    comm = comm_mpi.MPICommunicator.__new__(comm_mpi.MPICommunicator)
    comm.timeout_s = 0.05
    errors: list[BaseException] = []

    class _Never(_Request):
        def Cancel(self) -> None:  # noqa: N802
            pass

    def wait() -> None:
        try:
            comm._wait(_Never(clock, 1e9), "allreduce tag 7")
        except comm_mpi.RunFailed as e:
            errors.append(e)

    if background:
        t = threading.Thread(target=wait)
        t.start()
        t.join()
    else:
        wait()
    assert len(errors) == 1 and "timed out after 0.05 s" in str(errors[0])
