"""The median wall time of repeated calls, shared by the benchmark scripts that time whole runs.

``median_seconds(fn, warmup, repeat)``: ``warmup`` untimed calls, then the median of ``repeat``
timed ones (``time.perf_counter``). A median, not a minimum: these scripts compare engines run
the same way (gpu_check's ORT/PyTorch references, cost_accuracy's measured steps).
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable


def median_seconds(fn: Callable[[], Any], warmup: int, repeat: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)
