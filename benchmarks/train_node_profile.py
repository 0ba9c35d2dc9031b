"""Per-node predicted against measured time of a training step on ONNX Runtime (issue 16: where
the training cost model's step time misses).

Builds the zoo model's 1-rank training step at ``--batch`` (SGD, the loss of
``benchmarks/train_step.py``), runs it in one ONNX Runtime session as a training rank does (one
intra-op thread, default graph optimisations, the state fed as inputs) with the node profiler on,
and puts each step node's median measured time beside the cost model's price for it (the
roofline with the class the training cost model gives it: :func:`partitioner.cost.training.step_times`'
rule). Prints the totals per op type (measured, predicted, ratio) and the nodes with the largest
absolute miss. ORT fuses some nodes (their profile names differ); those are listed as
``[ORT] <op>`` and the nodes they absorbed count as unmeasured. On a loaded machine the ratios,
not the values, are the finding.

    .venv/bin/python benchmarks/train_node_profile.py --model resnet [--batch 16] [--runs 5] [--top 15]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))


def predicted_per_node(step_graph, device) -> dict[str, tuple[str, float, float]]:
    """Step node name -> (op type, predicted seconds, bytes), with the training cost model's classes."""
    from partitioner.cost.roofline import fused_nodes, op_time
    from partitioner.cost.training import FORWARD_NODE_KEY, node_class
    from partitioner.cost.workdepth import constant_values, node_costs

    fused = fused_nodes(step_graph)
    out = {}
    for node, c in zip(step_graph, node_costs(step_graph, constant_values(step_graph))):
        key = node.metadata_props.get(FORWARD_NODE_KEY)
        backward = key is not None and key not in ("loss", "optimizer")
        cls = node_class(device, node, backward)
        out[node.name] = (node.op_type, op_time(c, device, "float32", cls, node in fused, working_set=True), c.bytes)
    return out


def measured_per_node(program, feeds, runs: int, tmp: Path) -> dict[str, tuple[str, float]]:
    """ORT node name -> (op, median seconds) over ``runs`` profiled runs after a warm-up."""
    import json

    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads, so.inter_op_num_threads = 1, 1
    so.enable_profiling = True
    so.profile_file_prefix = str(tmp / "prof")
    sess = ort.InferenceSession(program.SerializeToString(), so, providers=["CPUExecutionProvider"])
    for _ in range(2 + runs):
        sess.run(None, feeds)
    per: dict[tuple[str, str], list[float]] = defaultdict(list)
    for e in json.loads(Path(sess.end_profiling()).read_text()):
        if e.get("cat") == "Node" and e.get("name", "").endswith("_kernel_time"):
            per[(e["name"][:-len("_kernel_time")], e["args"].get("op_name", ""))].append(e["dur"] * 1e-6)
    return {name: (op, statistics.median(d[-runs:])) for (name, op), d in per.items()}


def main(argv: list[str] | None = None) -> int:
    import numpy as np

    import models_zoo
    from partitioner.cluster import resolve_cluster
    from partitioner.training.optimizers import make_optimizer
    from partitioner.training.step import build_training_graph, initial_state, signature, step_program
    from train_step import CASES

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="resnet", choices=sorted(CASES))
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--top", type=int, default=15)
    args = ap.parse_args(argv)
    kwargs, loss = CASES[args.model]
    batch = args.batch or kwargs["batch"]
    model = models_zoo.build(args.model, **{**kwargs, "batch": batch})
    step = build_training_graph(model, loss=loss, optimizer=make_optimizer("sgd", 1e-3), batch=batch)
    device = resolve_cluster("cpu:1", "onnxruntime").devices[0]
    pred = predicted_per_node(step.graph, device)
    program = step_program(step)
    sig = signature(step)
    rng = np.random.default_rng(0)
    feeds = dict(initial_state(step))
    for v in program.graph.input:
        if v.name in feeds:
            continue
        shape = [d.dim_value for d in v.type.tensor_type.shape.dim]
        if v.name == sig.labels and loss == "cross_entropy":
            feeds[v.name] = rng.integers(0, 10, shape).astype(np.int64)
        elif v.type.tensor_type.elem_type == 7:
            feeds[v.name] = rng.integers(0, 50, shape).astype(np.int64)
        else:
            feeds[v.name] = rng.standard_normal(shape).astype(np.float32)
    with tempfile.TemporaryDirectory() as tmp:
        meas = measured_per_node(program, feeds, args.runs, Path(tmp))
    report(pred, meas, args.top)
    return 0


def report(pred: dict[str, tuple[str, float, float]], meas: dict[str, tuple[str, float]], top: int) -> None:
    by_op: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0])
    rows = []
    for name, (op, t) in meas.items():
        p = pred.get(name)
        key = op if p is not None else f"[ORT] {op}"
        by_op[key][0] += t
        by_op[key][1] += p[1] if p else 0.0
        by_op[key][2] += 1
        rows.append((t - (p[1] if p else 0.0), name, op, t, p[1] if p else 0.0, p[2] if p else 0.0))
    unmeasured = sum(t for n, (_, t, _) in pred.items() if n not in meas)
    tm, tp = sum(v[0] for v in by_op.values()), sum(v[1] for v in by_op.values())
    print(f"step: measured {tm * 1e3:.1f} ms (node sum), predicted {tp * 1e3:.1f} ms for the same nodes, "
          f"{unmeasured * 1e3:.1f} ms predicted for nodes ORT fused or skipped")
    print(f"{'op':<28}{'n':>5}{'measured ms':>13}{'predicted ms':>14}{'ratio':>8}")
    for op, (m, p, n) in sorted(by_op.items(), key=lambda kv: -(kv[1][0] - kv[1][1])):
        print(f"{op:<28}{n:>5}{m * 1e3:>13.2f}{p * 1e3:>14.2f}{(m / p if p else float('inf')):>8.2f}")
    print(f"\nlargest misses (measured - predicted):")
    for miss, name, op, t, p, b in sorted(rows, reverse=True)[:top]:
        print(f"  {name[:60]:<60} {op:<18} {t * 1e3:8.3f} {p * 1e3:8.3f} ms  {b / 2**20:7.2f} MiB")


if __name__ == "__main__":
    raise SystemExit(main())
