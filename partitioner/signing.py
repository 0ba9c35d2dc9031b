"""Signed artifacts: authenticity of the whole directory, checked against a key the deployer trusts.

The manifest's hashes protect against accidents only: anyone who can write the directory can
rewrite a file, its manifest entry and ``manifest_sha256``. A signature made with a private key
the attacker does not hold closes that gap. The signature is the OpenSSF model-signing format
(``model-signing`` on PyPI): a Sigstore bundle holding a DSSE envelope over an in-toto statement
that lists every file of the directory with its sha256. It is written as ``DIR/model.sig``, the
name the ``model_signing`` CLI uses, so that tool verifies our artifacts too
(``model_signing verify key DIR --signature DIR/model.sig --public_key PUB.pem --no-ignore-git-paths``).

Rules:
1. **Everything is signed.** Every file under the directory, ``manifest.json`` included, is
   hashed; only the signature file itself is left out (recorded in the signed statement). Git
   files are *not* ignored, unlike the library's default: nothing may be added unseen.
2. **Sign only what verifies.** :func:`sign_artifact` runs :func:`verify_artifact` first, so a
   signature never blesses a corrupted directory.
3. **Refuse before loading.** :func:`check_trusted` is called by ``verify``, ``run``, ``bench``
   and every ``worker`` rank before any program or library of the artifact is read; it raises
   :class:`SignatureError` (exit 2) with one line naming what failed: the missing signature, a
   signature by another key, or the files added, removed or changed since signing.
4. **Every process that loads a library checks for itself.** Once checked, the trusted key is
   exported in ``PARTITIONER_TRUSTED_KEY``, so the ranks ``run`` starts check it again before
   ``load_module``; a rank started by the user's own ``mpiexec`` checks when given the option or
   the variable. The check runs once per rank.
5. **Streaming.** Files are hashed in 1 MiB chunks by model-signing (a few threads, one chunk
   each), so memory does not grow with the artifact's size (``benchmarks/signing.py``).
6. **Keys.** PEM files: an elliptic-curve private key (P-256, as ``openssl ecparam -name
   prime256v1 -genkey`` writes it; P-384 and P-521 too) to sign, its public key to verify.
   model-signing 1.1 signs with EC keys only: Ed25519 and RSA keys are refused with a clear line.
   An encrypted private key is opened with the password in ``PARTITIONER_SIGN_KEY_PASSWORD``.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import hashlib
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from partitioner.core.errors import ArtifactError

SIGNATURE = "model.sig"
TRUSTED_KEY_ENV = "PARTITIONER_TRUSTED_KEY"
PASSWORD_ENV = "PARTITIONER_SIGN_KEY_PASSWORD"
#: the curves model-signing's key signer accepts (it follows Sigstore's protobuf specs)
_CURVES = ("secp256r1", "secp384r1", "secp521r1")
_KEYGEN_HINT = ("generate one with `openssl ecparam -name prime256v1 -genkey -noout -out key.pem` "
                "and its public key with `openssl ec -in key.pem -pubout -out pub.pem`")


class SignatureError(ArtifactError):
    """An artifact is unsigned, signed by another key, or changed after signing (exit 2)."""


@dataclass(frozen=True)
class SignatureCheck:
    """The result of a successful check: how many files it covered and with which key."""

    directory: str
    key: str
    key_sha256: str
    files: int

    def to_json(self) -> dict[str, Any]:
        return {"status": "verified", "file": SIGNATURE, "key": self.key, "key_sha256": self.key_sha256,
                "files": self.files}


# ------------------------------------------------------------------------------------------------
# keys


def _read_key_file(path: str | os.PathLike[str], what: str) -> bytes:
    p = Path(path)
    if not p.is_file():
        raise SignatureError(f"{p}: no such {what} file; {_KEYGEN_HINT}")
    try:
        return p.read_bytes()
    except OSError as exc:
        raise SignatureError(f"{p}: cannot read the {what} ({exc.strerror})") from None


def _check_curve(key: Any, path: str | os.PathLike[str], what: str) -> None:
    from cryptography.hazmat.primitives.asymmetric import ec

    if isinstance(key, (ec.EllipticCurvePrivateKey, ec.EllipticCurvePublicKey)):
        if key.curve.name in _CURVES:
            return
        kind = f"elliptic curve {key.curve.name}"
    else:
        kind = type(key).__name__.lstrip("_").replace("PrivateKey", "").replace("PublicKey", "")
    raise SignatureError(f"{path}: {what} of type {kind} is not supported; model-signing signs with ECDSA keys "
                         f"on P-256, P-384 or P-521 only (no Ed25519 or RSA): {_KEYGEN_HINT}")


def load_private_key(path: str | os.PathLike[str]) -> Any:
    from cryptography.hazmat.primitives import serialization

    data = _read_key_file(path, "private key")
    password = os.environ.get(PASSWORD_ENV)
    try:
        key = serialization.load_pem_private_key(data, password.encode() if password else None)
    except TypeError:
        raise SignatureError(f"{path}: the private key is encrypted; put its password in "
                             f"${PASSWORD_ENV}") from None
    except ValueError as exc:
        why = "wrong password in $" + PASSWORD_ENV if password else str(exc).splitlines()[0]
        raise SignatureError(f"{path}: not a PEM private key ({why}); {_KEYGEN_HINT}") from None
    _check_curve(key, path, "private key")
    return key


def _public_pem(key: Any) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return key.public_bytes(encoding=serialization.Encoding.PEM,
                            format=serialization.PublicFormat.SubjectPublicKeyInfo)


def load_public_key(path: str | os.PathLike[str]) -> Any:
    from cryptography.hazmat.primitives import serialization

    data = _read_key_file(path, "public key")
    try:
        key = serialization.load_pem_public_key(data)
    except ValueError:
        if b"PRIVATE KEY" in data:
            raise SignatureError(f"{path}: a private key; verify with its public key "
                                 f"(`openssl ec -in {Path(path).name} -pubout -out pub.pem`)") from None
        raise SignatureError(f"{path}: not a PEM public key; {_KEYGEN_HINT}") from None
    _check_curve(key, path, "public key")
    return key


def key_fingerprint(key: Any) -> str:
    """sha256 of the public key's PEM (SubjectPublicKeyInfo): the hint model-signing records."""
    return hashlib.sha256(_public_pem(key)).hexdigest()


# ------------------------------------------------------------------------------------------------
# signing and verification


def _hashing_config() -> Any:
    """The one hashing configuration, used to sign and to verify (rules 1 and 5)."""
    from model_signing import hashing

    return (hashing.Config().use_file_serialization(hashing_algorithm="sha256", allow_symlinks=False)
            .set_ignored_paths(paths=[SIGNATURE], ignore_git_paths=False))


def _artifact_dir(directory: str | os.PathLike[str]) -> Path:
    root = Path(directory)
    if not root.is_dir():
        raise SignatureError(f"{root}: not an artifact directory (it does not exist or is not a directory)")
    return root


def sign_artifact(directory: str | os.PathLike[str], private_key: str | os.PathLike[str]) -> Path:
    """Sign every file of an intact artifact directory; returns the path of ``DIR/model.sig``.

    The directory is verified first (rule 2); an earlier signature is replaced atomically.
    """
    from partitioner.artifact import verify_artifact

    root = _artifact_dir(directory)
    load_private_key(private_key)  # one clear line for a missing, encrypted or unsupported key
    verify_artifact(root)
    from model_signing import signing

    password = os.environ.get(PASSWORD_ENV) or None
    # model-signing 1.1 types the password as str but hands it to cryptography, which wants bytes
    password_bytes: Any = password.encode() if password else None
    tmp = root / f".{SIGNATURE}.tmp"
    tmp.unlink(missing_ok=True)  # a stale one from a crash would otherwise be hashed (it is written after)
    try:
        (signing.Config().use_elliptic_key_signer(private_key=Path(private_key), password=password_bytes)
         .set_hashing_config(_hashing_config()).sign(root, tmp))
        os.replace(tmp, root / SIGNATURE)
    except ValueError as exc:  # a symlink or a special file in the directory
        raise SignatureError(f"{root}: cannot be signed: {_first_line(exc)}") from None
    finally:
        tmp.unlink(missing_ok=True)
    return root / SIGNATURE


def signature_status(directory: str | os.PathLike[str]) -> str:
    """``"signed"`` when ``DIR/model.sig`` exists (not checked), else ``"unsigned"``."""
    return "signed" if (Path(directory) / SIGNATURE).is_file() else "unsigned"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


_EXTRA = re.compile(r"^Extra files found in model '.*?': (.*)$")
_MISSING = re.compile(r"^Missing files in model '.*?': (.*)$")
_CHANGED = re.compile(r"^Hash mismatch for '(.*?)':")
_SYMLINK = re.compile(r"^Cannot use '(.*?)' because it is a symlink")


def _describe_mismatch(root: Path, message: str) -> str:
    """One line from model-signing's manifest diff: what was added, removed or changed."""
    body = message.split(":", 1)[1].strip() if ":" in message else ""
    try:
        diffs = ast.literal_eval(body)
    except (ValueError, SyntaxError):
        diffs = None
    if not isinstance(diffs, list) or not diffs:
        return f"{root}: does not match its signature ({message[:300]})"
    added: list[str] = []
    removed: list[str] = []
    changed: list[str] = []
    for d in map(str, diffs):
        if m := _EXTRA.match(d):
            added += m.group(1).split(", ")
        elif m := _MISSING.match(d):
            removed += m.group(1).split(", ")
        elif m := _CHANGED.match(d):
            changed.append(m.group(1))
    parts = [f"{what} {', '.join(sorted(names))}" for what, names in
             (("changed", changed), ("added", added), ("removed", removed)) if names]
    if not parts:
        return f"{root}: does not match its signature ({message[:300]})"
    return (f"{root}: files differ from what was signed: {'; '.join(parts)}; "
            "the artifact was modified after signing")


def verify_signature(directory: str | os.PathLike[str], public_key: str | os.PathLike[str]) -> SignatureCheck:
    """Check ``DIR/model.sig`` against ``public_key`` and every file of the directory (rule 3).

    Raises :class:`SignatureError` with one line: missing signature, another key, or the files
    added, removed or changed since signing.
    """
    from cryptography.exceptions import InvalidSignature

    root = _artifact_dir(directory)
    key = load_public_key(public_key)
    sig = root / SIGNATURE
    if not sig.is_file():
        raise SignatureError(f"{root}: not signed (no {SIGNATURE}), but a trusted key was given; "
                             f"sign it with `partitioner sign {root} --key KEY.pem`")
    from model_signing import verifying

    config = (verifying.Config().use_elliptic_key_verifier(public_key=Path(public_key))
              .set_hashing_config(_hashing_config()))
    try:
        # model-signing prints a warning on stdout for old-style bundles: keep stdout for reports
        with contextlib.redirect_stdout(sys.stderr):
            config.verify(root, sig)
    except InvalidSignature:
        raise SignatureError(f"{sig}: the signature does not verify with the trusted key {public_key} "
                             "(signed by another key, or the signature was edited)") from None
    except ValueError as exc:
        msg = _first_line(exc)
        if msg.startswith("Key mismatch"):
            raise SignatureError(f"{sig}: signed by another key, not by the trusted key {public_key} "
                                 f"(public key sha256 {key_fingerprint(key)[:16]}...)") from None
        if m := _SYMLINK.match(msg):
            raise SignatureError(f"{m.group(1)}: a symbolic link; a signed artifact holds plain files only") \
                from None
        if msg.startswith("Signature mismatch"):
            raise SignatureError(_describe_mismatch(root, msg)) from None
        raise SignatureError(f"{sig}: cannot be verified: {msg}") from None
    except Exception as exc:  # noqa: BLE001 - e.g. JSON or pydantic errors from a damaged bundle
        why = f"{type(exc).__name__}: {_first_line(exc)}"
        raise SignatureError(f"{sig}: not a model-signing signature ({why})") from None
    files = sum(1 for p in root.rglob("*") if p.is_file() and p.name != SIGNATURE)
    return SignatureCheck(str(root), str(public_key), key_fingerprint(key), files)


# ------------------------------------------------------------------------------------------------
# the hook every command calls


def add_trusted_key_argument(p: argparse.ArgumentParser) -> None:
    """``--trusted-key PUB.pem`` (default ``$PARTITIONER_TRUSTED_KEY``)."""
    p.add_argument("--trusted-key", default=None, metavar="PUB.pem",
                   help=f"refuse the artifact unless {SIGNATURE} is a valid signature of every file by this "
                        f"public key (default ${TRUSTED_KEY_ENV})")


def trusted_key(option: str | os.PathLike[str] | None = None) -> str | None:
    """The key in force: the option, else ``$PARTITIONER_TRUSTED_KEY``, else None."""
    key = option if option else os.environ.get(TRUSTED_KEY_ENV) or None
    return None if key is None else str(key)


def describe(status: dict[str, Any]) -> str:
    """The signature part of ``verify``'s one-line report."""
    if status["status"] == "verified":
        return f"signature {SIGNATURE} verified with {status['key']} ({status['files']} files)"
    if status["status"] == "signed":
        return (f"signed ({SIGNATURE}) but the signature was not checked: pass --trusted-key PUB.pem "
                f"or set ${TRUSTED_KEY_ENV}")
    return f"unsigned (no {SIGNATURE}; sign it with `partitioner sign DIR --key KEY.pem`)"


def check_trusted(directory: str | os.PathLike[str], option: str | os.PathLike[str] | None = None) \
        -> SignatureCheck | None:
    """Verify the signature when a trusted key is in force (option or environment); no-op otherwise.

    Call it before any program or library of the artifact is read. The key is exported in
    ``$PARTITIONER_TRUSTED_KEY`` so the processes this one starts check it too (rule 4).
    """
    key = trusted_key(option)
    if key is None:
        return None
    check = verify_signature(directory, key)
    os.environ[TRUSTED_KEY_ENV] = str(Path(key).resolve())
    return check
