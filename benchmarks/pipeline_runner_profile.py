"""Where a TVM pipeline stage rank's step goes: the runner's own build of the stage
(``PipelineRunner``: ``build_one``'s lifted step constants, folded packs, the prepare program
``P``) timed per program call, per kernel class and outside the kernels (issue 16, session 15).

Builds the train_step.py model's 2-stage 1F1B x8 TVM plan, one stage's :class:`PipelineRunner`
over a communicator that returns at once (``overheads._Instant``: no waiting on a peer), one
thread. Per step (thread CPU, median over ``--steps`` steps after a warm-up step) it splits:

- ``step``: the whole ``runner.step`` call;
- per program (``F``, ``B``, ``FB``, ``U``, ``P``, ...): its ``run`` calls (input buffers, the VM
  call, the outputs), of which ``kernels`` (each TIR kernel call, by ``kernel_profile`` class:
  the classes come from building the same program with ``kernel_profile.build_ours``), ``lifted``
  (kernels inside ``main_transform_params``: executable rule 8, once per change of the weights),
  ``builtins`` (``vm.builtin.*`` calls: allocation, shape checks) and the rest of ``run`` (Python
  and the VM's own dispatch);
- ``python``: the step outside the programs' ``run`` (the runner's schedule, feeds, sends,
  gradient accumulation).

Kernel and builtin times come from hooked steps (a VM instrument hook: thread CPU around each call,
carrying the hook's own 1-3 us a call); ``run`` and ``step`` come from unhooked steps of the same
runner, interleaved with the hooked ones. ``--classes`` also builds each program standalone
(weights as inputs, as ``pipeline_kernels.py``) for the kernel classes.

    .venv/bin/python benchmarks/pipeline_runner_profile.py --model resnet --stage 0 [--steps 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))


class _Probe:
    """Thread-CPU accounting around one runner's program calls and (when ``hooked``) each VM call."""

    def __init__(self, runner: Any, infos: dict[str, dict]) -> None:
        self.infos, self.hooked = infos, False
        self.rec: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self._ctx = ""
        self._t = 0.0
        self._vms = [exe._vm for exe in runner._exe.values()]
        for kind, exe in runner._exe.items():
            self._wrap(kind, exe)

    def hook(self, on: bool) -> None:
        """The instrument on every program's VM (``on``) or none: a plain step pays no hook."""
        self.hooked = on
        for vm in self._vms:
            vm.set_instrument(self._instrument if on else None)

    def _wrap(self, kind: str, exe: Any) -> None:
        run, transform, vm_main = exe.run, exe._transform, exe._main

        def timed_main(*args: Any) -> Any:
            t = time.thread_time()
            try:
                return vm_main(*args)
            finally:
                self.rec[f"{kind} vm"] += time.thread_time() - t

        def timed_run(feeds: Any, comm: Any) -> Any:
            self._ctx = kind
            t = time.thread_time()
            try:
                return run(feeds, comm)
            finally:
                self.rec[f"{kind} run"] += time.thread_time() - t
                self.calls[kind] += 1

        def timed_transform(args: Any) -> Any:
            self._ctx = f"{kind} lifted"
            try:
                return transform(args)
            finally:
                self._ctx = kind

        exe.run, exe._main = timed_run, timed_main
        if transform is not None:
            exe._transform = timed_transform

    def _instrument(self, func: Any, symbol: str, before: bool, ret: Any, *a: Any) -> int:
        if not self.hooked:
            return 0
        if before:
            self._t = time.thread_time()
            return 0
        sec = time.thread_time() - self._t
        sym = str(symbol)
        if sym.startswith("vm.builtin"):
            key = f"{self._ctx.split()[0]} builtins"
            self.rec[f"class {self._ctx.split()[0]} builtins"] += sec
        elif self._ctx.endswith("lifted"):
            key = self._ctx
        else:
            key = f"{self._ctx} kernels"
            self.rec[f"class {self._ctx} {self.infos.get(sym, {}).get('class', 'unclassified')}"] += sec
            self.rec[f"kernel {self._ctx} {sym}"] += sec
        self.rec[key] += sec
        return 0


def _standalone(runner: Any, runs: int) -> tuple[dict[str, dict], dict[str, float]]:
    """Kernel class per symbol (each of the runner's programs built standalone by
    ``kernel_profile.build_ours``: weights as inputs, nothing lifted), and those standalone
    programs' kernel seconds per class and step (``pipeline_kernels.py``'s measurement: each
    program's median call times its calls a step)."""
    from kernel_profile import build_ours, profile_ours
    from pipeline_kernels import feeds_for
    from backends.tvm.target import resolve_target

    st, infos, per_class = runner.stage, {}, defaultdict(float)
    calls = {"F": runner.plan.micro_batches, "B": runner.plan.micro_batches, "P": 1, "U": 1}
    for kind, prog in (("F", st.forward), ("B", st.backward), ("P", st.prepare), ("U", st.update)):
        if prog is not None:
            ex, info = build_ours(prog, resolve_target(None), threads=1)
            infos.update(info)
            (timed,) = profile_ours([ex], feeds_for(prog), runs)
            for sym, sec in timed:
                cls = "builtins" if sym.startswith("vm.builtin") else info.get(sym, {}).get("class", "unclassified")
                per_class[f"{kind} {cls}"] += sec * calls[kind]
    return infos, dict(per_class)


def profile(model_name: str, stage: int, steps: int, classes: bool) -> dict[str, Any]:
    import pipeline_stages
    from partitioner.training.optimizers import SGD
    from partitioner.training.overheads import _Instant
    from partitioner.training.pipeline import build_pipeline
    from partitioner.training.pipeline_runner import PipelineRunner

    model, loss, batch, feed, y = pipeline_stages.case(model_name)
    plan = build_pipeline(model, loss, SGD(lr=1e-3), batch=batch, stages=2, micro_batches=pipeline_stages.MICRO_BATCHES,
                          schedule="1f1b", backend="tvm")
    with tempfile.TemporaryDirectory() as tmp:
        runner = PipelineRunner(plan, stage, comm=_Instant(stage), backend="tvm", workdir=Path(tmp))
        infos, alone = _standalone(runner, 3) if classes else ({}, {})
        probe = _Probe(runner, infos)
        runner.step(feed, y)  # warm-up
        plain: list[dict[str, float]] = []
        hooked: list[dict[str, float]] = []
        for i in range(2 * steps):
            probe.hook(bool(i % 2))
            probe.rec.clear()
            probe.calls.clear()
            t = time.thread_time()
            runner.step(feed, y)
            rec = dict(probe.rec, step=time.thread_time() - t)
            (hooked if probe.hooked else plain).append(rec)
    med = {k: statistics.median(r.get(k, 0.0) for r in plain) for k in plain[0]}
    hk = {k: statistics.median(r.get(k, 0.0) for r in hooked) for k in set().union(*hooked)}
    med["python"] = med["step"] - sum(v for k, v in med.items() if k.endswith(" run"))
    hk["python"] = hk["step"] - sum(v for k, v in hk.items() if k.endswith(" run"))
    return {"model": model_name, "stage": stage, "cut": plan.cut, "steps": steps, "plain": med, "hooked": hk,
            "calls_per_step": dict(probe.calls), "standalone": alone, "load": list(os.getloadavg())}


def report(doc: dict[str, Any]) -> None:
    med, hk = doc["plain"], doc["hooked"]
    print(f"{doc['model']} stage {doc['stage']} (cut {doc['cut']}), thread CPU ms per step, median of {doc['steps']} "
          f"(load {doc['load'][0]:.1f}): step {med['step'] * 1e3:.1f} (hooked {hk['step'] * 1e3:.1f}), outside the programs' "
          f"run {med['python'] * 1e3:.1f}")
    for kind in sorted(k.split()[0] for k in med if k.endswith(" run")):
        parts = {p: hk.get(f"{kind} {p}", 0.0) for p in ("kernels", "lifted", "builtins")}
        print(f"  {kind:4s} x{doc['calls_per_step'].get(kind, 0):<3d} run {med[f'{kind} run'] * 1e3:7.1f}: outside the VM "
              f"{(med[f'{kind} run'] - med.get(f'{kind} vm', 0.0)) * 1e3:6.1f}, VM {med.get(f'{kind} vm', 0.0) * 1e3:7.1f} "
              f"(hooked: kernels {parts['kernels'] * 1e3:7.1f}, lifted {parts['lifted'] * 1e3:6.1f}, builtins "
              f"{parts['builtins'] * 1e3:6.1f}, VM {hk.get(f'{kind} vm', 0.0) * 1e3:7.1f})")
    alone = doc.get("standalone", {})
    print(f"  {'program class':22s} {'runner':>8s} {'alone':>8s}  (ms per step; alone: built standalone, nothing lifted)")
    keys = {k[6:] for k in hk if k.startswith("class ")} | set(alone)
    for k in sorted(keys, key=lambda k: -max(hk.get(f"class {k}", 0.0), alone.get(k, 0.0))):
        print(f"  {k:22s} {hk.get(f'class {k}', 0.0) * 1e3:8.1f} {alone.get(k, 0.0) * 1e3:8.1f}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="resnet", choices=["mlp", "resnet", "bert"])
    p.add_argument("--stage", type=int, default=0)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--classes", action="store_true", help="kernel classes (builds every program twice)")
    p.add_argument("--top", type=int, default=0, help="also the TOP kernels (by symbol) of the runner's build")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    doc = profile(args.model, args.stage, args.steps, args.classes)
    report(doc)
    hk = doc["hooked"]
    for k in sorted((k for k in hk if k.startswith("kernel ")), key=lambda k: -hk[k])[:args.top]:
        print(f"  {k[7:]:60s} {hk[k] * 1e3:7.2f}")
    if args.json:
        args.json.write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
