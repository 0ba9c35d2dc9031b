"""Where a 2-rank MPI pipeline step's time goes, per rank: program calls, receive waits, the rest.

``benchmarks/pipeline_schedule.py`` replays the step from each stage's calls timed alone with free
messages; this runs the real thing: the train_step.py model's 2-stage 1F1B x8 plan on two MPI
ranks (pinned to a core each, as ``partitioner train`` does), every program call, send, receive
and the loss broadcast timed (wall and thread CPU), and prints per rank the median step's wall and
CPU, each kind's wall / CPU per step, and the wall outside every timed call (the runner's Python:
slicing, gradient sums). A receive's wall minus its CPU is time the rank slept waiting (its
polling spins first, rule 3 of ``partitioner.runtime.comm_mpi``, so a short wait shows as CPU).
On a loaded machine the walls include the time the rank was descheduled; the CPU columns do not.
With ``--timeline`` each rank also prints its last step's calls (start-end, ms); with ``--calls``
each call's median wall / CPU by its index in the step. Rank 0 also prints the step *replayed in
thread CPU* (:func:`cpu_replay`): both ranks' median calls and the CPU between them, in order, a
receive starting once the matching send has run; a loaded machine's descheduling, which swamps
the walls at load 8 or more, is left out, and a pairing of two settings by it compares the work
each rank does and the dependencies between them (messages free). Results:
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
        events.append((kind, t, time.perf_counter(), time.thread_time() - c, c))
        return out

    setattr(obj, attr, timed)


def cpu_replay(docs: list[dict]) -> tuple[float, list[float]]:
    """The step replayed from both ranks' median calls in thread CPU (a loaded machine's
    descheduling left out): each rank runs its calls and the CPU between them in order; a receive
    (and the loss broadcast on the rank that is not its root) starts once the other rank's matching
    send (or broadcast) has run, in order per direction, and costs the rank's cheapest receive (its
    measured CPU includes its polling while it waited). Returns the step and each rank's busy time."""
    seqs = [[c for c in d["per_call"]] for d in docs]
    root = max(range(len(docs)), key=lambda r: docs[r]["stage"])  # the loss broadcast's root: the last stage
    recv_cost = [min((c["cpu_s"] for c in s if c["kind"] == "recv"), default=0.0) for s in seqs]
    sent: list[list[float]] = [[], []]  # per sending rank: its messages' times, in order
    t, pos, got, busy = [0.0, 0.0], [0, 0], [0, 0], [0.0, 0.0]
    while pos[0] < len(seqs[0]) or pos[1] < len(seqs[1]):
        moved = False
        for r in (0, 1):
            while pos[r] < len(seqs[r]):
                c = seqs[r][pos[r]]
                kind = c["kind"]
                receive = kind == "recv" or (kind == "broadcast" and r != root)
                start = t[r] + c["cpu_before_s"]
                if receive:
                    if got[r] >= len(sent[1 - r]):
                        break  # waits for the other rank
                    start = max(start, sent[1 - r][got[r]])
                    got[r] += 1
                cost = recv_cost[r] if receive else c["cpu_s"]
                busy[r] += c["cpu_before_s"] + cost
                t[r] = start + cost
                if kind == "send" or (kind == "broadcast" and r == root):
                    sent[r].append(t[r])
                pos[r] += 1
                moved = True
        if not moved:
            raise RuntimeError("cpu_replay: both ranks wait (unmatched messages)")
    return max(t), busy


def replay_line(docs: list[dict]) -> str:
    step, busy = cpu_replay(docs)
    return (f"CPU replay (median calls, free messages): step {step * 1e3:.1f} ms; busy "
            + ", ".join(f"rank {r} {b * 1e3:.1f} ms" for r, b in enumerate(busy)))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="mlp", choices=["mlp", "resnet", "bert"])
    p.add_argument("--backend", default="onnxruntime", choices=["onnxruntime", "tvm"])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--timeline", action="store_true")
    p.add_argument("--calls", action="store_true",
                   help="also print each program call's median wall / CPU over the steps, by its index in the step")
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
    steps, per_kind, per_call = [], {}, {}
    for _ in range(args.steps):
        events.clear()
        world.Barrier()
        t0, c0, tc0 = time.perf_counter(), time.process_time(), time.thread_time()
        runner.step(feed, y)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        timed = sum(e[2] - e[1] for e in events)
        steps.append({"wall_s": wall, "cpu_s": cpu, "untimed_wall_s": wall - timed})
        ends = [tc0] + [e[4] + e[3] for e in events]
        per_call.setdefault((len(events), "end"), []).append((0.0, 0.0, time.thread_time() - ends[-1]))
        for i, (kind, a, b, c, cs) in enumerate(events):
            per_call.setdefault((i, kind), []).append((b - a, c, cs - ends[i]))
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
    doc["per_call"] = [{"index": i, "kind": kind, "wall_s": statistics.median(v[0] for v in vs),
                         "cpu_s": statistics.median(v[1] for v in vs), "cpu_before_s": statistics.median(v[2] for v in vs)}
                        for (i, kind), vs in sorted(per_call.items())]
    if args.calls:
        line += "\n  calls (median wall / CPU ms): " + " ".join(
            f"{c['kind']}:{c['wall_s'] * 1e3:.1f}/{c['cpu_s'] * 1e3:.1f}" for c in doc["per_call"])
    docs = world.gather(doc, root=0)
    lines = world.gather(line, root=0)
    if args.timeline:
        base = min(e[1] for e in events)
        print(f"rank {rank} timeline: " + " ".join(f"{e[0]}:{(e[1] - base) * 1e3:.1f}-{(e[2] - base) * 1e3:.1f}"
                                                 for e in events), flush=True)
    if rank == 0:
        print("\n".join(lines))
        print(f"(wall / CPU; load average {doc['load_before_after'][0]:.2f} -> {doc['load_before_after'][1]:.2f})")
        print(replay_line(docs))
        args.results_dir.mkdir(parents=True, exist_ok=True)
        path = args.results_dir / f"pipeline_mpi_timers_{args.model}_{args.backend}.json"
        path.write_text(json.dumps({"ranks": docs}, indent=1) + "\n")
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
