"""``partitioner run DIR --inputs in.npz``: run an artifact under mpiexec (one process per rank).

``--check`` compares every output with ONNX Runtime on the artifact's source model and exits 1
when one is over tolerance (``|got - want| <= atol + rtol * |want|``). Bad inputs exit 2 naming
the input; a failed rank exits 1 naming the rank.
"""

from __future__ import annotations

import argparse
import sys

from partitioner.commands._options import add_json_argument, print_json
from partitioner.core.errors import RunFailed, UsageError

NAME = "run"
HELP = "run an artifact on inputs from an .npz file (mpiexec, one process per rank)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("artifact", metavar="DIR", help="the artifact directory")
    p.add_argument("--inputs", default=None, metavar="NPZ",
                   help="the inputs (.npz, one array per model input); without it, seeded random inputs (--seed)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs used when --inputs is not given")
    p.add_argument("--outputs", default=None, metavar="NPZ", help="write the outputs here (.npz)")
    p.add_argument("--check", action="store_true", help="compare with ONNX Runtime on the source model")
    p.add_argument("--rtol", type=float, default=1e-4, help="relative tolerance of --check (default 1e-4)")
    p.add_argument("--atol", type=float, default=1e-5, help="absolute tolerance of --check (default 1e-5)")
    p.add_argument("--microbatches", type=int, default=None, metavar="M",
                   help="must equal the artifact's (micro-batching is fixed at compile time)")
    p.add_argument("--ranks-per-host", type=int, default=None, metavar="N", help="ranks per host (mpiexec -ppn)")
    p.add_argument("--in-process", action="store_true", help="run the ranks as threads, without MPI")
    p.add_argument("--timeout", type=float, default=None, metavar="S", help="stop the whole run after S seconds")
    from partitioner.signing import add_trusted_key_argument

    add_trusted_key_argument(p)
    add_json_argument(p)


def run(args: argparse.Namespace) -> int:
    from partitioner import signing
    from partitioner.compiler import load_artifact

    signing.check_trusted(args.artifact, args.trusted_key)
    art = load_artifact(args.artifact)
    from backends.cuda_devices import require_matching_gpu

    require_matching_gpu(art.manifest, args.artifact)  # a GPU build here without its GPU: one line, exit 2
    if args.microbatches is not None and args.microbatches != art.microbatches:
        raise UsageError(f"--microbatches {args.microbatches}: {args.artifact} was compiled for "
                         f"{art.microbatches}; recompile with --microbatches {args.microbatches}")
    if args.ranks_per_host is not None and args.ranks_per_host < 1:
        raise UsageError("--ranks-per-host must be at least 1")
    if args.inputs is None:
        from partitioner.core.bindings import seeded_inputs

        inputs = seeded_inputs(art.bindings, args.seed)
        print(f"no --inputs: using seeded random inputs (seed {args.seed})", file=sys.stderr)
    else:
        inputs = args.inputs
    result = art.run(inputs, check=args.check, ranks_per_host=args.ranks_per_host, in_process=args.in_process,
                     timeout=args.timeout, rtol=args.rtol, atol=args.atol, outputs=args.outputs)
    if args.json:
        print_json({"artifact": args.artifact, "outputs_file": args.outputs, **result.to_json()})
    else:
        for name, v in result.outputs.items():
            print(f"{name}: {v.dtype}{list(v.shape)}")
        if result.check is not None:
            if result.check.skipped:
                print(result.check.skipped, file=sys.stderr)
            for o in result.check.outputs:
                status = "ok" if o.ok else "MISMATCH"
                print(f"check {o.name}: max abs {o.max_abs:.3g}, max rel {o.max_rel:.3g} {status}"
                      + (f" ({o.note})" if o.note else ""))
        print(f"ran {art.world_size} rank(s) in {result.wall_s:.2f} s" + (f", outputs in {args.outputs}" if args.outputs else ""))
    if result.check is not None and not result.check.ok:
        bad = [o.name for o in result.check.outputs if not o.ok]
        raise RunFailed(f"outputs differ from ONNX Runtime beyond rtol {args.rtol:g} / atol {args.atol:g}: "
                        f"{', '.join(bad)}")
    return 0
