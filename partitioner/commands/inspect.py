"""``partitioner inspect MODEL``: op histogram, parameters, FLOPs, bytes, work/depth, memory.

JSON keys (``--json``) are documented in README.md ("inspect --json").
"""

from __future__ import annotations

import argparse

from partitioner.commands._options import (add_json_argument, add_model_arguments, add_shapes_only_argument,
                                           load_model_from_args, print_json)

NAME = "inspect"
HELP = "show a model's operators, parameters, FLOPs, bytes, work W, depth D and peak activation memory"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p)
    add_shapes_only_argument(p)
    add_json_argument(p)
    p.add_argument("--ops", action="store_true", help="include the per-op table (always in --json)")
    p.add_argument("--top", type=int, default=10, metavar="K", help="show the K most expensive ops (default 10)")
    p.add_argument("--train", action="store_true",
                   help="also the training step's forward/backward/optimizer FLOPs, work and depth (docs/training.md)")
    p.add_argument("--loss", default="cross_entropy", choices=("cross_entropy", "mse"), help="loss for --train")


def inspect_model(model) -> dict:
    """The report as a plain dict (the ``--json`` document)."""
    from partitioner.cost.workdepth import analyze

    stats = analyze(model)
    g = model.graph
    report = {
        "model": g.name,
        "inputs": [_value_json(v) for v in g.inputs if not v.is_initializer()],
        "outputs": [_value_json(v) for v in g.outputs],
        "opset": {k or "ai.onnx": v for k, v in model.opset_imports.items()},
    }
    report.update(stats.to_json(with_ops=True))
    return report


def _value_json(v) -> dict:
    return {"name": v.name, "dtype": str(v.dtype.numpy()) if v.dtype is not None else None,
            "shape": [int(d) if isinstance(d, int) else str(d) for d in v.shape] if v.shape is not None else None}


def _human(n: float, unit: str = "") -> str:
    for scale, suffix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= scale:
            return f"{n / scale:.3g} {suffix}{unit}"
    return f"{n:.3g} {unit}".rstrip()


def run(args: argparse.Namespace) -> int:
    model = load_model_from_args(args)
    report = inspect_model(model)
    if getattr(args, "train", False):
        from partitioner.training.analysis import training_stats

        report["train"] = training_stats(model, loss=args.loss)
    if args.json:
        print_json(report)
        return 0
    print(f"model       {report['model']}  (opset {report['opset']})")
    for io in ("inputs", "outputs"):
        for v in report[io]:
            print(f"{io[:-1]:<11} {v['name']}: {v['dtype']}{v['shape']}")
    print(f"nodes       {report['num_nodes']}")
    print(f"parameters  {_human(report['param_count'])} ({_human(report['param_bytes'], 'B')})")
    print(f"FLOPs       {_human(report['total_flops'], 'FLOP')}   bytes moved {_human(report['total_bytes'], 'B')}")
    print(f"work W      {_human(report['work'])}   depth D {report['depth']:.4g}   "
          f"average parallelism W/D {_human(report['parallelism'])}")
    print(f"peak activation memory  {_human(report['peak_activation_bytes'], 'B')}")
    hist = sorted(report["op_histogram"].items(), key=lambda kv: (-kv[1], kv[0]))
    print("op histogram  " + ", ".join(f"{k} {v}" for k, v in hist))
    ops = sorted(report["ops"], key=lambda o: -o["flops"])
    shown = ops if args.ops else ops[: args.top]
    if shown:
        print(f"\n{'op':<40} {'type':<22} {'FLOPs':>12} {'bytes':>12} {'depth':>6}")
        for o in shown:
            print(f"{o['name'][:40]:<40} {o['op_type']:<22} {_human(o['flops']):>12} {_human(o['bytes'], 'B'):>12} {o['depth']:>6.3g}")
    if "train" in report:
        print(f"\ntraining step ({args.loss}, SGD)  {'nodes':>6} {'FLOPs':>12} {'work W':>12} {'depth D':>10}")
        for part in ("forward", "loss", "backward", "optimizer"):
            t = report["train"][part]
            print(f"{part:<28} {t['nodes']:>6} {_human(t['flops']):>12} {_human(t['work']):>12} {t['depth']:>10.4g}")
        r = report["train"]["backward_over_forward"]
        print("backward / forward          " + "  ".join(f"{k} {v:.2f}x" for k, v in r.items() if v is not None))
    return 0
