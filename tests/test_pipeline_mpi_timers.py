"""``benchmarks/pipeline_mpi_timers.py``'s CPU replay of a 2-rank pipeline step (``cpu_replay``),
on hand-made call lists whose step is worked out by hand in each docstring."""

from __future__ import annotations

import pytest

from tests.bench_scripts import load

timers = load("pipeline_mpi_timers")


def _c(kind: str, cpu: float, before: float = 0.0) -> dict:
    return {"kind": kind, "cpu_s": cpu, "cpu_before_s": before}


def test_replay_follows_the_messages() -> None:
    """Stage 0: F 1, send, F 1, send, recv (measured 0.5: it polled), B 2, recv, B 2, the loss
    broadcast, 0.5 after it. The last stage: recv, FB 3, send, recv, FB 3, send, broadcast.
    Receives cost each rank's cheapest (0.1, 0). Last stage: FB(0) waits for F(0) at 1, ends 4;
    FB(1) 4-7. Stage 0: F F end 2, B(0) waits for 4 (+0.1), ends 6.1; B(1) waits for 7 (+0.1),
    ends 9.1; the broadcast from the last stage (7) is there, +0.1, then 0.5: 9.7. Busy: stage 0
    1 + 1 + 0.1 + 2 + 0.1 + 2 + 0.1 + 0.5 = 6.8, the last stage 0 + 3 + 0 + 3 = 6."""
    first = {"stage": 0, "per_call": [_c("F", 1), _c("send", 0), _c("F", 1), _c("send", 0), _c("recv", 0.5),
                                      _c("B", 2), _c("recv", 0.1), _c("B", 2), _c("broadcast", 0),
                                      _c("end", 0, 0.5)]}
    last = {"stage": 1, "per_call": [_c("recv", 0.1), _c("FB", 3), _c("send", 0), _c("recv", 0), _c("FB", 3),
                                     _c("send", 0), _c("broadcast", 0), _c("end", 0)]}
    step, busy = timers.cpu_replay([first, last])
    assert step == pytest.approx(9.7)
    assert busy == pytest.approx([6.8, 6.0])
    assert timers.cpu_replay([last, first])[0] == pytest.approx(9.7)  # rank order does not matter


def test_replay_refuses_unmatched_receives() -> None:
    """Both ranks receive first: no order runs it."""
    a = {"stage": 0, "per_call": [_c("recv", 0.1), _c("send", 0)]}
    b = {"stage": 1, "per_call": [_c("recv", 0.1), _c("send", 0)]}
    with pytest.raises(RuntimeError, match="unmatched"):
        timers.cpu_replay([a, b])
