"""The contention guard (backends/tvm/contention.py): a 2-thread run whose calling thread keeps
yielding its core to the pool's worker drops that thread's pool to 1 thread.

The check forces the case the guard is for: after the pool has started, the test process pins
all its threads to one CPU, so the calling thread and the worker take turns on one core (each
parallel kernel: the calling thread yields until the worker's chunk is done). The model is a
chain of six 64x256 @ 256x256 MatMuls (8.4 MFLOP each, above ``threads.parallel_min_flops``, so
each is a parallel kernel): six involuntary switches a run without the guard. With the guard the
later runs have at most one (the probes aside), and the result still matches ONNX Runtime
(rtol 1e-4, atol 1e-5, seeded inputs and weights). It runs in a subprocess: pinning and TVM's
pool are per process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import tvm  # noqa: F401  (a broken install fails, never skips)

from backends.tvm import contention

ROOT = Path(__file__).resolve().parents[2]
SNIPPET = r"""
import json, os, statistics, sys, tempfile
from pathlib import Path
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
switches = []
for _ in range(40):
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
    late = sorted(got["switches"][-16:])
    assert late[len(late) // 2] <= 1, got["switches"]  # median of the last 16 runs: no turn-taking


def test_guard_restores_the_requested_count_after_the_hold(monkeypatch: pytest.MonkeyPatch) -> None:
    """Unit rule: drop on a contended run, hold, probe with the requested count, back off."""
    calls: list[int] = []
    g = contention.ContentionGuard(calls.append)
    state = {"n": 0, "cpu": 0.0, "t": 100.0}
    monkeypatch.setattr(contention, "thread_usage", lambda: (state["n"], state["cpu"]))
    monkeypatch.setattr(contention.time, "monotonic", lambda: state["t"])

    def run(switches: int, cpu_ms: float) -> None:
        state["n"] += switches
        state["cpu"] += cpu_ms / 1e3

    start = g.before(2)
    run(contention.CONTENTION_SWITCHES, 0.5)  # turns taken: 4 switches in 0.5 ms of CPU
    g.after(start)
    assert calls == [1] and g.single
    state["t"] += contention.CONTENTION_HOLD_S / 2
    assert g.before(2) is None  # held on 1 thread, not watched
    state["t"] += contention.CONTENTION_HOLD_S
    start = g.before(2)  # the probe
    assert calls == [1, 2] and start is not None
    run(contention.CONTENTION_SWITCHES, 0.5)  # still contended: hold twice as long
    g.after(start)
    assert calls == [1, 2, 1] and g.until == state["t"] + 2 * contention.CONTENTION_HOLD_S
    # preemption of a long run (resnet18 b8 on 1 thread at load ~4: ~1 switch per CPU-ms) is not
    # the pool taking turns
    g2 = contention.ContentionGuard(calls.append)
    start = g2.before(2)
    run(40, 40.0)
    g2.after(start)
    assert not g2.single
