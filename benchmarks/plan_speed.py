"""How fast the cost model and the search answer: ``partitioner plan --json`` on a 48-layer zoo
gpt (thousands of nodes) for the ``h200:4x8`` cluster (32 GPUs on 4 nodes), per strategy.

Two figures per strategy, each the median of ``--repeat`` runs:
- ``cli_s``: the whole command in a fresh process (imports, load, passes, search, lowering,
  simulation, JSON), which is what a user waits for;
- ``partition_s``: ``partition()`` alone, in this process, on the already loaded model.

Writes ``benchmarks/results/plan_speed.json``; ``--markdown`` prints the README table from it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "plan_speed.json"
STRATEGIES = ("single", "data", "pipeline", "tensor", "hybrid", "auto")


def _cli() -> list[str]:
    return [sys.executable, "-m", "partitioner.cli"]


def run(args: argparse.Namespace) -> dict:
    import models_zoo
    import onnx
    from partitioner.cluster import Cluster
    from partitioner.core.errors import StrategyNotApplicable
    from partitioner.load import load
    from partitioner.partition import partition
    from passes import run_pipeline

    work = Path(tempfile.mkdtemp(prefix="plan-speed-"))
    path = work / "gpt48.onnx"
    onnx.save(models_zoo.build("gpt", layers=args.layers), path)
    model = run_pipeline(load(str(path)))
    cluster = Cluster.resolve(args.cluster)
    rows = []
    for strategy in STRATEGIES:
        row: dict = {"strategy": strategy}
        times = []
        try:
            for _ in range(args.repeat):
                t0 = time.perf_counter()
                res = partition(model, cluster, strategy=strategy)
                times.append(time.perf_counter() - t0)
            row.update(partition_s=statistics.median(times), chosen=res.plan.strategy,
                       world_size=res.plan.world_size,
                       predicted_latency_s=res.prediction["simulated"]["step_latency_s"])
        except StrategyNotApplicable as exc:
            row["not_applicable"] = str(exc)
            rows.append(row)
            continue
        cli = []
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            proc = subprocess.run(_cli() + ["plan", str(path), "--cluster", args.cluster, "--strategy", strategy,
                                            "--json"], capture_output=True, text=True, cwd=ROOT)
            cli.append(time.perf_counter() - t0)
            if proc.returncode != 0:
                raise SystemExit(f"plan --strategy {strategy} failed: {proc.stderr.strip()}")
        row["cli_s"] = statistics.median(cli)
        rows.append(row)
        print(json.dumps(row), flush=True)
    try:
        load_avg = list(os.getloadavg())
    except OSError:
        load_avg = None
    return {"benchmark": "plan_speed", "model": f"zoo gpt, {args.layers} layers", "nodes": len(list(model.graph)),
            "cluster": args.cluster, "repeat": args.repeat, "rows": rows,
            "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                        "load_average_1_5_15min": load_avg},
            "versions": {"python": platform.python_version()},
            "date": time.strftime("%Y-%m-%dT%H:%M:%S")}


def markdown(doc: dict) -> str:
    lines = [f"`plan --json` on the {doc['model']} ({doc['nodes']} nodes) for `{doc['cluster']}`, median of "
             f"{doc['repeat']}:", "",
             "| strategy | whole command s | partition() s | plan chosen | predicted step ms |",
             "|---|---:|---:|---|---:|"]
    for r in doc["rows"]:
        if "not_applicable" in r:
            lines.append(f"| {r['strategy']} | - | - | not applicable: {r['not_applicable']} | - |")
            continue
        lines.append(f"| {r['strategy']} | {r['cli_s']:.2f} | {r['partition_s']:.2f} | {r['chosen']} x{r['world_size']} | "
                     f"{r['predicted_latency_s'] * 1e3:.3f} |")
    la = doc["machine"].get("load_average_1_5_15min")
    lines.append("")
    lines.append(f"{doc['machine']['cores']} cores, load average {la[0]:.1f} during the run, {doc['date'][:10]}."
                 if la else f"{doc['machine']['cores']} cores, {doc['date'][:10]}.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--cluster", default="h200:4x8")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("-o", "--output", default=str(RESULTS))
    ap.add_argument("--markdown", action="store_true", help="print the README table from the JSON and exit")
    args = ap.parse_args(argv)
    if args.markdown:
        print(markdown(json.loads(Path(args.output).read_text())))
        return 0
    doc = run(args)
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(doc, indent=1) + "\n")
    print(markdown(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
