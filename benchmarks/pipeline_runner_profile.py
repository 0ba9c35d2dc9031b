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

``--compare`` (session 16) answers another question: why the two stages' kernels together cost
more than the 1-rank step's. It builds both stages' runners and the 1-rank ``StepRunner`` of the
same global batch, hooks every VM call of every TVM library they hold (thread CPU, the runners
stepped in interleaved rounds, hooked and plain steps alternating, medians over ``--steps``
rounds) and keys each kernel by ``program:symbol`` (each library numbers its kernels alone: a
stage's ``F:conv2d4`` and ``B:conv2d4`` are different kernels). It prints the plain steps and
S = stage 0 + stage 1 against the 1-rank step; kernel time per class (from the name: ``conv``,
``gemm``, ``layout``, ``pool``, ``other``, ``builtins``), the largest S - 1-rank differences
first; the conv kernels by layer shape with the batch apart and the packed weight (ms per image:
2 images against 16); the name stems (the symbol without its program and numbers, so the same
kind of kernel in any library) with their calls a step; each runner's minor page faults per plain
step (the thread's ``ru_minflt``). ``--json`` keeps every kernel with its first call's argument
shapes. ``PARTITIONER_TRAIN_PIPE_CUT_AFTER`` forces the cut.

    .venv/bin/python benchmarks/pipeline_runner_profile.py --model resnet --compare [--steps 3] [--top 25] [--json F]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
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


def name_class(sym: str) -> str:
    """A kernel's class from its symbol (``--compare``: no TIR to read in a loaded library)."""
    low = sym.split(":")[-1].lower()
    if low.startswith("vm.builtin"):
        return "builtins"
    if "conv2d" in low:
        return "conv"
    if "matmul" in low or "dense" in low:
        return "gemm"
    if "pool" in low:
        return "pool"
    if "transpose" in low or "layout" in low or "concatenate" in low:
        return "layout"
    return "other"


def name_stem(sym: str) -> str:
    """The symbol without its program and its numbers (``B:fused_conv2d3_add_relu2`` ->
    ``fused_conv2d_add_relu``): the same kind of kernel in any library."""
    import re

    return re.sub(r"\d+(?=_|$)", "", sym.split(":")[-1]) or sym


def _tvm_exes(obj: Any, name: str = "") -> list[tuple[str, Any]]:
    """(program name, TVM library) for each library (an object with a ``_vm``) a runner's
    executable holds: itself, the bucketed executable's segments (``steps``: ``seg<i>``), a
    pipeline runner's programs (``_exe``: ``F``, ``B``, ...). Each library numbers its kernels
    alone (``F``'s ``conv2d4`` is not ``B``'s), so a kernel is named by both."""
    if hasattr(obj, "_vm"):
        return [(name or "main", obj)]
    if isinstance(obj, dict):
        return [e for k, v in obj.items() for e in _tvm_exes(v, str(k))]
    if hasattr(obj, "steps") and isinstance(obj.steps, list):
        return [e for i, (_, seg) in enumerate(obj.steps) if seg is not None for e in _tvm_exes(seg, f"seg{i}")]
    return []


class _KernelHook:
    """Thread CPU of every VM call of one runner's TVM libraries, by ``program:symbol``, and each
    kernel's argument shapes (first call)."""

    def __init__(self, runner: Any) -> None:
        self.sec: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.shapes: dict[str, str] = {}
        self._t = 0.0
        self._vms = [(e._vm, self._instrument_for(name)) for name, e in _tvm_exes(runner._exe)]

    def on(self, yes: bool) -> None:
        for vm, fn in self._vms:
            vm.set_instrument(fn if yes else None)

    def _instrument_for(self, prog: str) -> Any:
        def instrument(func: Any, symbol: str, before: bool, ret: Any, *args: Any) -> int:
            if before:
                self._t = time.thread_time()
                return 0
            sec = time.thread_time() - self._t
            sym = str(symbol)
            key = sym if sym.startswith("vm.builtin") else f"{prog}:{sym}"
            self.sec[key] += sec
            self.calls[key] += 1
            if key not in self.shapes and key != sym:
                self.shapes[key] = " ".join("x".join(str(d) for d in a.shape) for a in args if hasattr(a, "shape"))
            return 0

        return instrument


def compare(model_name: str, steps: int) -> dict[str, Any]:
    """``--compare``: both stages' runners and the 1-rank step, hooked, interleaved rounds."""
    import pipeline_stages
    from partitioner.training.optimizers import SGD
    from partitioner.training.overheads import _Instant
    from partitioner.training.pipeline import build_pipeline
    from partitioner.training.pipeline_runner import PipelineRunner
    from partitioner.training.runner import StepRunner
    from partitioner.training.step import build_training_graph

    load_before = list(os.getloadavg())
    model, loss, batch, feed, y = pipeline_stages.case(model_name)
    plan = build_pipeline(model, loss, SGD(lr=1e-3), batch=batch, stages=2, micro_batches=pipeline_stages.MICRO_BATCHES,
                          schedule="1f1b", backend="tvm")
    with tempfile.TemporaryDirectory() as tmp:
        runners = {f"stage {s}": PipelineRunner(plan, s, comm=_Instant(s), backend="tvm", workdir=Path(tmp) / f"s{s}")
                   for s in range(plan.num_stages)}
        runners["1 rank"] = StepRunner(build_training_graph(model, loss=loss, optimizer=SGD(lr=1e-3)), backend="tvm",
                                       workdir=Path(tmp) / "one")
        hooks = {k: _KernelHook(r) for k, r in runners.items()}
        for r in runners.values():
            r.step(feed, y)  # warm-up
        per: dict[str, list[dict[str, float]]] = {k: [] for k in runners}
        plain: dict[str, list[float]] = {k: [] for k in runners}
        faults: dict[str, list[int]] = {k: [] for k in runners}
        for i in range(2 * steps):
            for k, r in runners.items():
                h = hooks[k]
                h.on(bool(i % 2))
                h.sec.clear()
                h.calls.clear()
                f0 = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
                t = time.thread_time()
                r.step(feed, y)
                dt = time.thread_time() - t
                if not i % 2:
                    faults[k].append(resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - f0)
                if i % 2:
                    per[k].append(dict(h.sec, _step=dt, **{f"_calls {s}": float(c) for s, c in h.calls.items()}))
                else:
                    plain[k].append(dt)
                h.on(False)
    out: dict[str, Any] = {"model": model_name, "cut": plan.cut, "stage0_last_weight": plan.stages[0].weights[-1],
                           "steps": steps, "load_before": load_before,
                           "load_after": list(os.getloadavg()), "step_plain": {}, "step_hooked": {}, "symbols": {},
                           "minor_faults_per_step": {k: statistics.median(v) for k, v in faults.items()}}
    for k, recs in per.items():
        syms = set().union(*recs)
        med = {s: statistics.median(r.get(s, 0.0) for r in recs) for s in syms}
        out["step_plain"][k] = statistics.median(plain[k])
        out["step_hooked"][k] = med.pop("_step")
        out["symbols"][k] = {s: {"ms": v * 1e3, "calls": med.get(f"_calls {s}", 0.0),
                                 "class": name_class(s), "stem": name_stem(s), "shapes": hooks[k].shapes.get(s, "")}
                             for s, v in med.items() if not s.startswith("_calls ")}
    return out


def _sum_by(doc: dict[str, Any], key: str) -> dict[str, dict[str, float]]:
    """ms per step by ``key`` (``class`` or ``stem``) for each runner and S (the stages' sum)."""
    tab: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for k, syms in doc["symbols"].items():
        for rec in syms.values():
            tab[rec[key]][k] += rec["ms"]
            if k.startswith("stage"):
                tab[rec[key]]["S"] += rec["ms"]
                tab[rec[key]][f"{k} calls"] += rec["calls"]
            else:
                tab[rec[key]]["1 rank calls"] += rec["calls"]
    return tab


def conv_layers(doc: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Conv kernels by layer shape, batch apart (``in HxWxC -> out HxWxC, packed weight W``), with
    the images they ran over a step: their ms per image compare the two builds' kernels for the
    same layer at 2 and at 16 images."""
    tab: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for k, syms in doc["symbols"].items():
        side = "S" if k.startswith("stage") else "1 rank"
        for s, rec in syms.items():
            dims = [[int(d) for d in a.split("x")] for a in rec["shapes"].split()]
            if "conv2d" not in s or len(dims) < 3 or len(dims[0]) != 4 or len(dims[-1]) != 4:
                continue
            x, w, y = dims[0], dims[1], dims[-1]
            key = f"{'x'.join(map(str, x[1:]))} -> {'x'.join(map(str, y[1:]))} w {'x'.join(map(str, w))}"
            tab[key][side] += rec["ms"]
            tab[key][f"{side} images"] += rec["calls"] * x[0]
    return tab


def report_compare(doc: dict[str, Any], top: int) -> None:
    sp, sh = doc["step_plain"], doc["step_hooked"]
    s_plain = sum(v for k, v in sp.items() if k.startswith("stage"))
    print(f"{doc['model']} TVM, stage 0 ends with weight {doc.get('stage0_last_weight')}, thread CPU ms per step, median of {doc['steps']} rounds (load "
          f"{doc['load_before'][0]:.1f} -> {doc['load_after'][0]:.1f})")
    print("  step (plain): " + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in sp.items())
          + f"; S {s_plain * 1e3:.1f} = {s_plain / sp['1 rank']:.2f}x the 1-rank step")
    print("  step (hooked): " + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in sh.items()))
    if "minor_faults_per_step" in doc:
        print("  minor page faults per plain step: " + ", ".join(f"{k} {v:.0f}" for k, v in doc["minor_faults_per_step"].items()))
    cls = _sum_by(doc, "class")
    print(f"  {'class':10s} {'stage 0':>8s} {'stage 1':>8s} {'S':>8s} {'1 rank':>8s} {'S-1':>8s} {'S/1':>6s}")
    for c in sorted(cls, key=lambda c: -(cls[c]["S"] - cls[c]["1 rank"])):
        r = cls[c]
        print(f"  {c:10s} {r['stage 0']:8.1f} {r['stage 1']:8.1f} {r['S']:8.1f} {r['1 rank']:8.1f} "
              f"{r['S'] - r['1 rank']:8.1f} {r['S'] / max(r['1 rank'], 1e-9):6.2f}")
    convs = conv_layers(doc)
    print(f"  conv layers by S - 1 rank (ms per step, images a step, ms per image; weight as packed, batch apart):")
    for key in sorted(convs, key=lambda c: -abs(convs[c]["S"] - convs[c]["1 rank"]))[:top]:
        r = convs[key]
        per = [r[s] / r[f"{s} images"] if r[f"{s} images"] else 0.0 for s in ("S", "1 rank")]
        print(f"  {key[:56]:56s} {r['S']:7.1f} ({r['S images']:4.0f}) {r['1 rank']:7.1f} ({r['1 rank images']:4.0f}) "
              f"{r['S'] - r['1 rank']:+7.1f}  {per[0]:.3f} / {per[1]:.3f}")
    stems = _sum_by(doc, "stem")
    print(f"  top {top} kernel name stems by S - 1 rank (ms per step; calls a step stage 0 / stage 1 / 1 rank):")
    for st in sorted(stems, key=lambda s: -abs(stems[s]["S"] - stems[s]["1 rank"]))[:top]:
        r = stems[st]
        print(f"  {st[:58]:58s} {r['S']:7.1f} {r['1 rank']:7.1f} {r['S'] - r['1 rank']:+7.1f}  "
              f"({r['stage 0 calls']:.0f} / {r['stage 1 calls']:.0f} / {r['1 rank calls']:.0f})")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="resnet", choices=["mlp", "resnet", "bert"])
    p.add_argument("--stage", type=int, default=0)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--classes", action="store_true", help="kernel classes (builds every program twice)")
    p.add_argument("--top", type=int, default=0, help="also the TOP kernels (by symbol) of the runner's build")
    p.add_argument("--json", type=Path)
    p.add_argument("--compare", action="store_true",
                   help="both stages against the 1-rank step, by kernel class and name stem (session 16)")
    args = p.parse_args(argv)
    if args.compare:
        doc = compare(args.model, args.steps)
        report_compare(doc, args.top or 25)
        if args.json:
            args.json.write_text(json.dumps(doc, indent=1) + "\n")
        return 0
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
