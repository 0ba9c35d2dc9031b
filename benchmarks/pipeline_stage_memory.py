"""Where a TVM pipeline stage's memory goes: RSS after each program's first call and after each step.

For one zoo model (the ``benchmarks/train_step.py`` sizes) and one stage of its 2-stage 1F1B x8
TVM plan, the stage's :class:`PipelineRunner` alone in this process, over a communicator whose
receives return zeros at once (``overheads._Instant``). The window starts as ``train --bench``'s
does (:mod:`partitioner.training.memory_window`: garbage collected, heap trimmed, ``VmHWM`` reset
once the runner is built; the runner's state counted in), so ``peak`` is the figure the benchmark
compares with the cost model. Then, after each program's first call and after each step: the RSS
and the peak above the window's start, and what the runner visibly holds (each program's
persistent input buffers, its lifted step constants, the output tensors it keeps). ``tracemalloc``
does not see TVM's allocations: the rest (``rest``) is TVM's pooled storage, the arrays the step
leaves alive and the heap's fragmentation. Beside them, ``predicted_mib``: the cost model's terms
for the stage (:func:`partitioner.cost.memory.tvm_stage_memory`, what ``predict_training`` charges
a TVM pipeline rank), priced from the same plan's programs.

    .venv/bin/python benchmarks/pipeline_stage_memory.py --model mlp --stage 1 [--steps 3] [--set M.ATTR=V]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

MiB = float(2**20)
CACHE = Path(tempfile.gettempdir()) / "partitioner-stage-memory-cache"


def _held(runner) -> dict[str, float]:
    """Bytes the runner's programs visibly hold (MiB): input buffers, lifted values, kept outputs."""
    out = {}
    for kind, exe in runner._exe.items():
        bufs = sum(b[0].numpy().nbytes if b[1] is None else b[1].nbytes for b in exe._in_bufs if b is not None)
        lifted = sum(_nbytes(t) for t in (exe._lifted or []))
        kept = sum(_nbytes(t) for t in exe.output_tensors.values())
        out[kind] = {"input_buffers": bufs / MiB, "lifted": lifted / MiB, "kept_outputs": kept / MiB}
    return out


def _nbytes(t) -> int:
    try:
        import numpy as np

        return int(np.prod([int(d) for d in t.shape])) * t.dtype.itemsize if hasattr(t.dtype, "itemsize") \
            else int(np.from_dlpack(t).nbytes)
    except Exception:  # noqa: BLE001 - a tuple or a shape: not storage
        return 0


def _predicted(plan, stage: int) -> dict[str, float]:
    """The cost model's terms for ``stage`` of ``plan`` (MiB), with rule 3's in-flight counts."""
    from backends.tvm.lift_step_constants import step_constant_inputs
    from partitioner.cost.memory import tvm_stage_memory
    from partitioner.cost.training import stashed_micro_batches

    counts = stashed_micro_batches(plan.schedule, plan.num_stages, plan.micro_batches, plan.extra_warmup)
    terms = tvm_stage_memory(plan.stages[stage], micro_batches=plan.micro_batches, in_flight=counts[stage],
                             constant_inputs=step_constant_inputs)
    return {k: v / MiB for k, v in terms.to_json().items()}


def _cached_builds(folder: Path) -> None:
    """Reuse a library built from the very same program (its sha256 beside it) across runs."""
    import hashlib
    import shutil

    import importlib

    build = importlib.import_module("backends.tvm.build")

    real = build.build_one

    def build_one(program, out_path, tdict, options=None, report=lambda stage: None):
        key = hashlib.sha256(program.SerializeToString() + repr(sorted((options or {}).items())).encode()).hexdigest()
        cached = folder / f"{key}.so"
        if not cached.is_file():
            real(program, cached, tdict, options, report)
        shutil.copyfile(cached, out_path)
        return {}

    build.build_one = build_one


def measure(name: str, stage: int, steps: int, trace: int = 0) -> dict:
    from partitioner.training import memory_window as mw
    from partitioner.training.optimizers import SGD
    from partitioner.training.overheads import _Instant
    from partitioner.training.pipeline import build_pipeline
    from partitioner.training.pipeline_runner import PipelineRunner
    from pipeline_stages import MICRO_BATCHES, case

    _cached_builds(CACHE)
    model, loss, batch, feed, y = case(name)
    plan = build_pipeline(model, loss, SGD(lr=1e-3), batch=batch, stages=2, micro_batches=MICRO_BATCHES,
                          backend="tvm")
    with tempfile.TemporaryDirectory() as tmp:
        runner = PipelineRunner(plan, stage, comm=_Instant(stage), backend="tvm", workdir=tmp)
        programs = sorted(runner._exe)
        state = sum(a.nbytes for a in runner.state.values())
        mw.release()
        mw.reset_peak()
        start = mw.rss_bytes() - state  # memory_window rule 3's baseline
        rows: list[dict] = []

        def row(what: str) -> None:
            rows.append({"after": what, "rss": (mw.rss_bytes() - start) / MiB, "peak": (mw.peak_bytes() - start) / MiB})

        seen: set[str] = set()
        cpu: list[float] = []
        for kind, exe in runner._exe.items():
            def wrapped(feeds, comm, _run=exe.run, _kind=kind):
                res = _run(feeds, comm)
                if trace and len(cpu) == trace - 1:  # --trace K: every call of step K
                    row(f"{_kind} (step {trace})")
                elif _kind not in seen:
                    seen.add(_kind)
                    row(f"first {_kind}")
                return res
            exe.run = wrapped
        for s in range(steps):
            t = time.thread_time()
            runner.step(feed, y)
            cpu.append(time.thread_time() - t)
            row(f"step {s + 1}")
        held = _held(runner)
    return {"model": name, "stage": stage, "programs": programs, "state_mib": state / MiB, "rows": rows,
            "held_mib": held, "predicted_mib": _predicted(plan, stage), "cpu_s": cpu, "stage_weights_mib": sum(runner.state[w].nbytes for w in runner.stage.weights) / MiB}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="mlp", choices=["mlp", "resnet", "bert"])
    p.add_argument("--stage", type=int, default=1)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--trace", type=int, default=0, metavar="K", help="a row after every call of step K")
    p.add_argument("--set", action="append", default=[], metavar="MODULE.ATTR=VALUE")
    args = p.parse_args(argv)
    CACHE.mkdir(exist_ok=True)
    from partitioner.training.bench import _with_settings
    from train_step import _settings

    doc = _with_settings(_settings(args.set) or {}, lambda: measure(args.model, args.stage, args.steps, args.trace))
    doc["settings"] = args.set
    for r in doc["rows"]:
        print(f"{r['after']:<12} rss {r['rss']:8.1f}  peak {r['peak']:8.1f} MiB")
    print(json.dumps({k: v for k, v in doc.items() if k != "rows"}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
