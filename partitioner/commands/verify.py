"""``partitioner verify DIR``: check an artifact's format version, manifest checksum, layout, rank
count and every file hash. Exit 0 when intact, 2 (naming the file) when not. With ``--trusted-key``
(or ``$PARTITIONER_TRUSTED_KEY``) the signature is checked first (:mod:`partitioner.signing`);
without one the report says whether the artifact is unsigned or signed but unchecked."""

from __future__ import annotations

import argparse

from partitioner.commands._options import add_json_argument, print_json

NAME = "verify"
HELP = "check an artifact directory: format version, layout, rank count and every file's sha256"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("artifact", metavar="DIR", help="the artifact directory")
    from partitioner.signing import add_trusted_key_argument

    add_trusted_key_argument(p)
    add_json_argument(p)


def run(args: argparse.Namespace) -> int:
    from partitioner import signing
    from partitioner.artifact import verify_artifact

    signed = signing.check_trusted(args.artifact, args.trusted_key)
    m = verify_artifact(args.artifact)
    sig = signed.to_json() if signed else {"status": signing.signature_status(args.artifact),
                                           "file": signing.SIGNATURE}
    if args.json:
        print_json({"ok": True, "artifact": args.artifact, "format_version": m["format_version"],
                    "world_size": m["world_size"], "backend": m["backend"], "files": len(m["files"]) + 1,
                    "toolchain": m["toolchain"], "nondeterministic_files": m["nondeterministic_files"],
                    "signature": sig})
    else:
        print(f"ok: {args.artifact}: format {m['format_version']}, {m['world_size']} rank(s), backend "
              f"{m['backend']}, {len(m['files']) + 1} files verified; {signing.describe(sig)}")
    return 0
