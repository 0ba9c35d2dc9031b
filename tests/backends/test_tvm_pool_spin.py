"""The pool's idle spin (backends/tvm/schedules/threads.py): ``configure_threads`` bounds how long
TVM's idle workers busy-wait, unless the user chose a spin count.

With TVM's default (300000 yields) a worker burnt ~100 ms of CPU in the 0.3 s after one parallel
call on the development machine; bounded, it burns a few ms and then sleeps. The check is on CPU
time the process spends while its main thread sleeps, in a fresh process (the pool is
process-wide and reads the spin count once): a bound of 40 ms is 8x what the bounded pool burns
and well under what TVM's default burns when the worker gets a core.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import tvm  # noqa: F401  (a broken install fails, never skips)

from backends.tvm.schedules import threads

ROOT = Path(__file__).resolve().parents[2]
SNIPPET = """
import json, os, time
import numpy as np
import tvm
from backends.tvm.executable import configure_threads
from backends.tvm.peak import _fork_join_func, _target
configure_threads(2)
fn = tvm.compile(tvm.IRModule({"probe": _fork_join_func(True)}), target=_target(None))["probe"]
a = tvm.runtime.tensor(np.zeros((64, 16), "float32"))
burnt = []
for _ in range(3):
    fn(a)
    c0 = time.process_time()
    time.sleep(0.3)
    burnt.append(time.process_time() - c0)
print(json.dumps({"spin": os.environ.get("TVM_THREAD_POOL_SPIN_COUNT"), "burnt_s": min(burnt),
                  "ok": float(a.numpy()[0, 0]) == 3.0}))
"""


def _run(env_spin: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("TVM_NUM_THREADS", threads.SPIN_ENV)}
    env["PYTHONPATH"] = str(ROOT)
    if env_spin is not None:
        env[threads.SPIN_ENV] = env_spin
    out = subprocess.run([sys.executable, "-c", SNIPPET], capture_output=True, text=True, env=env,
                         timeout=120, check=True, cwd=ROOT)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 usable cores: one core has no idle worker")
def test_idle_workers_stop_spinning() -> None:
    got = _run(None)
    assert got["ok"]  # the parallel probe ran (3 calls, +1 each)
    assert got["spin"] == str(threads.POOL_SPIN_COUNT)
    assert got["burnt_s"] < 0.04


def test_user_spin_count_is_kept() -> None:
    assert _run("1234")["spin"] == "1234"
