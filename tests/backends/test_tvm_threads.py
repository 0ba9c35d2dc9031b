"""configure_threads can raise the thread count after a first, smaller one (a fresh process:
TVM's thread pool is process-wide). TVM sizes its pool once, when it is created: a pool first
configured for 1 thread stayed at 1 after asking for 2, so 2-thread figures equalled 1-thread
ones. ``runtime.NumThreads`` reports the workers a parallel loop uses."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import tvm  # noqa: F401  (a broken install fails, never skips)


ROOT = Path(__file__).resolve().parents[2]
SNIPPET = """
import tvm
from backends.tvm.executable import configure_threads
n = tvm.get_global_func("runtime.NumThreads")
seen = []
for t in (1, 2, 1, 2):
    configure_threads(t)
    seen.append(n())
print(*seen)
"""


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 usable cores: the pool is sized to them")
def test_thread_count_goes_up_and_down_in_one_process() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TVM_NUM_THREADS"}
    env["PYTHONPATH"] = str(ROOT)
    out = subprocess.run([sys.executable, "-c", SNIPPET], capture_output=True, text=True, env=env, timeout=120, check=True)
    assert out.stdout.split() == ["1", "2", "1", "2"]
