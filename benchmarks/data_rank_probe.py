"""Where a data-parallel rank's step goes against half of the 1-rank step (issue 16, the zoo
resnet-18 on 64x64 of ``benchmarks/train_step.py``, SGD, one thread).

``paired`` (one process, pinned to one core): the 1-rank step at the global batch, the 1-rank step
at the local batch and a data rank's step at the local batch over a communicator whose AllReduce
costs nothing (:class:`NoopComm`), stepped in turn (the order alternates each step); prints the
calling thread's median CPU per step and the data rank's timeline (segments, AllReduces: wall).
It separates (a) kernel efficiency at the local batch (local step against half the global one)
and (d) what the data rank's program adds beyond its AllReduce (its cut into segments).

``mpi`` (run under ``mpiexec -n 2``): one data rank on MPI as ``partitioner train`` builds it
(its bucket size, ranks pinned), stepped ``--steps`` times; prints the process CPU per step, the
main thread's, their difference (the comm thread: the AllReduce's copies and polling, overlap
rule 2) and the timeline. On a loaded machine compare CPU, not wall, and only within one run.

``colocate`` (two worker processes, one per core, no MPI): the 1-rank step at batch 8, 16 and 32
and the no-op data rank at batch 8, each run by one worker alone (the other worker spinning from
registers: its core busy, its caches and memory quiet) and by both at once, interleaved rounds;
prints per case the median CPU and wall per step alone and together and their ratio: the cost
of co-location (two busy cores sharing the L3 and the memory bandwidth) apart from any
communication, and the per-image cost at 8 against 32. A measurement during which other
processes used over ``--max-foreign`` of the cores is dropped. ``--nice -20`` (root; ``colocate``
and ``mpi``) raises the processes' niceness and their autogroup's, so that on a loaded machine
other sessions take little of the cores they run on (the kernel shares cores between sessions
by autogroup): the nearest to a quiet machine a loaded one gives.

    .venv/bin/python benchmarks/data_rank_probe.py paired --backend onnxruntime [--steps 8]
    .venv/bin/mpiexec -n 2 .venv/bin/python benchmarks/data_rank_probe.py mpi --backend tvm [--nice -20]
    .venv/bin/python benchmarks/data_rank_probe.py colocate --steps 3 --rounds 6 --give-up 0 --nice -20
    .venv/bin/python benchmarks/data_rank_probe.py paired --backend tvm --baseline MODULE.ATTR=VALUE

``--baseline`` (mpi): a setting read at run time (``comm_mpi.SHM_OWN_PART_FROM_INPUT``) applied on
every other step of the same two ranks, printed as a second row: a before/after paired step by
step under MPI.

``--baseline`` (paired): the 1-rank global-batch step and the data rank's step, each also built
with the setting changed (the "before" of a change), all four stepped in the same rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
GLOBAL_BATCH = 16


class NoopComm:
    """Rank 0 of 2 whose AllReduce returns its inputs (in place, or as fresh copies like MPI's)."""

    rank, world_size = 0, 2

    def allreduce_list(self, xs, group, reduction, tag, out=None):  # noqa: ANN001, ANN201
        return list(out) if out is not None else [np.array(x) for x in xs]

    def allreduce(self, x, group, reduction, tag):  # noqa: ANN001, ANN201
        return np.array(x)


def runner(backend: str, batch: int, world: int, comm=None):  # noqa: ANN001, ANN201
    import models_zoo
    from partitioner.load import load_proto
    from partitioner.training.loop import bucket_bytes
    from partitioner.training.optimizers import make_optimizer
    from partitioner.training.runner import StepRunner
    from partitioner.training.step import build_training_graph

    model = load_proto(models_zoo.build("resnet", batch=GLOBAL_BATCH, image=64, classes=10), batch=GLOBAL_BATCH)
    step = build_training_graph(model, loss="cross_entropy", optimizer=make_optimizer("sgd", 1e-3, 0.0), batch=batch,
                                world_size=world, bucket_bytes=bucket_bytes(backend, 1))
    return StepRunner(step, backend=backend, comm=comm, workdir=tempfile.mkdtemp(prefix="data-rank-probe-"))


def timed_step(r, batch: int, rng) -> tuple[float, float, float, list, int]:  # noqa: ANN001
    """One step: (process CPU, calling thread's CPU, wall, timeline as (kind, index, wall ms),
    the process's minor page faults)."""
    import resource

    x = rng.standard_normal((batch, 3, 64, 64)).astype(np.float32)
    y = rng.integers(0, 10, batch)
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    c0, t0, w0 = time.process_time(), time.thread_time(), time.perf_counter()
    r.step({r.signature.data[0]: x}, y)
    c1, t1, w1 = time.process_time(), time.thread_time(), time.perf_counter()
    tl = [(k, i, (e - s) * 1e3) for k, i, s, e in getattr(r._exe, "timeline", [])]
    return c1 - c0, t1 - t0, w1 - w0, tl, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0


def summary(rows: list) -> dict:
    """Medians (ms) of :func:`timed_step` rows."""
    med = lambda vals: round(1e3 * statistics.median(vals), 1)  # noqa: E731
    tl = [(k, i, round(statistics.median(r[3][j][2] for r in rows), 1)) for j, (k, i, _) in enumerate(rows[0][3])]
    return {"cpu_ms": med([r[0] for r in rows]), "thread_cpu_ms": med([r[1] for r in rows]),
            "wall_ms": med([r[2] for r in rows]), "timeline_wall_ms": tl,
            # colocate's worker rows carry no fault count (session 22: its summary raised IndexError)
            "minor_faults": int(statistics.median(r[4] for r in rows)) if len(rows[0]) > 4 else None}


def paired(backend: str, steps: int, baseline: list[str]) -> None:
    os.sched_setaffinity(0, [sorted(os.sched_getaffinity(0))[-1]])
    local = GLOBAL_BATCH // 2
    cases = {f"1 rank, batch {GLOBAL_BATCH}": (runner(backend, GLOBAL_BATCH, 1), GLOBAL_BATCH),
             f"data rank, batch {local}, no-op AllReduce": (runner(backend, local, 2, NoopComm()), local)}
    if not baseline:
        cases[f"1 rank, batch {local}"] = (runner(backend, local, 1), local)
    else:  # the same two cases built with the settings changed, stepped in the same rounds
        from kernel_profile import with_settings

        with with_settings(baseline):
            cases.update({f"{name} [{' '.join(baseline)}]": (runner(backend, batch, 2 if "data" in name else 1,
                                                                    NoopComm() if "data" in name else None), batch)
                          for name, (_, batch) in list(cases.items())})
    rows: dict[str, list] = {k: [] for k in cases}
    rng = np.random.default_rng(0)
    for k in range(steps + 1):  # step 0 warms up
        for name in (list(cases) if k % 2 == 0 else list(cases)[::-1]):
            row = timed_step(*cases[name], rng)
            if k:
                rows[name].append(row)
    for name, r in rows.items():
        print(json.dumps({"backend": backend, "case": name, **summary(r), "load": os.getloadavg()[0]}))


def mpi(backend: str, steps: int, nice: int = 0, baseline: list[str] | None = None) -> None:
    from mpi4py import MPI

    from partitioner.runtime.comm_mpi import MPICommunicator
    from partitioner.runtime.worker import pin_cores

    world = MPI.COMM_WORLD
    pin_cores(world.Get_rank(), world.Get_size())
    raise_priority(nice)
    comm = MPICommunicator([list(range(world.Get_size()))])
    r = runner(backend, GLOBAL_BATCH // world.Get_size(), world.Get_size(), comm)
    rng = np.random.default_rng(world.Get_rank())
    if baseline:  # a setting read at run time, flipped every other step on every rank alike
        from kernel_profile import with_settings

        rows: dict[str, list] = {"": [], f" [{' '.join(baseline)}]": []}
        for k in range(2 * steps + 2):
            with with_settings(baseline if k % 2 else []):
                row = timed_step(r, GLOBAL_BATCH // world.Get_size(), rng)
            if k >= 2:
                rows[list(rows)[k % 2]].append(row)
    else:
        rows = {"": [timed_step(r, GLOBAL_BATCH // world.Get_size(), rng) for _ in range(steps + 2)][2:]}
    comm.flush()
    for label, case_rows in rows.items():
        s = summary(case_rows)
        s["comm_thread_cpu_ms"] = round(s["cpu_ms"] - s["thread_cpu_ms"], 1)
        print(json.dumps({"backend": backend, "case": f"data rank {world.Get_rank()} (MPI){label}", **s,
                          "load": os.getloadavg()[0]}), flush=True)
    world.Barrier()


COLOCATE_CASES = ("1 rank, batch 8", "1 rank, batch 16", "1 rank, batch 32", "data rank, batch 8, no-op AllReduce")


def raise_priority(nice: int) -> None:
    """``nice`` < 0 (root only): this process's niceness and its autogroup's (the kernel shares a
    core between sessions by autogroup, so a niceness alone does not win it from other users'
    sessions): other users' processes then take little of its core. 0: nothing."""
    if not nice:
        return
    os.nice(nice)
    try:
        Path("/proc/self/autogroup").write_text(str(nice))
    except OSError:
        pass


def _colocate_worker(core: int, conn, barrier, backend: str, nice: int, stop=None) -> None:  # noqa: ANN001
    """One process pinned to ``core``: builds every case of :data:`COLOCATE_CASES` once, then runs
    ``(case, steps)`` commands from ``conn`` (after ``barrier`` when both processes run), answering
    the :func:`timed_step` rows (CPU and wall per step, no timeline). ``nice`` < 0 (root only)
    raises its scheduling weight so that other users' processes take little of its core."""
    os.sched_setaffinity(0, [core])
    raise_priority(nice)
    runners = {name: (runner(backend, b, 2 if "data" in name else 1, NoopComm() if "data" in name else None), b)
               for name, b in zip(COLOCATE_CASES, (8, 16, 32, 8))}
    rng = np.random.default_rng(core)
    for r, b in runners.values():  # warm up
        timed_step(r, b, rng)
    conn.send("ready")
    while (msg := conn.recv()) is not None:
        name, steps, together = msg
        if name == "spin":  # keep this core busy from registers until told to stop (the "alone" case)
            x, n = 1.0, 0
            while n % 4096 or not stop.is_set():
                x, n = x * 1.0000001 + 1e-9, n + 1
            stop.clear()
            conn.send([])
            continue
        if together:
            barrier.wait()
        conn.send([timed_step(*runners[name], rng)[:3] for _ in range(steps)])


def _busy_seconds() -> float:
    """Seconds all cores have been busy since boot (``/proc/stat``: user, nice, system, irq, softirq)."""
    f = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (f[0] + f[1] + f[2] + f[5] + f[6]) / os.sysconf("SC_CLK_TCK")


def wait_quiet(max_foreign: float, give_up_s: float) -> float:
    """Wait (up to ``give_up_s``) for a 1-s sample in which the machine's cores are busy under
    ``max_foreign`` of the time (our workers idle); returns the last sample's busy fraction."""
    end, frac = time.monotonic() + give_up_s, 1.0
    while time.monotonic() < end:
        b0, w0 = _busy_seconds(), time.perf_counter()
        time.sleep(1.0)
        frac = (_busy_seconds() - b0) / ((time.perf_counter() - w0) * len(os.sched_getaffinity(0)))
        if frac < max_foreign:
            break
    return frac


def _measure(pipes: list, name: str, steps: int, together: bool, spinner=None, stop=None) -> tuple[list, float]:
    """One arrangement: rows of each process and the foreign CPU fraction meanwhile (busy time of
    the cores minus our processes' CPU, over wall x cores); ``spinner``: the other worker's pipe,
    which spins from registers meanwhile (its core busy, its caches and memory quiet)."""
    b0, w0 = _busy_seconds(), time.perf_counter()
    if spinner is not None:
        spinner.send(("spin", 0, False))
    for c in pipes:
        c.send((name, steps, together))
    rows = [tuple(r) + ([],) for c in pipes for r in c.recv()]
    wall = time.perf_counter() - w0
    ours = sum(r[0] for r in rows)
    if spinner is not None:
        stop.set()
        spinner.recv()
        ours += wall  # the spinner's core
    foreign = (_busy_seconds() - b0 - ours) / (wall * len(os.sched_getaffinity(0)))
    return rows, foreign


def colocate(backend: str, steps: int, rounds: int, max_foreign: float, give_up_s: float, nice: int = 0) -> None:
    """Each case of :data:`COLOCATE_CASES` run by one process alone (the other spinning) and by two
    independent processes at once, one per core, no communication: rounds interleave the cases and
    alone/together, each measured after :func:`wait_quiet`; a measurement during which other
    processes used over ``max_foreign`` of the cores is dropped (counted). Prints per case the
    median CPU and wall per step of each arrangement and their ratio (the co-location cost of two
    busy cores), with the load average."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    barrier, stop = ctx.Barrier(2), ctx.Event()
    pipes = []
    for core in sorted(os.sched_getaffinity(0))[:2]:
        a, b = ctx.Pipe()
        ctx.Process(target=_colocate_worker, args=(core, b, barrier, backend, nice, stop), daemon=True).start()
        pipes.append(a)
    assert all(c.recv() == "ready" for c in pipes)
    rows: dict[tuple, list] = {}
    dropped: dict[tuple, int] = {}
    for k in range(rounds):
        for name in COLOCATE_CASES:
            for together in ((False, True) if k % 2 == 0 else (True, False)):
                wait_quiet(max_foreign, give_up_s)
                got, foreign = _measure(pipes if together else [pipes[k % 2]], name, steps, together,
                                        None if together else pipes[1 - k % 2], stop)
                print(json.dumps({"case": name, "together": together, "foreign": round(foreign, 3),
                                  "cpu_ms": [round(1e3 * r[0], 1) for r in got],
                                  "wall_ms": [round(1e3 * r[2], 1) for r in got]}), file=sys.stderr, flush=True)
                if foreign <= max_foreign:
                    rows.setdefault((name, together), []).extend(got)
                else:
                    dropped[(name, together)] = dropped.get((name, together), 0) + 1
    for c in pipes:
        c.send(None)
    for name in COLOCATE_CASES:
        if not rows.get((name, False)) or not rows.get((name, True)):
            print(json.dumps({"backend": backend, "case": name, "error": "no quiet measurement"}), flush=True)
            continue
        alone, both = summary(rows[(name, False)]), summary(rows[(name, True)])
        print(json.dumps({"backend": backend, "case": name, "alone_cpu_ms": alone["cpu_ms"],
                          "alone_wall_ms": alone["wall_ms"], "together_cpu_ms": both["cpu_ms"],
                          "together_wall_ms": both["wall_ms"],
                          "cpu_ratio": round(both["cpu_ms"] / alone["cpu_ms"], 3),
                          "wall_ratio": round(both["wall_ms"] / alone["wall_ms"], 3),
                          "steps_alone": len(rows[(name, False)]), "steps_together": len(rows[(name, True)]),
                          "dropped": [dropped.get((name, t), 0) for t in (False, True)],
                          "load": os.getloadavg()[0]}), flush=True)

def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=("paired", "mpi", "colocate"))
    p.add_argument("--backend", default="onnxruntime", choices=("onnxruntime", "tvm"))
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--rounds", type=int, default=4, help="colocate: interleaved rounds")
    p.add_argument("--max-foreign", type=float, default=0.1,
                   help="colocate: drop a measurement while others use more than this share of the cores")
    p.add_argument("--nice", type=int, default=0, help="colocate, mpi: the processes' niceness and their autogroup's (root: -20)")
    p.add_argument("--give-up", type=float, default=60.0, help="colocate: seconds to wait for a quiet moment")
    p.add_argument("--baseline", action="append", default=[], metavar="MODULE.ATTR=VALUE",
                   help="paired: also build the 1-rank and data-rank cases with this setting (the before); "
                        "mpi: flip this setting (one read at run time) every other step, both rows printed")
    args = p.parse_args()
    if args.steps < 1:
        print("data_rank_probe: --steps must be at least 1", file=sys.stderr)
        return 2
    if args.mode == "colocate":
        colocate(args.backend, args.steps, args.rounds, args.max_foreign, args.give_up, args.nice)
    elif args.mode == "paired":
        paired(args.backend, args.steps, args.baseline)
    else:
        mpi(args.backend, args.steps, args.nice, args.baseline)
    return 0


if __name__ == "__main__":
    sys.exit(main())
