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

    .venv/bin/python benchmarks/data_rank_probe.py paired --backend onnxruntime [--steps 8]
    .venv/bin/python benchmarks/data_rank_probe.py paired --backend tvm --baseline MODULE.ATTR=VALUE

``--baseline`` (paired): the 1-rank global-batch step and the data rank's step, each also built
with the setting changed (the "before" of a change), all four stepped in the same rounds.
    .venv/bin/mpiexec -n 2 .venv/bin/python benchmarks/data_rank_probe.py mpi --backend tvm
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


def timed_step(r, batch: int, rng) -> tuple[float, float, float, list]:  # noqa: ANN001
    """One step: (process CPU, calling thread's CPU, wall, timeline as (kind, index, wall ms))."""
    x = rng.standard_normal((batch, 3, 64, 64)).astype(np.float32)
    y = rng.integers(0, 10, batch)
    c0, t0, w0 = time.process_time(), time.thread_time(), time.perf_counter()
    r.step({r.signature.data[0]: x}, y)
    c1, t1, w1 = time.process_time(), time.thread_time(), time.perf_counter()
    tl = [(k, i, (e - s) * 1e3) for k, i, s, e in getattr(r._exe, "timeline", [])]
    return c1 - c0, t1 - t0, w1 - w0, tl


def summary(rows: list) -> dict:
    """Medians (ms) of :func:`timed_step` rows."""
    med = lambda vals: round(1e3 * statistics.median(vals), 1)  # noqa: E731
    tl = [(k, i, round(statistics.median(r[3][j][2] for r in rows), 1)) for j, (k, i, _) in enumerate(rows[0][3])]
    return {"cpu_ms": med([r[0] for r in rows]), "thread_cpu_ms": med([r[1] for r in rows]),
            "wall_ms": med([r[2] for r in rows]), "timeline_wall_ms": tl}


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


def mpi(backend: str, steps: int) -> None:
    from mpi4py import MPI

    from partitioner.runtime.comm_mpi import MPICommunicator
    from partitioner.runtime.worker import pin_cores

    world = MPI.COMM_WORLD
    pin_cores(world.Get_rank(), world.Get_size())
    comm = MPICommunicator([list(range(world.Get_size()))])
    r = runner(backend, GLOBAL_BATCH // world.Get_size(), world.Get_size(), comm)
    rng = np.random.default_rng(world.Get_rank())
    rows = [timed_step(r, GLOBAL_BATCH // world.Get_size(), rng) for _ in range(steps + 2)][2:]
    s = summary(rows)
    s["comm_thread_cpu_ms"] = round(s["cpu_ms"] - s["thread_cpu_ms"], 1)
    comm.flush()
    print(json.dumps({"backend": backend, "case": f"data rank {world.Get_rank()} (MPI)", **s,
                      "load": os.getloadavg()[0]}), flush=True)
    world.Barrier()


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=("paired", "mpi"))
    p.add_argument("--backend", default="onnxruntime", choices=("onnxruntime", "tvm"))
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--baseline", action="append", default=[], metavar="MODULE.ATTR=VALUE",
                   help="paired: also build the 1-rank and data-rank cases with this setting (the before)")
    args = p.parse_args()
    if args.steps < 1:
        print("data_rank_probe: --steps must be at least 1", file=sys.stderr)
        return 2
    if args.mode == "paired":
        paired(args.backend, args.steps, args.baseline)
    else:
        mpi(args.backend, args.steps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
