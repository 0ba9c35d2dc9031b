"""Per-kernel CPU of a pipeline stage's TVM programs at the micro-batch against the same stage's
programs at a micro-batch of the whole batch (issue 16: where small micro-batches lose kernel
efficiency).

Builds the train_step.py model's 2-stage 1F1B x8 TVM plan twice: at the model's batch (``B / 8``
a micro-batch: the zoo resnet's 2 images) and at 8 times it (the model's whole batch a
micro-batch), each stage program (``F``, ``B``, ``FB``) with ``kernel_profile.build_ours`` (the
scheduled pipeline, one thread, the default ``conv_algorithm``, weights as inputs: their
per-call transforms are counted on both sides, where a training rank lifts them once a step),
feeds seeded random inputs of each program's shapes, and times every kernel call with the
calling thread's CPU (a VM instrument hook, median over ``--runs`` runs; the hook's 1-2 us per
call lands in the VM builtins, class ``other``). Kernels are grouped by
``kernel_profile.tir_kernel_info``'s class and layer key (a conv's channels and output map: a
weight gradient computed as a conv over the batch has the batch in its key, so it matches by
class only). The whole-batch plan is cut by the micro-batch plan's measured node times (the same
stage). Prints per class and per key the micro-batch programs x8 beside the whole-batch programs
once (the same images) and their ratio, and whether both stages hold the same weights.
On a loaded machine the ratios, not the values, are the finding.

    .venv/bin/python benchmarks/pipeline_kernels.py --model resnet --stage 0 [--runs 3] [--top 20]
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))


def feeds_for(program, seed: int = 0) -> dict[str, np.ndarray]:
    """Seeded inputs of ``program``'s shapes (those without an initializer): floats ~N(0, 0.1),
    integers 0."""
    import onnx

    rng = np.random.default_rng(seed)
    out = {}
    consts = {t.name for t in program.graph.initializer}  # bound by the build, not arguments
    for vi in [v for v in program.graph.input if v.name not in consts]:
        t = vi.type.tensor_type
        shape = [d.dim_value for d in t.shape.dim]
        dtype = onnx.helper.tensor_dtype_to_np_dtype(t.elem_type)
        out[vi.name] = ((rng.standard_normal(shape) * 0.1).astype(dtype) if np.issubdtype(dtype, np.floating)
                        else np.zeros(shape, dtype))
    return out


def per_key(calls: list[tuple[str, float]], infos: dict[str, dict]) -> dict[str, float]:
    """Seconds per kernel key (class, layer or name without its numeric suffix)."""
    out: dict[str, float] = defaultdict(float)
    for sym, sec in calls:
        info = infos.get(sym, {"class": "other", "layer": None})
        name = re.sub(r"\d+$", "", sym).rstrip("_")
        out[f"{info['class']:9s} {info['layer'] or name}"] += sec
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="resnet", choices=["mlp", "resnet", "bert"])
    p.add_argument("--stage", type=int, default=0)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--top", type=int, default=25)
    args = p.parse_args(argv)
    import models_zoo
    import pipeline_stages
    from kernel_profile import build_ours, profile_ours
    from train_step import CASES
    from backends.tvm.target import resolve_target
    from partitioner.training import SGD
    from partitioner.training.pipeline import build_pipeline

    model, loss, batch, _, _ = pipeline_stages.case(args.model)
    m = pipeline_stages.MICRO_BATCHES
    target = resolve_target(None)
    sides = {}
    from partitioner.training import measured_cut

    measure, kept = measured_cut.shared_node_seconds, []

    def same_cut(*a, **k):  # the whole-batch plan cuts by the micro-batch plan's measured node times
        if not kept:
            kept.append(measure(*a, **k))
        return kept[0]

    measured_cut.shared_node_seconds = same_cut
    for label, global_batch in (("micro", batch), ("whole", batch * m)):  # micro-batch batch/m, then batch
        big = model if global_batch == batch else models_zoo.build(args.model, **{**CASES[args.model][0],
                                                                                  "batch": global_batch})
        plan = build_pipeline(big, loss, SGD(lr=1e-3), batch=global_batch, stages=2, micro_batches=m,
                              schedule="1f1b", backend="tvm")
        st = plan.stages[args.stage]
        progs = {k: v for k, v in (("F", st.forward), ("B", st.backward), ("FB", st.fused)) if v is not None}
        calls: dict[str, float] = defaultdict(float)
        classes: dict[str, float] = defaultdict(float)
        for k, prog in progs.items():
            ex, infos = build_ours(prog, target, threads=1)
            (timed,) = profile_ours([ex], feeds_for(prog), args.runs)
            for key, sec in per_key(timed, infos).items():
                calls[key] += sec * (m if label == "micro" else 1)
                classes[key.split()[0]] += sec * (m if label == "micro" else 1)
            print(f"{label} ({plan.micro_batch} a micro-batch) {k}: {sum(per_key(timed, infos).values()) * 1e3:.1f} ms a "
                  f"call, weights {len(st.weights)}", flush=True)
        sides[label] = (calls, classes, sorted(st.weights))
    (mc, mcl, mw), (wc, wcl, ww) = sides["micro"], sides["whole"]
    print(f"\n{args.model} stage {args.stage}: F + B at {batch // m} a call x{m} against the same stage's programs at "
          f"{batch} a call once (ms per step of {batch}; same weights: {mw == ww}; load {os.getloadavg()[0]:.1f})")
    print(f"{'class':12s} {'micro':>8s} {'whole':>8s} {'ratio':>6s}")
    for c in sorted(mcl, key=lambda c: -(mcl[c] - wcl.get(c, 0.0))):
        print(f"{c:12s} {mcl[c] * 1e3:8.2f} {wcl.get(c, 0.0) * 1e3:8.2f} {mcl[c] / wcl[c] if wcl.get(c) else float('nan'):6.2f}")
    print(f"{'kernel':60s} {'micro':>8s} {'whole':>8s} {'ratio':>6s}")
    for key in sorted(mc, key=lambda k: -(mc[k] - wc.get(k, 0.0)))[:args.top]:
        o = wc.get(key)
        print(f"{key[:60]:60s} {mc[key] * 1e3:8.2f} {o * 1e3 if o else float('nan'):8.2f} "
              f"{mc[key] / o if o else float('nan'):6.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
