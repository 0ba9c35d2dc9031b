"""``partitioner plan MODEL``: choose a partition plan and print the predicted costs."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from partitioner.commands._options import (add_cluster_arguments, add_json_argument, add_model_arguments,
                                           add_shapes_only_argument, add_strategy_arguments, cluster_from_args,
                                           load_model_from_args, parse_bytes, print_json)

NAME = "plan"
HELP = "choose a partition plan for a model on a cluster and print its predicted costs"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p)
    add_shapes_only_argument(p)
    add_cluster_arguments(p)
    add_strategy_arguments(p)
    add_json_argument(p)
    p.add_argument("--html", default=None, metavar="FILE", help="write an HTML report (graph coloured by device)")
    p.add_argument("--export-onnx", default=None, metavar="DIR", help="write rank<i>.onnx and plan.json to DIR")
    p.add_argument("--simulate", action="store_true",
                   help="always lower every rank and simulate the programs (by default a plan over "
                        "150k node copies, ranks x nodes, is predicted analytically only)")


def run(args: argparse.Namespace) -> int:
    from partitioner.partition import partition

    model = load_model_from_args(args)
    cluster = cluster_from_args(args)
    limit = parse_bytes(args.memory_limit) if args.memory_limit else None
    lower = True if (args.simulate or args.export_onnx or args.html) else None
    res = partition(model, cluster, strategy=args.strategy, microbatches=args.microbatches,
                    objective=args.objective, memory_limit=limit, lower=lower)
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
    sim = res.prediction["simulated"]
    if sim is None:
        _print_estimate(res, cluster)
        return 0
    print(f"strategy: {res.plan.strategy}  world size {res.plan.world_size}  mesh {list(res.plan.mesh_shape)} "
          f"{list(res.plan.mesh_axes)}  micro-batches {res.plan.microbatches}  cluster {cluster.name}")
    print(f"{'rank':>4} {'device':<14} {'compute ms':>11} {'comm ms':>9} {'idle ms':>9} {'memory MiB':>11}")
    for d in sim["ranks"]:
        print(f"{d['rank']:>4} {d['device'][:14]:<14} {d['compute_s'] * 1e3:>11.3f} {d['comm_s'] * 1e3:>9.3f} "
              f"{d['idle_s'] * 1e3:>9.3f} {d['peak_memory_bytes'] / 2**20:>11.2f}")
    print(f"latency {sim['step_latency_s'] * 1e3:.3f} ms   throughput {sim['throughput_samples_per_s']:.1f} samples/s   "
          f"fits memory: {sim['fits']}   (simulated on the lowered programs)")
    levels = ", ".join(f"{k} {v / 2**20:.2f} MiB" for k, v in sim["bytes_per_level"].items())
    if levels:
        print(f"bytes moved per step: {levels}")
    print(res.explanation)
    return 0


def _print_estimate(res, cluster) -> None:
    """The analytical prediction, for a plan that was not lowered (``partition(lower=None)``)."""
    pred = res.prediction
    print(f"strategy: {res.plan.strategy}  world size {res.plan.world_size}  mesh {list(res.plan.mesh_shape)} "
          f"{list(res.plan.mesh_axes)}  micro-batches {res.plan.microbatches}  cluster {cluster.name}")
    devices = pred["per_device"]
    fullest = max(devices, key=lambda d: d["peak_memory_bytes"])
    print(f"latency {pred['latency_s'] * 1e3:.3f} ms   throughput {pred['throughput_samples_per_s']:.1f} samples/s   "
          f"fits memory: {pred['fits_memory']}   fullest device: rank {fullest['rank']} "
          f"{fullest['peak_memory_bytes'] / 2**30:.2f} GiB")
    print(res.explanation)


def _write_html(path: str, model, res, cluster) -> None:
    """The report: predicted timeline (Gantt), memory against capacity, bytes per link, and the
    graph coloured by device. Self-contained: inline SVG and CSS, no network."""
    from partitioner.report_graph import plan_report_html

    html = plan_report_html(model, res, cluster)
    try:
        Path(path).write_text(html, encoding="utf-8")
    except OSError as exc:
        from partitioner.core.errors import UsageError

        raise UsageError(f"cannot write the report to {path}: {exc.strerror}") from None
