"""Signed artifacts: a signed artifact verifies and runs; every tampering is refused before any
library loads, by ``verify``, ``run`` and a ``worker`` started under ``mpiexec``.

The proof that nothing was loaded is a *bait*: a tiny C shared object whose constructor writes a
marker file the moment it is loaded (``dlopen`` runs it, whatever the loader does next). The bait
artifact is a real TVM artifact whose ``rank<i>.so`` are replaced by the bait, with the manifest
rehashed with the project's own ``manifest_checksum`` and then signed by the trusted key: checked
with that key it verifies, and a worker loads the bait (the marker appears, the control). Every
tampered copy below still passes ``verify_artifact`` (the manifest is rehashed where needed), so
only the signature stands between it and ``load_module``: the marker must not appear.

The numbers of the positive run are compared with ONNX Runtime on the source model by
``run --check`` (rtol 1e-4, atol 1e-5).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Callable

import numpy as np
import pytest

from partitioner import cli, signing
from partitioner.artifact import MANIFEST, manifest_checksum, sha256_file, verify_artifact
from partitioner.runtime.launch import find_mpiexec

ROOT = Path(__file__).resolve().parents[1]
_BAIT_C = r"""
#include <stdio.h>
__attribute__((constructor)) static void bait_loaded(void) {
    FILE *f = fopen("%s", "a");
    if (f) { fputs("loaded\n", f); fclose(f); }
}
"""


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


def _keypair(d: Path, name: str) -> tuple[Path, Path]:
    key, pub = d / f"{name}.pem", d / f"{name}.pub.pem"
    _openssl("ecparam", "-name", "prime256v1", "-genkey", "-noout", "-out", str(key))
    _openssl("ec", "-in", str(key), "-pubout", "-out", str(pub))
    return key, pub


def _replace_file(d: Path, name: str, src: Path | None) -> None:
    """Replace (or with ``src=None`` remove) a file and rehash the manifest the way an attacker
    with write access would: entry updated, ``manifest_sha256`` recomputed."""
    m = json.loads((d / MANIFEST).read_text())
    if src is None:
        (d / name).unlink()
        del m["files"][name]
    else:
        if Path(src).resolve() != (d / name).resolve():
            shutil.copyfile(src, d / name)
        m["files"][name] = {**m["files"][name], "sha256": sha256_file(d / name),
                            "size": (d / name).stat().st_size}
    m["manifest_sha256"] = manifest_checksum(m)
    (d / MANIFEST).write_text(json.dumps(m, indent=2, sort_keys=True) + "\n")


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """Keys, the signed TVM artifact (zoo MLP, 2 ranks, tensor), inputs, the bait library and the
    signed bait artifact."""
    import onnx

    from models_zoo import build

    d = tmp_path_factory.mktemp("signing")
    key, pub = _keypair(d, "trusted")
    other_key, other_pub = _keypair(d, "other")
    model = build("mlp", batch=4)
    onnx.save(model, d / "mlp.onnx")
    rng = np.random.default_rng(0)
    np.savez(d / "in.npz", input=rng.standard_normal((4, 128)).astype(np.float32))
    art = d / "signed"
    assert cli.main(["compile", str(d / "mlp.onnx"), "-o", str(art), "--devices", "2", "--strategy", "tensor",
                     "--backend", "tvm", "--tvm-pipeline", "zero", "--sign-key", str(key)]) == 0
    marker = d / "bait-loaded"
    (d / "bait.c").write_text(_BAIT_C % marker)
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(d / "bait.so"), str(d / "bait.c")], check=True)
    bait = d / "bait-art"
    shutil.copytree(art, bait)
    for r in (0, 1):
        _replace_file(bait, f"rank{r}.so", d / "bait.so")
    signing.sign_artifact(bait, key)
    return {"dir": d, "key": key, "pub": pub, "other_key": other_key, "other_pub": other_pub, "art": art,
            "inputs": d / "in.npz", "marker": marker, "bait": bait, "bait_so": d / "bait.so"}


@pytest.fixture(autouse=True)
def _no_key_in_env(monkeypatch, env):
    """check_trusted exports the key for the ranks it starts: keep it out of other tests."""
    monkeypatch.setenv(signing.TRUSTED_KEY_ENV, "")
    monkeypatch.delenv(signing.TRUSTED_KEY_ENV)
    env["marker"].unlink(missing_ok=True)


def _worker(art: Path, env: dict, *extra: str, key_env: str | None = None) -> subprocess.CompletedProcess:
    """Two ranks of the worker under mpiexec, as a user's own launch would start them."""
    child = {k: v for k, v in os.environ.items() if k != signing.TRUSTED_KEY_ENV}
    child["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), child.get("PYTHONPATH", "")) if p)
    if key_env:
        child[signing.TRUSTED_KEY_ENV] = key_env
    cmd = [find_mpiexec(), "-n", "2", sys.executable, "-m", "partitioner.runtime.worker", str(art),
           "--inputs", str(env["inputs"]), "--outputs", str(env["dir"] / "out.npz"), *extra]
    return subprocess.run(cmd, capture_output=True, text=True, env=child, timeout=120)


# ------------------------------------------------------------------------------------------------
# positive paths


def test_signed_artifact_verifies_and_runs(env, capsys):
    art, pub = env["art"], str(env["pub"])
    assert (art / signing.SIGNATURE).is_file()
    capsys.readouterr()
    assert cli.main(["verify", str(art), "--trusted-key", pub, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    # every file of the directory but the signature itself, manifest.json included
    assert doc["signature"]["status"] == "verified" and doc["signature"]["files"] == doc["files"]
    # run checks in the launcher and (through the exported key) again in each rank, then
    # compares with ONNX Runtime on the source model
    assert cli.main(["run", str(art), "--inputs", str(env["inputs"]), "--check", "--json",
                     "--trusted-key", pub]) == 0
    out = capsys.readouterr()
    assert json.loads(out.out)["check"]["ok"], out.err


def test_verify_without_key_reports_signed_or_unsigned(env, tmp_path, capsys):
    assert cli.main(["verify", str(env["art"])]) == 0
    assert "signature was not checked" in capsys.readouterr().out
    plain = tmp_path / "plain"
    shutil.copytree(env["art"], plain)
    (plain / signing.SIGNATURE).unlink()
    assert cli.main(["verify", str(plain), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["signature"]["status"] == "unsigned"


def test_bait_is_loaded_when_its_signature_holds(env):
    """The control: the bait artifact verifies with the trusted key, so a worker loads rank<i>.so
    and the marker appears. Without this the absent marker below would prove nothing."""
    verify_artifact(env["bait"])
    signing.verify_signature(env["bait"], env["pub"])
    proc = _worker(env["bait"], env, "--trusted-key", str(env["pub"]))
    # every rank loads the bait; which rank reports first is a race
    assert proc.returncode != 0 and re.search(r"rank \d+: load:", proc.stderr + proc.stdout), proc.stderr
    assert env["marker"].exists()


def test_unsigned_replacement_is_loaded_without_a_key(env, tmp_path):
    """The issue's attack, today: rank0.so replaced and the manifest rehashed passes the manifest
    check, and `run` loads the replaced library (no trusted key given)."""
    d = tmp_path / "swapped"
    shutil.copytree(env["art"], d)
    _replace_file(d, "rank0.so", env["bait_so"])
    assert cli.main(["verify", str(d)]) == 0
    assert cli.main(["run", str(d), "--inputs", str(env["inputs"])]) == 1
    assert env["marker"].exists()


# ------------------------------------------------------------------------------------------------
# refusals


def _swapped_so(env: dict, d: Path) -> None:
    shutil.copytree(env["art"], d)
    _replace_file(d, "rank0.so", env["bait_so"])


def _edited_plan(env: dict, d: Path) -> None:
    shutil.copytree(env["bait"], d)
    plan = json.loads((d / "plan.json").read_text())
    plan["edited"] = True
    (d / "plan.json").write_text(json.dumps(plan))
    _replace_file(d, "plan.json", d / "plan.json")


def _added_file(env: dict, d: Path) -> None:
    shutil.copytree(env["bait"], d)
    (d / "extra.py").write_text("print('not signed')\n")


def _removed_file(env: dict, d: Path) -> None:
    shutil.copytree(env["bait"], d)
    _replace_file(d, "report.html", None)


def _other_key(env: dict, d: Path) -> None:
    shutil.copytree(env["bait"], d)
    signing.sign_artifact(d, env["other_key"])


def _unsigned(env: dict, d: Path) -> None:
    shutil.copytree(env["bait"], d)
    (d / signing.SIGNATURE).unlink()


CASES: dict[str, tuple[Callable[[dict, Path], None], str]] = {
    "replaced .so, manifest rehashed": (_swapped_so, "changed manifest.json, rank0.so"),
    "edited plan.json": (_edited_plan, "changed manifest.json, plan.json"),
    "added file": (_added_file, "added extra.py"),
    "removed file": (_removed_file, "removed report.html"),
    "signature from another key": (_other_key, "signed by another key"),
    "unsigned, trusted key given": (_unsigned, "not signed (no model.sig)"),
}


@pytest.fixture(params=list(CASES), ids=[k.split(",")[0].replace(" ", "-") for k in CASES])
def tampered(request, env, tmp_path) -> tuple[Path, str]:
    make, expected = CASES[request.param]
    d = tmp_path / "art"
    make(env, d)
    verify_artifact(d)  # the manifest alone would let every one of these through
    return d, expected


def test_verify_refuses(env, tampered, capsys):
    d, expected = tampered
    capsys.readouterr()
    assert cli.main(["verify", str(d), "--trusted-key", str(env["pub"])]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and expected in err[0], err
    assert not env["marker"].exists()


@pytest.mark.parametrize("command", ["run", "bench"])
def test_run_and_bench_refuse(env, tampered, command, capsys, monkeypatch):
    d, expected = tampered
    monkeypatch.setenv(signing.TRUSTED_KEY_ENV, str(env["pub"]))  # the environment variable this time
    capsys.readouterr()
    assert cli.main([command, str(d), "--inputs", str(env["inputs"])]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and expected in err[0], err
    assert not env["marker"].exists()


def test_worker_under_mpiexec_refuses(env, tampered):
    d, expected = tampered
    proc = _worker(d, env, "--trusted-key", str(env["pub"]))
    ours = [line for line in proc.stderr.splitlines() if re.match(r"rank \d+: ", line)]
    assert proc.returncode == 2, proc.stderr
    assert ours and all(re.match(r"rank \d+: verify: ", line) and expected in line for line in ours), ours
    assert not env["marker"].exists()


def test_worker_reads_the_key_from_the_environment(env, tmp_path):
    d = tmp_path / "unsigned"
    _unsigned(env, d)
    proc = _worker(d, env, key_env=str(env["pub"]))
    assert proc.returncode == 2 and "not signed" in proc.stderr, proc.stderr
    assert not env["marker"].exists()


# ------------------------------------------------------------------------------------------------
# keys and the signature file


def test_bad_keys_are_one_line_refusals(env, tmp_path, capsys):
    ed = tmp_path / "ed.pem"
    _openssl("genpkey", "-algorithm", "ed25519", "-out", str(ed))
    for argv, expected in (
        (["sign", str(env["art"]), "--key", str(ed)], "type Ed25519 is not supported"),
        (["sign", str(env["art"]), "--key", str(tmp_path / "missing.pem")], "no such private key file"),
        (["verify", str(env["art"]), "--trusted-key", str(env["key"])],
         "a private key; verify with its public key"),
        (["compile", str(env["dir"] / "mlp.onnx"), "-o", str(tmp_path / "never"), "--backend", "onnxruntime",
          "--sign-key", str(ed)], "type Ed25519 is not supported"),
    ):
        capsys.readouterr()
        assert cli.main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and expected in err[0], err
    assert not (tmp_path / "never").exists()  # compile refused the key before building
    signing.verify_signature(env["art"], env["pub"])  # the refused signing left the signature intact


def test_signature_is_model_signing_format(env):
    """The file is a Sigstore bundle that model-signing's own verifier accepts, listing every file."""
    import base64

    from model_signing import hashing, verifying

    bundle = json.loads((env["art"] / signing.SIGNATURE).read_text())
    assert bundle["mediaType"].startswith("application/vnd.dev.sigstore.bundle")
    statement = json.loads(base64.b64decode(bundle["dsseEnvelope"]["payload"]))
    names = {r["name"] for r in statement["predicate"]["resources"]}
    assert names == {p.name for p in env["art"].iterdir()} - {signing.SIGNATURE}
    assert statement["predicate"]["serialization"]["ignore_paths"] == [signing.SIGNATURE]
    (verifying.Config().use_elliptic_key_verifier(public_key=env["pub"])
     .set_hashing_config(hashing.Config().set_ignored_paths(paths=[signing.SIGNATURE],
                                                             ignore_git_paths=False))
     .verify(env["art"], env["art"] / signing.SIGNATURE))


def test_encrypted_key_signs_with_the_password_from_the_environment(env, tmp_path, monkeypatch, capsys):
    enc = tmp_path / "enc.pem"
    _openssl("ec", "-in", str(env["key"]), "-aes256", "-passout", "pass:s3cret", "-out", str(enc))
    d = tmp_path / "art"
    shutil.copytree(env["art"], d)
    (d / signing.SIGNATURE).unlink()
    capsys.readouterr()
    assert cli.main(["sign", str(d), "--key", str(enc)]) == 2
    assert "is encrypted" in capsys.readouterr().err
    monkeypatch.setenv(signing.PASSWORD_ENV, "s3cret")
    assert cli.main(["sign", str(d), "--key", str(enc)]) == 0
    assert signing.verify_signature(d, env["pub"]).files == len(list(d.iterdir())) - 1
