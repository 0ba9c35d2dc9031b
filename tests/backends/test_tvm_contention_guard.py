"""The contention guard (backends/tvm/contention.py): a 2-thread run whose calling thread keeps
yielding its core to the pool's worker drops that thread's pool to 1 thread.

The check forces the case the guard is for: after the pool has started, the test process pins
all its threads to one CPU, so the calling thread and the worker take turns on one core (each
parallel kernel: the calling thread yields until the worker's chunk is done). The model is a
chain of six 64x256 @ 256x256 MatMuls (8.4 MFLOP each, above ``threads.parallel_min_flops``, so
each is a parallel kernel): six involuntary switches a run without the guard. With the guard,
over one second of runs, fewer than a third take turns (those in a wake's grace after each
probe), and the result still matches ONNX Runtime
(rtol 1e-4, atol 1e-5, seeded inputs and weights). It runs in a subprocess: pinning and TVM's
pool are per process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Callable

import pytest
import tvm  # noqa: F401  (a broken install fails, never skips)

from backends.tvm import contention

ROOT = Path(__file__).resolve().parents[2]
SNIPPET = r"""
import json, os, statistics, sys, tempfile, time
from pathlib import Path
from typing import Callable
import numpy as np, onnx, onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper
from backends.tvm import contention
from backends.tvm.build import build
from backends.tvm.executable import _contention_guard, load
from partitioner.runtime.comm_local import LocalWorld

rng = np.random.default_rng(0)
nodes, inits, x = [], [], "x"
for i in range(6):
    inits.append(numpy_helper.from_array((rng.standard_normal((256, 256)) / 16).astype(np.float32), f"w{i}"))
    nodes.append(helper.make_node("MatMul", [x, f"w{i}"], [f"y{i}"]))
    x = f"y{i}"
g = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [64, 256])],
                      [helper.make_tensor_value_info(x, TensorProto.FLOAT, [64, 256])], inits)
m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
feeds = {"x": rng.standard_normal((64, 256)).astype(np.float32)}
so = ort.SessionOptions(); so.intra_op_num_threads = 1
ref = ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(None, feeds)[0]
out = Path(tempfile.mkdtemp()) / "chain.so"
build(m, out, options={"pipeline": "scheduled"})
ex = load(m, out, threads=2)
comm = LocalWorld(1).communicator(0)
ex.run(feeds, comm)  # the pool's worker exists from here
cpu = os.sched_getaffinity(0)
one = {min(cpu)}
for task in os.listdir("/proc/self/task"):
    os.sched_setaffinity(int(task), one)
switches, t_end = [], time.monotonic() + 1.0
while time.monotonic() < t_end or len(switches) < 40:
    s0 = contention.thread_usage()[0]
    got = ex.run(feeds, comm)[x]
    switches.append(contention.thread_usage()[0] - s0)
print(json.dumps({"switches": switches, "dropped": _contention_guard().dropped,
                  "match": bool(np.allclose(got, ref, rtol=1e-4, atol=1e-5)),
                  "err": float(np.max(np.abs(got - ref)))}))
"""


def _run() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TVM_NUM_THREADS"}
    env["PYTHONPATH"] = str(ROOT)
    out = subprocess.run([sys.executable, "-c", SNIPPET], capture_output=True, text=True, env=env,
                         timeout=300, check=True, cwd=ROOT)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_pool_taking_turns_on_one_core_drops_to_one_thread() -> None:
    got = _run()
    assert got["match"], got["err"]
    assert got["dropped"] >= 1
    # without the guard every run takes turns; with it only the wake graces do (30 ms after each
    # probe: about 150 ms of the second)
    turns = sum(n >= contention.CONTENTION_SWITCHES for n in got["switches"])
    assert turns < len(got["switches"]) / 3, got["switches"]


def _fake_clock(monkeypatch: pytest.MonkeyPatch) -> tuple[dict, Callable[[int, float], None]]:
    """The guard's clock and thread usage, faked: ``run(switches, cpu_ms)`` adds a run's switches
    and CPU, and its CPU time passes on the clock."""
    state = {"n": 0, "cpu": 0.0, "t": 100.0}
    monkeypatch.setattr(contention, "thread_usage", lambda: (state["n"], state["cpu"]))
    monkeypatch.setattr(contention.time, "monotonic", lambda: state["t"])

    def run(switches: int, cpu_ms: float) -> None:
        state["n"] += switches
        state["cpu"] += cpu_ms / 1e3
        state["t"] += cpu_ms / 1e3

    return state, run


def _guarded(g: contention.ContentionGuard, run: Callable[[int, float], None], switches: int,
             cpu_ms: float) -> None:
    start = g.before(2)
    run(switches, cpu_ms)
    g.after(start)


def _past_the_grace(g: contention.ContentionGuard, run: Callable[[int, float], None]) -> None:
    """Back-to-back quiet 1 ms runs until a wake's grace is over."""
    for _ in range(int(1e3 * contention.CONTENTION_GRACE_S) + 2):
        _guarded(g, run, 0, 1.0)


def test_guard_restores_the_requested_count_after_the_hold(monkeypatch: pytest.MonkeyPatch) -> None:
    """Unit rule: drop on a contended run, hold, probe with the requested count, back off."""
    monkeypatch.setattr(contention, "CONTENTION_GRACE_S", 0.0)  # the default
    calls: list[int] = []
    g = contention.ContentionGuard(calls.append)
    state, run = _fake_clock(monkeypatch)
    _past_the_grace(g, run)
    _guarded(g, run, contention.CONTENTION_SWITCHES, 0.5)  # turns taken: 4 switches in 0.5 ms of CPU
    assert calls == [1] and g.single
    assert g.events[-1]["switches"] == contention.CONTENTION_SWITCHES and g.events[-1]["idle_before_ms"] == 0
    state["t"] += contention.CONTENTION_HOLD_S / 2
    assert g.before(2) is None  # held on 1 thread, not watched
    state["t"] += contention.CONTENTION_HOLD_S
    _guarded(g, run, contention.CONTENTION_SWITCHES, 0.5)  # the probe, still contended
    assert calls == [1, 2, 1] and g.until == state["t"] + 2 * contention.CONTENTION_HOLD_S
    # preemption of a long run (resnet18 b8 on 1 thread at load ~4: ~1 switch per CPU-ms) is not
    # the pool taking turns
    g2 = contention.ContentionGuard(calls.append)
    _past_the_grace(g2, run)
    _guarded(g2, run, 40, 40.0)
    assert not g2.single


def test_a_wake_after_an_idle_pause_gets_its_grace(monkeypatch: pytest.MonkeyPatch) -> None:
    """Grace rule (off by default, ``CONTENTION_GRACE_S`` = 0): a run starting more than
    CONTENTION_WAKE_S after the last multi-thread run is a wake; with a grace, contended runs
    within it of the wake are not judged, and a probe after a hold is such a wake; with the grace
    0 the same run drops."""
    monkeypatch.setattr(contention, "CONTENTION_GRACE_S", 0.03)
    calls: list[int] = []
    g = contention.ContentionGuard(calls.append)
    state, run = _fake_clock(monkeypatch)
    _past_the_grace(g, run)
    state["t"] += 0.05  # an idle pause (per_device.py's settle)
    _guarded(g, run, 38, 2.5)  # the woken worker on the calling thread's core
    assert calls == [] and not g.single
    state["t"] += contention.CONTENTION_WAKE_S / 2  # a short gap is no new wake
    _guarded(g, run, 0, 1.0)
    assert g.grace_until < state["t"] + contention.CONTENTION_GRACE_S
    while state["t"] < g.grace_until:
        _guarded(g, run, 0, 1.0)
    _guarded(g, run, 38, 2.5)  # after the grace: judged
    assert calls == [1] and g.single
    state["t"] += 2 * contention.CONTENTION_HOLD_S
    start = g.before(2)  # the probe wakes the sleeping worker: a new grace
    assert calls == [1, 2] and start is not None and not start[3]
    run(38, 2.5)
    g.after(start)
    assert calls == [1, 2] and not g.single
    monkeypatch.setattr(contention, "CONTENTION_GRACE_S", 0.0)
    _past_the_grace(g, run)
    state["t"] += 0.05
    _guarded(g, run, 38, 2.5)
    assert calls == [1, 2, 1] and g.single
    assert g.events[-1]["idle_before_ms"] == pytest.approx(50.0)
