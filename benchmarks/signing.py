"""Signing and verifying a large artifact streams: memory stays flat, time grows with the bytes.

Builds a real artifact (zoo MLP, 2 ranks, ONNX Runtime backend) and adds per-rank weight files
(``rank<i>.data``, random bytes written in 64 MiB chunks: real blocks, not a sparse file) listed in
the manifest, until the directory holds ``--gb`` GB (default 2.7), plus a tenth of that size for
the proportionality check. For each size, in a fresh process each:

- ``sign``: ``partitioner.signing.sign_artifact`` (it verifies the manifest hashes first, then
  model-signing hashes every file: two reads of every byte);
- ``verify``: ``partitioner.signing.check_trusted`` (the signature check that ``run`` and every
  worker rank do before loading: one read of every byte).

Each child records its resident memory after its imports (the baseline) and its peak
(``VmHWM``) after the operation; ``peak_above_baseline_mb`` must stay under 200 MB. The files
were just written, so they are read from the page cache: the times measure hashing, not the
disk. Times are meaningful on a quiet machine only; memory is meaningful on any.

Writes ``benchmarks/results/signing.json``; the directories live under ``--tmp`` (default /tmp)
and are deleted afterwards.

    python benchmarks/signing.py            # 2.7 GB and 0.27 GB
    python benchmarks/signing.py --gb 0.5   # a quick look
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "signing.json"
CHUNK = 64 << 20
LIMIT_MB = 200


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def child(op: str, directory: str, key: str) -> dict[str, Any]:
    """One measured operation in this (fresh) process."""
    import model_signing.hashing  # noqa: F401 - imports belong to the baseline, not the peak
    import model_signing.signing  # noqa: F401
    import model_signing.verifying  # noqa: F401

    import partitioner.artifact  # noqa: F401
    from partitioner import signing

    baseline = _status_kb("VmRSS")
    t0 = time.perf_counter()
    if op == "sign":
        signing.sign_artifact(directory, key)
    else:
        os.environ.pop(signing.TRUSTED_KEY_ENV, None)
        signing.check_trusted(directory, key)
    seconds = time.perf_counter() - t0
    peak = _status_kb("VmHWM")
    return {"seconds": seconds, "baseline_rss_mb": baseline / 1024, "peak_rss_mb": peak / 1024,
            "peak_above_baseline_mb": (peak - baseline) / 1024}


def times_valid(machine: dict[str, Any]) -> bool:
    """Times mean something only when other work left the cores mostly idle (1-minute load under
    half the usable cores); memory figures hold either way."""
    load = (machine.get("load_average_1_5_15min") or [0.0])[0]
    return load < 0.5 * (machine.get("usable_cores") or 1)


def _keys(d: Path) -> tuple[Path, Path]:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP256R1())
    (d / "key.pem").write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                  serialization.NoEncryption()))
    (d / "pub.pem").write_bytes(key.public_key().public_bytes(serialization.Encoding.PEM,
                                                              serialization.PublicFormat.SubjectPublicKeyInfo))
    return d / "key.pem", d / "pub.pem"


def make_artifact(d: Path, total_bytes: int, seed: int = 0) -> int:
    """A real 2-rank artifact plus rank<i>.data weight files up to ``total_bytes``; returns its size."""
    import numpy as np
    import onnx

    import partitioner.artifact as pa
    from models_zoo import build

    model = d.parent / "mlp.onnx"
    if not model.exists():
        onnx.save(build("mlp", batch=4), model)
    from partitioner.compiler import compile as compile_artifact

    compile_artifact(str(model), "cpu:2", strategy="tensor", backend="onnxruntime", out_dir=d, progress=False)
    manifest = json.loads((d / pa.MANIFEST).read_text())
    have = sum(p.stat().st_size for p in d.iterdir())
    rng = np.random.default_rng(seed)
    per_rank = max(0, total_bytes - have) // 2
    for rank in (0, 1):
        name, h, left = f"rank{rank}.data", hashlib.sha256(), per_rank
        with open(d / name, "wb") as f:
            while left > 0:
                block = rng.bytes(min(CHUNK, left))
                f.write(block)
                h.update(block)
                left -= len(block)
        manifest["files"][name] = {"sha256": h.hexdigest(), "size": per_rank}
        print(f"  wrote {name}: {per_rank / 1e9:.2f} GB", file=sys.stderr)
    manifest["manifest_sha256"] = pa.manifest_checksum(manifest)
    (d / pa.MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    pa.verify_artifact(d)
    return sum(p.stat().st_size for p in d.iterdir())


def _run_child(op: str, d: Path, key: Path) -> dict[str, Any]:
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path}
    env.pop("PARTITIONER_TRUSTED_KEY", None)
    proc = subprocess.run([sys.executable, __file__, "--child", op, str(d), str(key)], capture_output=True,
                          text=True, env=env)
    if proc.returncode != 0:
        last = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit {proc.returncode}"
        raise SystemExit(f"{op} failed: {last}")
    return json.loads(proc.stdout)


def run(args: argparse.Namespace) -> dict[str, Any]:
    from importlib import metadata

    from partitioner.core.machine import machine_info

    work = Path(tempfile.mkdtemp(prefix="partitioner-signing-", dir=args.tmp))
    rows = []
    try:
        key, pub = _keys(work)
        for gb in sorted({args.gb / 10, args.gb}):
            d = work / f"art-{gb:g}GB"
            print(f"building a {gb:g} GB artifact in {d}", file=sys.stderr)
            size = make_artifact(d, int(gb * 1e9))
            row: dict[str, Any] = {"bytes": size, "gb": size / 1e9}
            for op, k in (("sign", key), ("verify", pub)):
                res = _run_child(op, d, k)
                res["gb_per_s"] = size / 1e9 / res["seconds"]
                res["s_per_gb"] = res["seconds"] / (size / 1e9)
                res["within_limit"] = res["peak_above_baseline_mb"] < LIMIT_MB
                row[op] = res
                print(f"  {op}: {res['seconds']:.2f} s ({res['gb_per_s']:.2f} GB/s), peak RSS "
                      f"+{res['peak_above_baseline_mb']:.1f} MB over a {res['baseline_rss_mb']:.0f} MB baseline",
                      file=sys.stderr)
            shutil.rmtree(d)
            rows.append(row)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    big, small = rows[-1], rows[0]
    machine = machine_info()
    return {
        "what": "sign_artifact and check_trusted on an artifact with large rank<i>.data files; fresh process each",
        "machine": machine,
        "times_valid": times_valid(machine),
        "versions": {d: metadata.version(d) for d in ("model-signing", "cryptography")},
        "memory_limit_mb": LIMIT_MB,
        "page_cache": "warm (files just written): times measure hashing, not the disk",
        "sign_reads": "twice (manifest hashes, then the signature's hashes)",
        "verify_reads": "once (the signature's hashes; load_artifact then reads the files again)",
        "results": rows,
        "time_ratio_big_over_small": {op: big[op]["seconds"] / small[op]["seconds"] for op in ("sign", "verify")}
        if len(rows) > 1 else None,
        "size_ratio_big_over_small": big["bytes"] / small["bytes"] if len(rows) > 1 else None,
        "ok": all(r[op]["within_limit"] for r in rows for op in ("sign", "verify")),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gb", type=float, default=2.7, help="size of the large artifact in GB (default 2.7)")
    p.add_argument("--tmp", default="/tmp", help="where the artifacts are written (and deleted)")
    p.add_argument("--output", default=str(RESULTS), help="the JSON file to write")
    p.add_argument("--child", nargs=3, metavar=("OP", "DIR", "KEY"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(*args.child)))
        return 0
    doc = run(args)
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {args.output}; memory within {LIMIT_MB} MB: {doc['ok']}")
    return 0 if doc["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
