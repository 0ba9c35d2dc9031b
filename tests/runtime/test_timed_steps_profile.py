"""partitioner/runtime/schedule.py: with ``profile`` a timed step's time is the profile's own span
(runs, flush, closing barrier), so the profile's bookkeeping (reading the counters, building the
record) is not counted in the step time ``bench`` compares with ONNX Runtime's ``session.run``."""

from __future__ import annotations

import numpy as np

from partitioner.runtime.schedule import timed_steps


class _Exe:
    """A rank executable that doubles its input and counts its calls (``vm_s`` as the TVM one)."""

    def __init__(self) -> None:
        self.calls = 0
        self.vm_s = 0.0

    def run(self, feeds: dict[str, np.ndarray], comm: object) -> dict[str, np.ndarray]:
        self.calls += 1
        return {"y": 2 * feeds["x"]}


class _Comm:
    comm_s = 0.0

    def __init__(self) -> None:
        self.flushes = 0

    def flush(self) -> None:
        self.flushes += 1


def test_profiled_step_times_are_the_profile_spans() -> None:
    exe, comm, barriers = _Exe(), _Comm(), []
    x = np.arange(6, dtype=np.float32)
    outs, times = timed_steps(exe, [{"x": x}, {"x": x + 1}], comm, warmup=2, repeat=5,
                              barrier=lambda: barriers.append(1), profile=True)
    assert len(times.times) == len(times.profile) == 5
    assert times.times == tuple(p.step_s for p in times.profile)  # fails when the outer span is timed
    assert exe.calls == 2 * 7 and comm.flushes == 7 and len(barriers) == 2 * 7
    np.testing.assert_array_equal(outs[1]["y"], 2 * (x + 1))


def test_plain_steps_run_the_same_work() -> None:
    exe, comm, barriers = _Exe(), _Comm(), []
    x = np.ones(3, np.float32)
    outs, times = timed_steps(exe, [{"x": x}], comm, warmup=1, repeat=3, barrier=lambda: barriers.append(1))
    assert len(times.times) == 3 and not times.profile
    assert exe.calls == 4 and comm.flushes == 4 and len(barriers) == 2 * 4
    np.testing.assert_array_equal(outs[0]["y"], 2 * x)
