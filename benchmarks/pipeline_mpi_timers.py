"""Where a 2-rank MPI pipeline step's time goes, per rank: program calls, receive waits, the rest.

``benchmarks/pipeline_schedule.py`` replays the step from each stage's calls timed alone with free
messages; this runs the real thing: the train_step.py model's 2-stage 1F1B x8 plan on two MPI
ranks (pinned to a core each, as ``partitioner train`` does), every program call, send, receive
and the loss broadcast timed (wall and thread CPU), and prints per rank the median step's wall and
CPU, each kind's wall / CPU per step, and the wall outside every timed call (the runner's Python:
slicing, gradient sums). A receive's wall minus its CPU is time the rank slept waiting (its
polling spins first, rule 3 of ``partitioner.runtime.comm_mpi``, so a short wait shows as CPU).
On a loaded machine the walls include the time the rank was descheduled; the CPU columns do not.
With ``--timeline`` each rank also prints its last step's calls (start-end, ms). Results:
``benchmarks/results/pipeline_mpi_timers_<model>_<backend>.json``.

    .venv/bin/mpiexec -n 2 .venv/bin/python benchmarks/pipeline_mpi_timers.py --model mlp [--backend tvm]
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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))


def _wrap(obj, attr: str, kind: str, events: list) -> None:
    fn = getattr(obj, attr)

    def timed(*args, **kw):
        t, c = time.perf_counter(), time.thread_time()
        out = fn(*args, **kw)
        events.append((kind, t, time.perf_counter(), time.thread_time() - c))
        return out

    setattr(obj, attr, timed)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="mlp", choices=["mlp", "resnet", "bert"])
    p.add_argument("--backend", default="onnxruntime", choices=["onnxruntime", "tvm"])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--timeline", action="store_true")
    p.add_argument("--results-dir", type=Path, default=ROOT / "benchmarks" / "results")
    args = p.parse_args(argv)
    from mpi4py import MPI

    from partitioner.runtime.worker import pin_cores

    world = MPI.COMM_WORLD
    rank = world.Get_rank()
    if world.Get_size() != 2:
        print("pipeline_mpi_timers: run it under mpiexec -n 2", file=sys.stderr)
        return 2
    pin_cores(rank, 2)
    import pipeline_stages

    from partitioner.runtime.comm_mpi import MPICommunicator
    from partitioner.training.optimizers import SGD
    from partitioner.training.pipeline_runner import pipeline_runners

    model, loss, batch, feed, y = pipeline_stages.case(args.model)
    comm = MPICommunicator([[0, 1]])
    _, (runner,) = pipeline_runners(model, loss, SGD(lr=1e-3), batch=batch, devices=2, schedule="1f1b",
                                    micro_batches=pipeline_stages.MICRO_BATCHES, trainable=None,
                                    backend=args.backend, comm=comm, out=Path(tempfile.mkdtemp()), threads=1,
                                    state=None)
    events: list = []
    for kind, exe in runner._exe.items():
        _wrap(exe, "run", kind, events)
    for op in ("recv", "send", "broadcast"):
        _wrap(comm, op, op, events)
    for _ in range(2):
        runner.step(feed, y)
    load = os.getloadavg()
    steps, per_kind = [], {}
    for _ in range(args.steps):
        events.clear()
        world.Barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        runner.step(feed, y)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        timed = sum(b - a for _, a, b, _ in events)
        steps.append({"wall_s": wall, "cpu_s": cpu, "untimed_wall_s": wall - timed})
        for kind, a, b, c in events:
            k = per_kind.setdefault(kind, {"wall_s": [], "cpu_s": [], "calls": 0})
            k["wall_s"].append(b - a)
            k["cpu_s"].append(c)
            k["calls"] += 1
    n = args.steps
    doc = {"rank": rank, "stage": runner.stage.index, "model": args.model, "backend": args.backend,
           "median_step": {k: statistics.median(s[k] for s in steps) for k in steps[0]},
           "per_step": {k: {"wall_s": sum(v["wall_s"]) / n, "cpu_s": sum(v["cpu_s"]) / n, "calls": v["calls"] // n}
                        for k, v in per_kind.items()},
           "load_before_after": [load[0], os.getloadavg()[0]]}
    med = doc["median_step"]
    line = (f"rank {rank} (stage {runner.stage.index}): step wall {med['wall_s'] * 1e3:.1f} ms, CPU "
            f"{med['cpu_s'] * 1e3:.1f} ms, outside the timed calls {med['untimed_wall_s'] * 1e3:.1f} ms; per step: "
            + ", ".join(f"{k} {v['wall_s'] * 1e3:.1f} / {v['cpu_s'] * 1e3:.1f} ms x{v['calls']}"
                        for k, v in doc["per_step"].items()))
    docs = world.gather(doc, root=0)
    lines = world.gather(line, root=0)
    if args.timeline:
        base = min(a for _, a, _, _ in events)
        print(f"rank {rank} timeline: " + " ".join(f"{k}:{(a - base) * 1e3:.1f}-{(b - base) * 1e3:.1f}"
                                                 for k, a, b, _ in events), flush=True)
    if rank == 0:
        print("\n".join(lines))
        print(f"(wall / CPU; load average {doc['load_before_after'][0]:.2f} -> {doc['load_before_after'][1]:.2f})")
        args.results_dir.mkdir(parents=True, exist_ok=True)
        path = args.results_dir / f"pipeline_mpi_timers_{args.model}_{args.backend}.json"
        path.write_text(json.dumps({"ranks": docs}, indent=1) + "\n")
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
