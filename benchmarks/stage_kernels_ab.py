"""One pipeline stage's TVM kernels with a knob on against off, in one process (session 17).

Builds the train_step.py model's 2-stage 1F1B x8 TVM plan twice, with ``--knob MODULE.ATTR`` set
True and False (``partitioner.training.bench._with_settings``: the plan and the runner built under
it), one :class:`PipelineRunner` of ``--stage`` each over a communicator that returns at once
(``overheads._Instant``), and steps them in interleaved rounds with every VM call hooked
(``pipeline_runner_profile._KernelHook``: thread CPU per ``program:symbol``). Prints, per side,
the median kernel ms a step by program and by program and class, the calls a step of kernels
whose name holds ``transpose``, and the name stems whose time differs most. Kernel times carry
the hook's own 1-3 us a call; read the differences. ``PARTITIONER_TRAIN_PIPE_CUT_AFTER`` forces
the cut.

    .venv/bin/python benchmarks/stage_kernels_ab.py --knob partitioner.training.hoist.LIFTED_WEIGHTS_IN_PACK \
        --stage 1 [--model resnet] [--rounds 5] [--json F]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))


def measure(model_name: str, knob: str, stage: int, rounds: int) -> dict[str, Any]:
    import pipeline_stages
    from pipeline_runner_profile import _KernelHook

    from partitioner.training.bench import _with_settings
    from partitioner.training.optimizers import SGD
    from partitioner.training.overheads import _Instant
    from partitioner.training.pipeline import build_pipeline
    from partitioner.training.pipeline_runner import PipelineRunner

    load0 = list(os.getloadavg())
    model, loss, batch, feed, y = pipeline_stages.case(model_name)
    runners: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for on in (True, False):
            def build(on: bool = on) -> Any:
                plan = build_pipeline(model, loss, SGD(lr=1e-3), batch=batch, stages=2,
                                      micro_batches=pipeline_stages.MICRO_BATCHES, backend="tvm")
                return PipelineRunner(plan, stage, comm=_Instant(stage), backend="tvm", workdir=Path(tmp) / str(on))
            runners["on" if on else "off"] = _with_settings({k: on for k in knob.split(",")}, build)
        hooks = {k: _KernelHook(r) for k, r in runners.items()}
        for r in runners.values():
            r.step(feed, y)  # warm-up
        per: dict[str, list[tuple[dict, dict]]] = {k: [] for k in runners}
        for _ in range(rounds):
            for k, r in runners.items():
                h = hooks[k]
                h.on(True)
                h.sec.clear()
                h.calls.clear()
                r.step(feed, y)
                h.on(False)
                per[k].append((dict(h.sec), dict(h.calls)))
    out: dict[str, Any] = {"model": model_name, "knob": knob, "stage": stage, "rounds": rounds, "load_before": load0,
                           "load_after": list(os.getloadavg()), "sides": {}}
    for k, recs in per.items():
        syms = set().union(*[r[0] for r in recs])
        out["sides"][k] = {"ms": {s: statistics.median(r[0].get(s, 0.0) for r in recs) * 1e3 for s in syms},
                           "calls": {s: recs[0][1].get(s, 0) for s in syms}}
    return out


def report(doc: dict[str, Any], top: int = 14) -> None:
    from pipeline_runner_profile import name_class, name_stem

    stems: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0.0, 0.0])
    for j, k in enumerate(("on", "off")):
        side = doc["sides"][k]
        byprog: dict[str, float] = defaultdict(float)
        bycls: dict[str, float] = defaultdict(float)
        tcalls: dict[str, int] = defaultdict(int)
        for s, v in side["ms"].items():
            prog = s.split(":")[0] if ":" in s else "builtin"
            byprog[prog] += v
            bycls[f"{prog}:{name_class(s)}"] += v
            tcalls[prog] += side["calls"][s] if "transpose" in s else 0
            stems[(prog, name_stem(s))][j] += v
        print(f"{k}: kernels {sum(side['ms'].values()):.1f} ms a step", {p: round(v, 1) for p, v in sorted(byprog.items())})
        print("   by class", {c: round(v, 1) for c, v in sorted(bycls.items())})
        print("   transpose-named kernel calls a step", dict(tcalls))
    print("largest stem differences, on - off (ms a step):")
    for (prog, stem), (a, b) in sorted(stems.items(), key=lambda kv: -abs(kv[1][0] - kv[1][1]))[:top]:
        print(f"  {prog:8s} {stem[:70]:70s} {a:8.2f} {b:8.2f} {a - b:+8.2f}")
    print("load", doc["load_before"], "->", doc["load_after"])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="resnet", choices=["mlp", "resnet", "bert"])
    p.add_argument("--knob", required=True, metavar="MODULE.ATTR[,MODULE.ATTR...]",
                   help="one knob, or several set together (comma-separated)")
    p.add_argument("--stage", type=int, default=0)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args(argv)
    if "." not in a.knob or a.stage not in (0, 1) or a.rounds < 1:
        print("stage_kernels_ab: --knob MODULE.ATTR, --stage 0 or 1, --rounds >= 1", file=sys.stderr)
        return 2
    doc = measure(a.model, a.knob, a.stage, a.rounds)
    report(doc)
    if a.json is not None:
        a.json.write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
