"""``partitioner plan MODEL``: choose a partition plan and print the predicted costs."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from partitioner.commands._options import (add_cluster_arguments, add_json_argument, add_model_arguments,
                                           add_strategy_arguments, cluster_from_args, load_model_from_args,
                                           parse_bytes, print_json)

NAME = "plan"
HELP = "choose a partition plan for a model on a cluster and print its predicted costs"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p)
    add_cluster_arguments(p)
    add_strategy_arguments(p)
    add_json_argument(p)
    p.add_argument("--html", default=None, metavar="FILE", help="write an HTML report (graph coloured by device)")
    p.add_argument("--export-onnx", default=None, metavar="DIR", help="write rank<i>.onnx and plan.json to DIR")


def run(args: argparse.Namespace) -> int:
    from partitioner.partition import partition

    model = load_model_from_args(args)
    cluster = cluster_from_args(args)
    limit = parse_bytes(args.memory_limit) if args.memory_limit else None
    res = partition(model, cluster, strategy=args.strategy, microbatches=args.microbatches,
                    objective=args.objective, memory_limit=limit)
    if args.export_onnx:
        out = Path(args.export_onnx)
        out.mkdir(parents=True, exist_ok=True)
        for r, prog in enumerate(res.programs):
            (out / f"rank{r}.onnx").write_bytes(prog.SerializeToString())
        (out / "plan.json").write_text(json.dumps(res.plan.to_json(), indent=1) + "\n", encoding="utf-8")
        (out / "bindings.json").write_text(json.dumps(res.bindings.to_json(), indent=1) + "\n", encoding="utf-8")
    if args.html:
        _write_html(args.html, model, res, cluster)
    if args.json:
        print_json({"model": args.model, "cluster": cluster.name, **res.to_json()})
        return 0
    pred = res.prediction
    print(f"strategy: {res.plan.strategy}  world size {res.plan.world_size}  mesh {list(res.plan.mesh_shape)} "
          f"{list(res.plan.mesh_axes)}  micro-batches {res.plan.microbatches}")
    print(f"{'rank':>4} {'compute ms':>11} {'comm ms':>9} {'idle ms':>9} {'memory MiB':>11}")
    for d in pred["per_device"]:
        print(f"{d['rank']:>4} {d['compute_s'] * 1e3:>11.3f} {d['comm_s'] * 1e3:>9.3f} {d['idle_s'] * 1e3:>9.3f} "
              f"{d['peak_memory_bytes'] / 2**20:>11.2f}")
    print(f"latency {pred['latency_s'] * 1e3:.3f} ms   throughput {pred['throughput_samples_per_s']:.1f} samples/s   "
          f"fits memory: {pred['fits_memory']}")
    print(res.explanation)
    return 0


def _write_html(path: str, model, res, cluster) -> None:
    try:
        from partitioner.cost.report_html import render_report  # written by another helper
    except ImportError:
        render_report = None
    if render_report is not None:
        try:
            html = render_report(model=model, plan=res.plan, prediction=res.prediction, cluster=cluster)
            Path(path).write_text(html, encoding="utf-8")
            return
        except TypeError:
            pass
    import html as h

    rows = "".join(f"<tr><td>{h.escape(n)}</td><td style='background:hsl({(p.ranks[0] * 67) % 360},70%,80%)'>"
                   f"{list(p.ranks)}</td><td>{p.stage}</td><td>{p.rule}</td></tr>" for n, p in res.plan.nodes.items())
    Path(path).write_text(
        f"<!doctype html><html><head><meta charset='utf-8'><title>partition plan</title></head><body>"
        f"<h1>{h.escape(res.plan.strategy)} on {h.escape(cluster.name)}</h1><p>{h.escape(res.explanation)}</p>"
        f"<pre>{h.escape(json.dumps(res.prediction, indent=1))}</pre>"
        f"<table border=1><tr><th>node</th><th>ranks</th><th>stage</th><th>rule</th></tr>{rows}</table></body></html>",
        encoding="utf-8")
