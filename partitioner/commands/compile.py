"""``partitioner compile MODEL -o DIR``: partition a model and build a deployable artifact directory.

The directory holds manifest.json (hashes of everything), plan.json, source.onnx, rank<i>.onnx and
the backend's per-rank files (docs/artifact_format.md). ``--fallback onnxruntime`` builds with
ONNX Runtime when the chosen backend fails, and records why in the manifest.
"""

from __future__ import annotations

import argparse
import sys

from partitioner.commands._options import (add_cluster_arguments, add_json_argument, add_model_arguments,
                                           add_strategy_arguments, cluster_from_args, load_model_from_args,
                                           parse_bytes, print_json)
from partitioner.core.errors import UsageError

NAME = "compile"
HELP = "partition a model and build an artifact directory (manifest, plan, per-rank programs and executables)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p)
    p.add_argument("-o", "--output", required=True, metavar="DIR", help="the artifact directory to write")
    add_cluster_arguments(p)
    add_strategy_arguments(p)
    p.add_argument("--backend", choices=("tvm", "onnxruntime"), default="tvm", help="per-rank backend (default tvm)")
    p.add_argument("--target", default=None, metavar="T", help="TVM target: a preset, JSON dict or 'host' (default)")
    p.add_argument("--fallback", choices=("onnxruntime",), default=None,
                   help="build with this backend when the chosen one fails")
    p.add_argument("--jobs", type=int, default=None, metavar="J", help="parallel build processes (default: cores)")
    p.add_argument("--tune-trials", type=int, default=None, metavar="N",
                   help="TVM: tune each distinct kernel with MetaSchedule for N trials (needs --tuning-db)")
    p.add_argument("--tuning-db", default=None, metavar="DIR",
                   help="TVM: the tuning database (shared across ranks and models, keyed by target); "
                        "with it alone, compile reuses what it holds without tuning")
    p.add_argument("--tvm-pipeline", choices=("scheduled", "zero"), default=None,
                   help="TVM: 'scheduled' (default CPU schedules, the default) or 'zero' (untuned)")
    p.add_argument("--conv-algorithm", choices=("direct", "im2col", "winograd", "auto"), default=None,
                   help="TVM on the CPU: how convolutions are computed; 'auto' (the default, or "
                        "$PARTITIONER_CONV_ALGORITHM) times each distinct conv with every eligible algorithm "
                        "once per machine and keeps the fastest (cached under ~/.cache/partitioner/tvm/)")
    p.add_argument("--sign-key", default=None, metavar="KEY.pem",
                   help="sign the artifact with this EC private key (writes DIR/model.sig; see `partitioner sign`)")
    add_json_argument(p)


def run(args: argparse.Namespace) -> int:
    from partitioner import signing
    from partitioner.compiler import compile as compile_artifact

    model, source = load_model_from_args(args, keep_source=True)  # `run --check` compares against source
    if args.tune_trials is not None and (args.tune_trials < 1 or not args.tuning_db):
        raise UsageError("--tune-trials N needs N >= 1 and --tuning-db DIR")
    if (args.tune_trials or args.tuning_db or args.tvm_pipeline or args.conv_algorithm) and args.backend != "tvm":
        raise UsageError("--tune-trials, --tuning-db, --tvm-pipeline and --conv-algorithm apply to --backend tvm only")
    if args.conv_algorithm not in (None, "direct") and args.tvm_pipeline == "zero":
        raise UsageError("--conv-algorithm needs the 'scheduled' TVM pipeline, not --tvm-pipeline zero")
    if args.backend == "tvm" and not args.conv_algorithm:
        from backends.tvm.conv_algorithms import default_algorithm

        default_algorithm()  # a bad $PARTITIONER_CONV_ALGORITHM fails now, in one line
    if args.sign_key:  # a bad key fails now, not after the build
        signing.load_private_key(args.sign_key)
    build_options = {k: v for k, v in (("tune_trials", args.tune_trials), ("tuning_db", args.tuning_db),
                                       ("pipeline", args.tvm_pipeline), ("conv_algorithm", args.conv_algorithm)) if v}
    art = compile_artifact(model, cluster_from_args(args), strategy=args.strategy, target=args.target,
                           backend=args.backend, microbatches=args.microbatches, objective=args.objective,
                           memory_limit=parse_bytes(args.memory_limit) if args.memory_limit else None,
                           out_dir=args.output, fallback=args.fallback, jobs=args.jobs, source=source,
                           source_path=args.model, progress=None if not args.json else False,
                           build_options=build_options or None)
    if args.sign_key:
        signing.sign_artifact(art.root, args.sign_key)
    m = art.manifest
    if args.json:
        print_json({"artifact": str(art.root), "world_size": m["world_size"], "microbatches": m["microbatches"],
                    "backend": m["backend"], "fallback": m["fallback"], "plan_summary": m["plan_summary"],
                    "prediction": m["prediction"], "files": m["files"],
                    "signature": signing.SIGNATURE if args.sign_key else None})
        return 0
    fallback = m.get("fallback") or {}
    if fallback.get("scope") == "segments":
        fb = f" with {len(fallback.get('segments', []))} segment(s) on {fallback['to']}"
    else:
        fb = f" (fell back from {fallback['from']}: {fallback['reason']})" if fallback else ""
    print(f"wrote {art.root}: {m['world_size']} rank(s), {m['microbatches']} micro-batch(es), "
          f"strategy {m['plan_summary'].get('strategy', '?')}, backend {m['backend']}{fb}"
          + (f", signed ({signing.SIGNATURE})" if args.sign_key else ""))
    for seg in fallback.get("segments", []) if fallback.get("scope") == "segments" else []:
        print(f"  rank {seg['rank']} segment {seg['segment']} runs on {fallback['to']}: "
              f"{', '.join(seg['op_types'])} (nodes {', '.join(seg['nodes'])}) in {seg['file']}")
    if m.get("explanation"):
        print(str(m["explanation"]).strip().splitlines()[0])
    sys.stdout.flush()
    return 0
