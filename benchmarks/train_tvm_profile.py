"""Per-kind predicted against measured time of the 1-rank TVM training step (issue 16: where the
training cost model's TVM step time misses; ``train_node_profile.py`` does the same on ONNX Runtime).

Builds the train_step.py model's 1-rank training step (SGD, its loss and batch) as a training rank
runs it (:class:`partitioner.training.runner.StepRunner`, one thread), steps it ``--steps`` times
hooked and as many times plain, interleaved, with every VM call timed in the calling thread's CPU
(``pipeline_runner_profile._KernelHook``; the hook adds 1-3 us a call, which lands mostly in
``builtins``), and prices every step node with the training cost model
(:func:`partitioner.cost.training.priced_step_nodes` on ``cpu:1``, this machine's cached TVM
calibration, or ``$PARTITIONER_CACHE_DIR``'s). TVM fuses nodes, so the two sides meet by kind,
not by node (:func:`kernel_kind`, :func:`node_kind`): the 3x3/1x1 convs forward and their input
gradients (TVM runs those as convs, with each call's weight packing), the conv weight
gradients' GEMMs and their im2col copies, the stem's Conv-form weight gradient, the MaxPool
gradient, the optimizer, VM builtins and the rest. Prints per kind measured, predicted and their
difference, the plain step's median and the kernels' sum. ``--json`` keeps both sides.

    .venv/bin/python benchmarks/train_tvm_profile.py [--model resnet] [--steps 5] [--json F]
    .venv/bin/python benchmarks/train_tvm_profile.py --json F --reprice   # the prediction again, on F's kernels
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


def kernel_kind(symbol: str, shapes: str) -> str:
    """The kind of a TVM kernel of the 1-rank step, from its symbol and first call's shapes."""
    s = symbol.split(":")[-1]
    if s.startswith("vm.builtin"):
        return "builtins"
    if not symbol.startswith("seg0:") and ":" in symbol:
        return "optimizer"  # the update's own library (overlap rule 9)
    if "conv2d" in s and shapes.startswith("3x"):
        return "stem weight gradient"
    if "argmax" in s or shapes.startswith("1024x") or " 1024x" in shapes:
        return "maxpool gradient"
    if "conv2d" in s or ("weight_prepack" in s and "matmul" not in s):
        return "conv forward + input gradient"
    if "matmul" in s:
        return "weight gradient GEMM + fc"
    if "strided_slice" in s and "pad" in s:
        return "im2col"
    if "take" in s or ("pad" in s and "reshape" in s):
        return "input gradient filter"
    return "other"


def node_kind(node: Any, key: str | None) -> str:
    """The kind of a step node (:func:`kernel_kind`'s kinds) from its op, role and shapes."""
    backward = key is not None and key not in ("loss", "optimizer")
    x = node.inputs[0] if node.inputs else None
    if key == "optimizer":
        return "optimizer"
    if node.op_type == "Conv" and backward and x is not None and x.shape is not None and x.shape[0] == 3:
        return "stem weight gradient"
    if (key or node.name).startswith("stem.maxpool") or "maxpool" in (key or ""):
        return "maxpool gradient"
    if node.op_type in ("Conv", "ConvTranspose"):
        return "conv forward + input gradient"
    if node.op_type in ("MatMul", "Gemm"):
        return "weight gradient GEMM + fc"
    if backward and node.op_type in ("Concat", "Slice", "Pad", "Unsqueeze"):
        return "im2col"
    return "other"


def predicted(model_name: str) -> dict[str, float]:
    """Seconds per kind of the step's nodes under the training cost model (``cpu:1``, TVM)."""
    import models_zoo
    from partitioner.cluster import resolve_cluster
    from partitioner.cost.training import priced_step_nodes
    from partitioner.training.optimizers import SGD
    from partitioner.training.step import build_training_graph
    from train_step import CASES

    kwargs, loss = CASES[model_name]
    step = build_training_graph(models_zoo.build(model_name, **kwargs), loss=loss, optimizer=SGD(lr=1e-3),
                                batch=kwargs["batch"])
    out: dict[str, float] = defaultdict(float)
    for node, key, t in priced_step_nodes(step.graph, resolve_cluster("cpu:1", "tvm").devices[0]):
        out[node_kind(node, key)] += t
    return dict(out)


def measured(model_name: str, steps: int) -> dict[str, Any]:
    """Kernel thread CPU per symbol (median of the hooked steps) and the plain steps' median."""
    import pipeline_stages
    from pipeline_runner_profile import _KernelHook
    from partitioner.training.optimizers import SGD
    from partitioner.training.runner import StepRunner
    from partitioner.training.step import build_training_graph

    model, loss, _, feed, y = pipeline_stages.case(model_name)
    with tempfile.TemporaryDirectory() as tmp:
        runner = StepRunner(build_training_graph(model, loss=loss, optimizer=SGD(lr=1e-3)), backend="tvm",
                            workdir=tmp)
        hook = _KernelHook(runner)
        runner.step(feed, y)  # warm-up
        plain, hooked = [], []
        for i in range(2 * steps):
            hook.on(bool(i % 2))
            hook.sec.clear()
            t = time.thread_time()
            runner.step(feed, y)
            dt = time.thread_time() - t
            hook.on(False)
            (hooked.append(dict(hook.sec)) if i % 2 else plain.append(dt))
    symbols = set().union(*hooked)
    return {"plain_step_s": statistics.median(plain),
            "kernels": {s: {"s": statistics.median(h.get(s, 0.0) for h in hooked), "shapes": hook.shapes.get(s, "")}
                        for s in symbols}}


def report(doc: dict[str, Any]) -> None:
    meas: dict[str, float] = defaultdict(float)
    for sym, rec in doc["kernels"].items():
        meas[kernel_kind(sym, rec["shapes"])] += rec["s"]
    pred = doc["predicted"]
    print(f"{doc['model']} 1-rank TVM step, thread CPU ms (load {doc['load'][0]:.2f}): plain step "
          f"{doc['plain_step_s'] * 1e3:.1f}, kernels (hooked) {sum(meas.values()) * 1e3:.1f}, predicted nodes "
          f"{sum(pred.values()) * 1e3:.1f}")
    print(f"  {'kind':32s} {'measured':>9s} {'predicted':>10s} {'pred-meas':>10s}")
    for k in sorted(set(meas) | set(pred), key=lambda k: -(pred.get(k, 0.0) - meas.get(k, 0.0))):
        m, p = meas.get(k, 0.0) * 1e3, pred.get(k, 0.0) * 1e3
        print(f"  {k:32s} {m:9.2f} {p:10.2f} {p - m:+10.2f}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="resnet", choices=["mlp", "resnet", "bert"])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--reprice", action="store_true", help="price again the kernels --json recorded")
    args = ap.parse_args(argv)
    if args.reprice:
        doc = json.loads(args.json.read_text())
        doc["predicted"] = predicted(doc["model"])
    else:
        doc = {"model": args.model, **measured(args.model, args.steps), "load": list(os.getloadavg()),
               "predicted": predicted(args.model)}
        if args.json:
            args.json.write_text(json.dumps(doc, indent=1) + "\n")
    report(doc)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
