"""2-thread runs after the process was idle: what the contention guard sees and what it costs.

    python benchmarks/idle_wake.py [--models mobilenet,resnet18] [--batches 8,1] [--runs 30]
                                   [--gaps 0,0.002,0.05] [--burst 1] [--graces 0.03]
                                   [--bind 0,1] [--awake 0,1] [--json FILE]

Why (session 20, AMD EPYC Zen 4, 2 cores, nothing else running): in three ``per_device.py`` runs
of the same code the 2-thread rows over ONNX Runtime's time changed from run to run. In the third
run (the first with each block's load recorded) the contention guard
(``backends/tvm/contention.py``) dropped to one thread in 8 of the 2-thread rows, and in 7 of them
one TVM block (the first, in 6) ran at about one CPU second per wall second: on one thread; no row
without a drop had such a block. ``per_device.py`` pauses 50 ms
(``SETTLE_S``) before each block, so the pool's workers are asleep when the block's first run
wakes them.

What it measures. Each model's default build for 2 threads (``per_device.py``'s sizes), run
``--burst`` times back to back after each of ``--runs`` pauses of ``--gaps`` seconds (0: no
pause), in one process, once per value of the guard's wake grace in ``--graces``
(``CONTENTION_GRACE_S``; 0: none): per gap and grace, the median run time, how often the guard
dropped to one thread (and each drop's record, ``drop_events``), and the calling thread's
involuntary context switches in each run the guard judged (its signal; the pool taking turns on
one core shows one switch per parallel kernel) and in each run of a wake's grace. Each
``TVM_BIND_THREADS`` value of ``--bind`` (1: TVM pins its workers to cores; the default here is 0,
``backends/tvm/executable.py``) runs in a process of its own, since TVM reads it when its pool
starts.
``--awake 0,1`` (session 22) alternates two kinds of pause run by run in one process: 0 sleeps
(both vCPUs idle, as ``per_device.py``'s pause leaves them), 1 keeps both vCPUs busy through the
pause (the calling thread busy-waits and a spinner process spins, stopped just before the run):
if the runs after an awake pause are as fast as back-to-back runs, the slow first runs after a
pause come from waking an idle vCPU (the hypervisor), not from the pool's own sleep.
The guard and everything else are as a user's process has them. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def _spinner(flag: Any, go: Any, ready: Any) -> None:
    """``--awake``'s spinner process: spins while ``flag`` is 1 after each ``go``; 2 ends it."""
    ready.set()
    while True:
        go.wait()
        go.clear()
        if flag.value == 2:
            return
        while flag.value == 1:
            pass


class _Pause:
    """A pause of ``gap`` seconds: asleep (``awake`` 0) or with both vCPUs kept busy (1)."""

    def __init__(self, need_awake: bool) -> None:
        self.proc = None
        if need_awake:
            import multiprocessing as mp

            ctx = mp.get_context("spawn")
            self.flag, self.go, ready = ctx.Value("i", 0, lock=False), ctx.Event(), ctx.Event()
            self.proc = ctx.Process(target=_spinner, args=(self.flag, self.go, ready), daemon=True)
            self.proc.start()
            if not ready.wait(60):  # the spawned interpreter has started: the first pause is awake too
                raise RuntimeError("idle_wake: the spinner process did not start within 60 s")

    def __call__(self, gap: float, awake: int) -> None:
        if not gap:
            return
        if not awake:
            time.sleep(gap)
            return
        self.flag.value = 1
        self.go.set()
        end = time.perf_counter() + gap
        while time.perf_counter() < end:
            pass
        self.flag.value = 0

    def close(self) -> None:
        if self.proc is not None:
            self.flag.value = 2
            self.go.set()
            self.proc.join(5)


def measure(key: str, batch: int, runs: int, gaps: list[float], burst: int = 1,
            graces: tuple[float, ...] = (0.03,), awake: tuple[int, ...] = (0,)) -> list[dict[str, Any]]:
    """One model's rows in this process (see the module docstring)."""
    from backends.tvm import contention as C
    from backends.tvm.executable import _contention_guard, configure_threads
    from benchmarks import per_device as pd
    from partitioner.runtime.comm_local import LocalWorld

    m, _info = pd.model_for(key, batch, {})
    feeds = pd._feeds(m)
    with tempfile.TemporaryDirectory() as work:
        exes, _ = pd._tvm_builds(m, f"{key}_b{batch}", {"scheduled": {"pipeline": "scheduled"}},
                                 pd.build_threads_for(2), Path(work))
        ex, comm = exes["scheduled"], LocalWorld(1).communicator(0)
        configure_threads(2)
        guard = _contention_guard()
        for _ in range(20):
            ex.run(feeds, comm)
        watched: list[tuple[int, float, bool]] = []
        plain_after = guard.after

        def after(start: Any) -> None:
            if start is not None:
                sw, cpu = C.thread_usage()
                watched.append((sw - start[0], round(1e3 * (cpu - start[1]), 3), bool(start[3])))
            plain_after(start)

        guard.after = after  # type: ignore[method-assign]
        rows = []
        pause = _Pause(any(awake))
        try:
            for gap in gaps:
                for grace in graces:
                    C.CONTENTION_GRACE_S = grace
                    time.sleep(1.2)  # past the guard's longest hold: each gap starts on 2 threads
                    rows += _pauses_and_runs(key, batch, runs, gap, grace, burst, awake, guard, watched,
                                             lambda: ex.run(feeds, comm), pause)
        finally:
            pause.close()
    return rows


def _pauses_and_runs(key: str, batch: int, runs: int, gap: float, grace: float, burst: int,
                     awake: tuple[int, ...], guard: Any, watched: list, run: Any, pause: Any) -> list[dict]:
    """``runs`` pauses of ``gap`` (their kinds taking turns through ``awake``), each followed by
    ``burst`` runs; one row per kind of pause."""
    watched.clear()
    times: dict[int, list[float]] = {a: [] for a in awake}
    drops: dict[int, list[Any]] = {a: [] for a in awake}
    kinds: list[int] = []
    for i in range(runs):
        kind = awake[i % len(awake)]
        pause(gap, kind)
        for _ in range(burst):
            d0 = guard.dropped
            t0 = time.perf_counter()
            run()
            times[kind].append(1e3 * (time.perf_counter() - t0))
            kinds.append(kind)
            drops[kind] += guard.events[len(guard.events) - (guard.dropped - d0):]  # the last EVENTS_KEPT
    rows = []
    for a in awake:
        mine = [w for w, k in zip(watched, kinds) if k == a]
        judged = [(n, c) for n, c, j in mine if j]
        rows.append({"model": key, "batch": batch, "gap_s": gap, "grace_s": grace, "awake": a,
                     "runs": len(times[a]) // burst, "burst": burst,
                     "ms_per_run": [round(t, 3) for t in times[a]],
                     "median_ms": round(statistics.median(times[a]), 3),
                     "guard_drops": len(drops[a]), "drop_events": drops[a],
                     "judged_runs": len(judged), "switches_per_judged_run": [n for n, _ in judged],
                     "cpu_ms_per_judged_run": [c for _, c in judged],
                     "switches_per_grace_run": [n for n, _, j in mine if not j]})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="mobilenet,resnet18")
    ap.add_argument("--batches", default="8,1")
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--gaps", default="0,0.002,0.05", help="pauses before each run, seconds")
    ap.add_argument("--bind", default="0,1", help="TVM_BIND_THREADS values, one process each")
    ap.add_argument("--burst", type=int, default=1, help="runs back to back after each pause")
    ap.add_argument("--graces", default="0.03",
                    help="the guard's CONTENTION_GRACE_S values, in turn in one process (0: no grace)")
    ap.add_argument("--awake", default="0",
                    help="kinds of pause, taking turns run by run: 0 asleep, 1 both vCPUs kept busy")
    ap.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "idle_wake.json"))
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)  # MODEL:BATCH, one process's rows
    args = ap.parse_args(argv)
    gaps = [float(g) for g in args.gaps.split(",")]
    if args.child:
        key, batch = args.child.split(":")
        graces = tuple(float(g) for g in args.graces.split(","))
        awake = tuple(int(a) for a in args.awake.split(","))
        print(json.dumps(measure(key, int(batch), args.runs, gaps, max(1, args.burst), graces, awake)))
        return 0
    from benchmarks.per_device import machine

    rows = []
    for key in [k for k in args.models.split(",") if k]:
        for batch in [int(b) for b in args.batches.split(",")]:
            for bind in args.bind.split(","):
                env = {**os.environ, "TVM_BIND_THREADS": bind, "PYTHONPATH": str(ROOT)}
                cmd = [sys.executable, __file__, "--child", f"{key}:{batch}", "--runs", str(args.runs),
                       "--gaps", args.gaps, "--burst", str(args.burst), "--graces", args.graces,
                       "--awake", args.awake]
                proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT, timeout=1800)
                if proc.returncode != 0:
                    raise SystemExit(f"idle_wake: {key} b{batch}: {proc.stderr.strip().splitlines()[-1:]}")
                for row in json.loads(proc.stdout.strip().splitlines()[-1]):
                    row["tvm_bind_threads"] = int(bind)
                    rows.append(row)
                    print(f"{key} b{batch} bind={bind} gap {row['gap_s']:g} s grace {row['grace_s']:g} s "
                          f"awake {row['awake']}: "
                          f"{row['median_ms']:.2f} ms, "
                          f"{row['guard_drops']} drops, switches {row['switches_per_judged_run'][:10]}",
                          file=sys.stderr, flush=True)
    Path(args.json).write_text(json.dumps({"machine": machine(), "load_before": os.getloadavg(),
                                           "rows": rows}, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
