"""``partitioner sign DIR --key KEY.pem``: sign every file of an artifact directory.

Writes ``DIR/model.sig`` (OpenSSF model-signing format, :mod:`partitioner.signing`). The
directory is verified first, so a corrupted artifact is never signed. Check it with
``partitioner verify DIR --trusted-key PUB.pem``.
"""

from __future__ import annotations

import argparse

from partitioner.commands._options import add_json_argument, print_json

NAME = "sign"
HELP = "sign every file of an artifact directory with an EC private key (writes DIR/model.sig)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("artifact", metavar="DIR", help="the artifact directory")
    p.add_argument("--key", required=True, metavar="KEY.pem",
                   help="PEM elliptic-curve private key (openssl ecparam -name prime256v1 -genkey -noout "
                        "-out KEY.pem); an encrypted one is opened with $PARTITIONER_SIGN_KEY_PASSWORD")
    add_json_argument(p)


def run(args: argparse.Namespace) -> int:
    from partitioner import signing

    path = signing.sign_artifact(args.artifact, args.key)
    fingerprint = signing.key_fingerprint(signing.load_private_key(args.key).public_key())
    if args.json:
        print_json({"artifact": args.artifact, "signature": str(path), "key_sha256": fingerprint})
    else:
        print(f"signed {args.artifact}: {path.name} (public key sha256 {fingerprint[:16]}...)")
    return 0
