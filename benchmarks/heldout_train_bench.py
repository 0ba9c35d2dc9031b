"""Training memory outside the zoo: ``partitioner train MODEL --bench --json`` on a held-out
builder of :mod:`benchmarks.heldout_models` (1 rank, ONNX Runtime), its JSON saved as given.

Data: 4 batches of seeded standard-normal inputs; labels random integers over the output's
classes (``unet``: ``--loss mse`` against seeded uniform [0, 1] maps of the output's shape).
Environment settings (``PARTITIONER_TRAIN_MEMORY_REUSE``, ``PARTITIONER_ORT_ARENA_MAX_DEAD_BYTES``,
...) pass through to the run; ``--tag`` names the file for them.

    .venv/bin/python benchmarks/heldout_train_bench.py unet 8 --out benchmarks/results/session31_zen5_train/heldout
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
import tempfile
from pathlib import Path

import numpy as np
import onnx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks import heldout_models  # noqa: E402
from partitioner.cli import main as cli_main  # noqa: E402


def run(name: str, batch: int, out_dir: Path, tag: str = "") -> dict:
    model = getattr(heldout_models, f"build_{name}")(batch=batch)
    tmp = Path(tempfile.mkdtemp(prefix="heldout-train-"))
    onnx.save(model, str(tmp / "m.onnx"))
    shape = [d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim]
    out = [d.dim_value for d in model.graph.output[0].type.tensor_type.shape.dim]
    rng = np.random.default_rng(0)
    mse = name == "unet"  # a segmentation map: per-pixel targets
    y = rng.uniform(0, 1, [4 * batch] + out[1:]).astype(np.float32) if mse else rng.integers(0, out[-1], 4 * batch)
    np.savez(tmp / "d.npz", x=rng.standard_normal([4 * batch] + shape[1:]).astype(np.float32), y=y)
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = cli_main(["train", str(tmp / "m.onnx"), "--data", str(tmp / "d.npz"), "--batch", str(batch),
                       "--devices", "1", "--loss", "mse" if mse else "cross_entropy", "--no-progress", "--bench",
                       "--json", "-o", str(tmp / "run")])
    if rc:
        raise SystemExit(rc)
    doc = json.loads(buf.getvalue())
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"train_bench_{name}_b{batch}{tag}.json").write_text(json.dumps(doc, indent=1))
    return doc


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", choices=["unet", "inception", "mbv2", "vit"])
    ap.add_argument("batch", type=int)
    ap.add_argument("--out", type=Path, required=True, help="folder for train_bench_<model>_b<batch><tag>.json")
    ap.add_argument("--tag", default="", help="file name suffix (the environment's settings)")
    args = ap.parse_args(argv)
    doc = run(args.model, args.batch, args.out, args.tag)
    for m in doc["memory_per_rank"]:
        print(f"{args.model} b{args.batch}{args.tag}: predicted {m['predicted'] / 2**20:.0f} MiB, "
              f"measured {m['measured'] / 2**20:.0f} MiB, ratio {m['ratio']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
