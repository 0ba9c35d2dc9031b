"""Pipeline stages timed alone: this code's plan against the session-8 plan, paired, with the 1F1B bound.

For one zoo model (the ``benchmarks/train_step.py`` sizes) and backend, two 2-stage 1F1B x8 plans:

- ``new``: today's defaults (the measured cut, rule 9's hoist on TVM, TVM weights reused across
  micro-batches);
- ``old``: the cost-model cut, no hoist, every input copied per call (the code before session 9);

or, with ``--baseline MODULE.ATTR=VALUE`` (repeatable), ``old`` is today's plan and its stage runners
built with those settings (a knob's before/after, e.g. ``partitioner.training.hoist.HWIO_CONV_WEIGHTS=False``
or ``partitioner.training.pipeline_runner.STASH_TENSORS=False``);

each stage's :class:`PipelineRunner` over a communicator that returns at once
(``overheads._Instant``: no waiting on a peer, so a loaded machine's descheduled peer does not
count), and a 1-rank step of the same global batch. All of them run in interleaved rounds (one
step each per round), timed with the thread's CPU time; the medians give each stage's CPU per
step and the 1F1B bound ``1-rank / ((M + S - 1) / M x slower stage)`` (2 stages, 8 micro-batches:
9/8). Results: ``benchmarks/results/pipeline_stages_<model>_<backend>.json`` (with the load
average; ``--results-dir`` for a trial run).

    .venv/bin/python benchmarks/pipeline_stages.py --model mlp --backend tvm [--rounds 7] [--baseline M.ATTR=V]

``--stage N`` (with ``--baseline``) times stage N alone, today's runner against the baseline's, in
interleaved rounds, no 1-rank step, and prints the rounds' median paired difference
(``pipeline_stage<N>_<model>_<backend>.json``, each round's times under ``cpu_s_per_round``).

``--cuts NODE[,NODE...]`` instead times today's plan (``planned``) against one plan per named cut
(stage 0 ends after that forward node: ``pipeline.CUT_AFTER``; everything else today's), each
stage alone and the 1-rank step in the same interleaved rounds, with each cut's 1F1B bound
(``benchmarks/results/pipeline_cuts_<model>_<backend>.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import numpy as np  # noqa: E402

MICRO_BATCHES = 8


def _plans(model, loss: str, batch: int, backend: str, baseline: dict | None = None) -> dict:
    from partitioner.training.bench import _with_settings
    from partitioner.training.optimizers import SGD
    from partitioner.training.pipeline import build_pipeline

    def plan():
        return build_pipeline(model, loss, SGD(lr=1e-3), batch=batch, stages=2, micro_batches=MICRO_BATCHES,
                              backend=backend)

    new = plan()
    old = _with_settings(baseline or {"partitioner.training.hoist.HOIST_WEIGHT_NODES": False,
                                      "partitioner.training.measured_cut.MEASURED_CUT": False}, plan)
    return {"new": new, "old": old}


def _runners(plans: dict, model, loss: str, backend: str, work: Path, feed: dict, y, reuse_old: bool,
             baseline: dict | None = None, stage: int | None = None) -> dict:
    from partitioner.training.bench import _with_settings
    from partitioner.training.optimizers import SGD
    from partitioner.training.overheads import _Instant
    from partitioner.training.pipeline_runner import PipelineRunner
    from partitioner.training.runner import StepRunner
    from partitioner.training.step import build_training_graph

    out = {}
    for k, plan in plans.items():
        for s in range(plan.num_stages) if stage is None else (stage,):
            r = _with_settings(baseline if k == "old" and baseline else {},  # runner knobs too
                               lambda: PipelineRunner(plan, s, comm=_Instant(s), backend=backend, workdir=work / k))
            for e in r._exe.values():
                if hasattr(e, "reuse_readonly_inputs"):
                    e.reuse_readonly_inputs = k == "new" or reuse_old
            out[f"{k} stage {s}"] = r
    if stage is not None:  # --stage: that stage's runners only
        return _warmed(out, feed, y)
    out["1 rank"] = StepRunner(build_training_graph(model, loss=loss, optimizer=SGD(lr=1e-3)), backend=backend,
                               workdir=work / "one")
    return _warmed(out, feed, y)


def _warmed(runners: dict, feed: dict, y) -> dict:
    for r in runners.values():
        r.step(feed, y)  # warm-up
    return runners


def case(name: str) -> tuple:
    """The train_step.py model ``name``, its loss, global batch and seeded feed and labels."""
    import models_zoo
    from train_step import CASES

    kwargs, loss = CASES[name]
    batch = kwargs["batch"]
    model = models_zoo.build(name, **kwargs)
    rng = np.random.default_rng(0)
    vi = model.graph.input[0]
    shape = [batch] + [d.dim_value for d in vi.type.tensor_type.shape.dim][1:]
    x = (rng.integers(0, 50, shape) if vi.type.tensor_type.elem_type == 7
         else rng.standard_normal(shape).astype(np.float32))
    out = [d.dim_value for d in model.graph.output[0].type.tensor_type.shape.dim]
    y = (rng.integers(0, out[-1], [batch] + out[1:-1]) if loss == "cross_entropy"
         else rng.standard_normal([batch] + out[1:]).astype(np.float32))
    return model, loss, batch, {vi.name: x}, y


def _timed(name: str, backend: str, rounds: int, plans: dict, model, loss: str, feed: dict, y, load_before,
           **runner_kw) -> tuple[dict, dict]:
    """Each plan's stages alone and the 1-rank step in interleaved rounds (thread CPU per step):
    the medians and the record (``cut``, ``bound_1f1b`` per plan, load, machine)."""
    with tempfile.TemporaryDirectory() as tmp:
        runners = _runners(plans, model, loss, backend, Path(tmp), feed, y, **runner_kw)
        times: dict[str, list[float]] = {k: [] for k in runners}
        for _ in range(rounds):
            for k, r in runners.items():
                t = time.thread_time()
                r.step(feed, y)
                times[k].append(time.thread_time() - t)
    med = {k: statistics.median(v) for k, v in times.items()}
    bubble = (MICRO_BATCHES + 1) / MICRO_BATCHES
    doc = {"model": name, "backend": backend, "rounds": rounds, "cpu_s_per_step": med, "cpu_s_per_round": times,
           "cut": {k: p.cut for k, p in plans.items()},
           "bound_1f1b": {k: med["1 rank"] / (bubble * max(med[f"{k} stage 0"], med[f"{k} stage 1"]))
                          for k in plans} if "1 rank" in med else {},
           "load_before": list(load_before), "load_after": list(os.getloadavg()),
           "machine": platform.machine(), "python": platform.python_version()}
    return med, doc


def run(name: str, backend: str, rounds: int, baseline: dict | None = None, stage: int | None = None) -> dict:
    model, loss, batch, feed, y = case(name)
    load_before = os.getloadavg()
    plans = _plans(model, loss, batch, backend, baseline)
    med, doc = _timed(name, backend, rounds, plans, model, loss, feed, y, load_before,
                      reuse_old=bool(baseline), baseline=baseline, stage=stage)
    doc["baseline"] = baseline
    if stage is not None:  # --stage: that stage alone, old against new, with the rounds' paired differences
        doc["stage"] = stage
        new, old = doc["cpu_s_per_round"][f"new stage {stage}"], doc["cpu_s_per_round"][f"old stage {stage}"]
        diff = statistics.median(a - b for a, b in zip(new, old))
        print(f"{name} {backend} stage {stage}: new {med[f'new stage {stage}'] * 1e3:.1f} / old "
              f"{med[f'old stage {stage}'] * 1e3:.1f} ms CPU per step, median paired difference {diff * 1e3:+.1f} ms "
              f"(new faster in {sum(a < b for a, b in zip(new, old))} of {len(new)} rounds)")
        print(f"load average before {load_before[0]:.2f}, after {doc['load_after'][0]:.2f}")
        return doc
    for k in plans:
        print(f"{name} {backend} {k}: stages {med[f'{k} stage 0'] * 1e3:.1f} / {med[f'{k} stage 1'] * 1e3:.1f} ms "
              f"CPU per step ({plans[k].cut}), 1 rank {med['1 rank'] * 1e3:.1f} ms: 1F1B bound "
              f"{doc['bound_1f1b'][k]:.2f}x", flush=True)
    print(f"load average before {load_before[0]:.2f}, after {doc['load_after'][0]:.2f}")
    return doc


def cut_plans(model, loss: str, batch: int, backend: str, cuts: list[str]) -> dict:
    """``--cuts``: today's plan (``planned``) and one plan per named cut (the stages end after that
    node: ``pipeline.CUT_AFTER``), every other setting today's."""
    from partitioner.training.bench import _with_settings
    from partitioner.training.optimizers import SGD
    from partitioner.training.pipeline import build_pipeline

    def plan():
        return build_pipeline(model, loss, SGD(lr=1e-3), batch=batch, stages=2, micro_batches=MICRO_BATCHES,
                              backend=backend)

    out = {"planned": plan()}
    for c in cuts:
        out[c] = _with_settings({"partitioner.training.pipeline.CUT_AFTER": (c,)}, plan)
    return out


def run_cuts(name: str, backend: str, rounds: int, cuts: list[str]) -> dict:
    """``--cuts``: each stage of each cut's plan alone and the 1-rank step, interleaved rounds,
    thread CPU medians, the 1F1B bound per cut."""
    model, loss, batch, feed, y = case(name)
    load_before = os.getloadavg()
    plans = cut_plans(model, loss, batch, backend, cuts)
    med, doc = _timed(name, backend, rounds, plans, model, loss, feed, y, load_before, reuse_old=True)
    doc["cuts"] = cuts
    for k, p in plans.items():
        print(f"{name} {backend} cut {k}: stages {med[f'{k} stage 0'] * 1e3:.1f} / {med[f'{k} stage 1'] * 1e3:.1f} ms "
              f"CPU per step (stage 0's last weight {p.stages[0].weights[-1]}), 1 rank {med['1 rank'] * 1e3:.1f} ms: 1F1B bound "
              f"{doc['bound_1f1b'][k]:.2f}x", flush=True)
    print(f"load average before {load_before[0]:.2f}, after {doc['load_after'][0]:.2f}")
    return doc


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="mlp", choices=["mlp", "resnet", "bert"])
    p.add_argument("--backend", default="tvm", choices=["onnxruntime", "tvm"])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--results-dir", type=Path, default=ROOT / "benchmarks" / "results")
    p.add_argument("--baseline", action="append", default=[], metavar="MODULE.ATTR=VALUE",
                   help="'old' is today's plan with these settings (default: the session-8 plan)")
    p.add_argument("--stage", type=int, default=None,
                   help="time only this stage (old against new, no 1-rank step; results: "
                        "pipeline_stage<N>_<model>_<backend>.json, with each round's paired difference)")
    p.add_argument("--cuts", default="", metavar="NODE[,NODE...]",
                   help="time today's plan against one plan per cut after each named forward node "
                        "(results: pipeline_cuts_<model>_<backend>.json)")
    args = p.parse_args(argv)
    from train_step import _settings

    if args.cuts:
        doc = run_cuts(args.model, args.backend, args.rounds, args.cuts.split(","))
        args.results_dir.mkdir(parents=True, exist_ok=True)
        path = args.results_dir / f"pipeline_cuts_{args.model}_{args.backend}.json"
        path.write_text(json.dumps(doc, indent=1) + "\n")
        print(f"wrote {path}")
        return 0
    doc = run(args.model, args.backend, args.rounds, _settings(args.baseline), args.stage)
    args.results_dir.mkdir(parents=True, exist_ok=True)
    kind = "stages" if args.stage is None else f"stage{args.stage}"
    path = args.results_dir / f"pipeline_{kind}_{args.model}_{args.backend}.json"
    path.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
