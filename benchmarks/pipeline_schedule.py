"""A 2-stage 1F1B x8 step simulated from each stage's program calls timed alone, paired against a baseline.

``benchmarks/pipeline_stages.py`` times each stage's whole step; that misses what a schedule
change moves (deferred_wgrad rule 7's tail changes no stage's total, only when the earlier
stage's last backward can start). Here each stage's :class:`PipelineRunner` runs over a
communicator that returns at once (``overheads._Instant``), every program call is timed with the
thread's CPU time, and the step is replayed with free messages: the last stage's ``FB`` /
``FBt`` of micro-batch ``m`` starts when stage 0's ``F`` of ``m`` has ended, stage 0's ``B`` of
``m`` when that ``FB`` / ``FBt`` has ended, every other call (``P``, ``W``, ``U``) in its
stage's order. The plans ``new`` (today's defaults) and ``old`` (the same with ``--baseline
MODULE.ATTR=VALUE`` settings, default the tail off) and a 1-rank step run in interleaved rounds;
the medians give the simulated step, the 1-rank step and their ratio. It ignores the Python
between calls and the messages' copies, so it is a bound for the MPI step, not a measurement of
it; it is what separates a few-percent schedule change on a loaded machine, where MPI step
times move by 2x between runs. Results: ``benchmarks/results/pipeline_schedule_<model>_<backend>.json``.

    .venv/bin/python benchmarks/pipeline_schedule.py --model mlp --backend onnxruntime [--rounds 7]
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

import numpy as np  # noqa: E402

TAIL_OFF = {"partitioner.training.deferred_wgrad.DEFER_TAIL_MICRO_BATCHES": 0}


def simulate(stage0: list[tuple[str, float]], last: list[tuple[str, float]]) -> float:
    """The step's length from the two stages' calls in order (kind, seconds), messages free."""
    f_end: list[float] = []
    fb_end: list[float] = []
    i0 = i1 = 0
    t0 = t1 = 0.0
    n_b = 0
    while i0 < len(stage0) or i1 < len(last):
        moved = False
        if i0 < len(stage0):
            kind, d = stage0[i0]
            if kind != "B" or n_b < len(fb_end):
                t0 = (max(t0, fb_end[n_b]) if kind == "B" else t0) + d
                n_b += kind == "B"
                if kind == "F":
                    f_end.append(t0)
                i0, moved = i0 + 1, True
        if i1 < len(last):
            kind, d = last[i1]
            if kind not in ("FB", "FBt") or len(fb_end) < len(f_end):
                t1 = (max(t1, f_end[len(fb_end)]) if kind in ("FB", "FBt") else t1) + d
                if kind in ("FB", "FBt"):
                    fb_end.append(t1)
                i1, moved = i1 + 1, True
        if not moved:
            raise RuntimeError("the two stages' calls wait on each other")
    return max(t0, t1)


def _timed(calls: list, kind: str, exe) -> None:
    run = exe.run

    def timed(*args):
        t = time.thread_time()
        out = run(*args)
        calls.append((kind, time.thread_time() - t))
        return out

    exe.run = timed


def run(name: str, backend: str, rounds: int, baseline: dict) -> dict:
    import pipeline_stages

    model, loss, batch, feed, y = pipeline_stages.case(name)
    load_before = os.getloadavg()
    plans = pipeline_stages._plans(model, loss, batch, backend, baseline)
    calls: dict[str, list] = {}
    with tempfile.TemporaryDirectory() as tmp:
        runners = pipeline_stages._runners(plans, model, loss, backend, Path(tmp), feed, y, reuse_old=True)
        for key, r in runners.items():
            for kind, exe in (r._exe.items() if key != "1 rank" else ()):
                _timed(calls.setdefault(key, []), kind, exe)
        sims: dict[str, list[float]] = {k: [] for k in plans}
        one: list[float] = []
        cpu: dict[str, list[float]] = {}  # each stage's program CPU per step
        for _ in range(rounds):
            for c in calls.values():
                c.clear()
            for key, r in runners.items():
                t = time.thread_time()
                r.step(feed, y)
                if key == "1 rank":
                    one.append(time.thread_time() - t)
            for k in plans:
                sims[k].append(simulate(calls[f"{k} stage 0"], calls[f"{k} stage 1"]))
                for s in range(2):
                    cpu.setdefault(f"{k} stage {s}", []).append(sum(d for _, d in calls[f"{k} stage {s}"]))
    med = {k: statistics.median(v) for k, v in sims.items()}
    doc = {"model": name, "backend": backend, "rounds": rounds, "baseline": baseline,
           "simulated_step_s": med, "one_rank_s": statistics.median(one),
           "speedup": {k: statistics.median(one) / v for k, v in med.items()},
           "tail": {k: [st.w_tail for st in p.stages] for k, p in plans.items()},
           "split": {k: p.parts for k, p in plans.items()},  # pipeline rule 11 (split_cut)
           "stage_cpu_s": {k: statistics.median(v) for k, v in cpu.items()},
           "load_before": list(load_before), "load_after": list(os.getloadavg())}
    for k in plans:
        print(f"{name} {backend} {k}: split {plans[k].parts or 'none'}; stage CPU per step "
              + " / ".join(f"{statistics.median(cpu[f'{k} stage {s}']) * 1e3:.1f}" for s in range(2)) + " ms")
        print(f"{name} {backend} {k}: simulated 1F1B x8 step {med[k] * 1e3:.1f} ms, 1 rank "
              f"{doc['one_rank_s'] * 1e3:.1f} ms: {doc['speedup'][k]:.3f}x", flush=True)
    print(f"load average before {load_before[0]:.2f}, after {doc['load_after'][0]:.2f}")
    return doc


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="mlp", choices=["mlp", "resnet", "bert"])
    p.add_argument("--backend", default="onnxruntime", choices=["onnxruntime", "tvm"])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--results-dir", type=Path, default=ROOT / "benchmarks" / "results")
    p.add_argument("--baseline", action="append", default=[], metavar="MODULE.ATTR=VALUE",
                   help="'old' is today's plan with these settings (default: the tail off)")
    args = p.parse_args(argv)
    from train_step import _settings

    doc = run(args.model, args.backend, args.rounds, _settings(args.baseline) if args.baseline else TAIL_OFF)
    args.results_dir.mkdir(parents=True, exist_ok=True)
    path = args.results_dir / f"pipeline_schedule_{args.model}_{args.backend}.json"
    path.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
