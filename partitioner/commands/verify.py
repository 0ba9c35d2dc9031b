"""``partitioner verify DIR``: check an artifact's format version, manifest checksum, layout, rank
count and every file hash. Exit 0 when intact, 2 (naming the file) when not."""

from __future__ import annotations

import argparse

from partitioner.commands._options import add_json_argument, print_json

NAME = "verify"
HELP = "check an artifact directory: format version, layout, rank count and every file's sha256"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("artifact", metavar="DIR", help="the artifact directory")
    add_json_argument(p)


def run(args: argparse.Namespace) -> int:
    from partitioner.artifact import verify_artifact

    m = verify_artifact(args.artifact)
    if args.json:
        print_json({"ok": True, "artifact": args.artifact, "format_version": m["format_version"],
                    "world_size": m["world_size"], "backend": m["backend"], "files": len(m["files"]) + 1,
                    "toolchain": m["toolchain"], "nondeterministic_files": m["nondeterministic_files"]})
    else:
        print(f"ok: {args.artifact}: format {m['format_version']}, {m['world_size']} rank(s), backend "
              f"{m['backend']}, {len(m['files']) + 1} files verified")
    return 0
