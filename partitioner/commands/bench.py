"""``partitioner bench DIR``: measure an artifact against ONNX Runtime (and a 1-rank build).

The measurement and its rules live in :mod:`partitioner.bench`.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from partitioner.bench import bench_artifact, format_table
from partitioner.commands._options import add_json_argument, print_json
from partitioner.core.errors import UsageError

NAME = "bench"
HELP = "benchmark an artifact: median latency and throughput against ONNX Runtime (and a 1-rank build)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("artifact", metavar="DIR", help="the artifact directory")
    p.add_argument("--baseline", choices=("onnxruntime", "single"), default="onnxruntime",
                   help="onnxruntime: ONNX Runtime on the source model; single: that, plus a 1-rank build")
    p.add_argument("--repeat", type=int, default=10, metavar="N", help="timed runs (default 10)")
    p.add_argument("--warmup", type=int, default=2, metavar="K", help="untimed warm-up runs (default 2)")
    p.add_argument("--inputs", default=None, metavar="NPZ", help="inputs (default: seeded random inputs)")
    p.add_argument("--ranks-per-host", type=int, default=None, metavar="N", help="ranks per host")
    p.add_argument("--single-threads", type=int, default=None, metavar="T",
                   help="threads of the 1-rank build (default: the partitioned run's total)")
    p.add_argument("-o", "--output", default=None, metavar="JSON", help="write the results as JSON here")
    from partitioner.signing import add_trusted_key_argument

    add_trusted_key_argument(p)
    add_json_argument(p)


def run(args: argparse.Namespace) -> int:
    if args.single_threads is not None and args.single_threads < 1:
        raise UsageError("--single-threads must be at least 1")
    from partitioner import signing

    if signing.check_trusted(args.artifact, args.trusted_key) and args.baseline == "single":
        raise UsageError("--baseline single builds an unsigned artifact, which the trusted key would refuse; "
                         "bench a signed artifact with the default baseline")
    doc = bench_artifact(args.artifact, baseline=args.baseline, repeat=args.repeat, warmup=args.warmup,
                         inputs=args.inputs, ranks_per_host=args.ranks_per_host, single_threads=args.single_threads)
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps(doc, indent=2, default=str) + "\n")
    if args.json:
        print_json(doc)
    else:
        print(format_table(doc))
    return 0
