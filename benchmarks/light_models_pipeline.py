"""Evidence run: onnx's nine light models, ``--devices 2 --strategy pipeline`` with the TVM backend.

For each model: compile the artifact (timed), run it once through the in-process runtime with
seeded inputs (timed), compare every output with ONNX Runtime on the source model
(``|got - want| <= atol + rtol * |want|``, rtol 1e-4, atol 1e-5) and record max abs/rel errors.
The JSON summary is rewritten after every model, so a partial run still leaves evidence.

    .venv/bin/python benchmarks/light_models_pipeline.py [--models light_resnet50,...] [--jobs J]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

LIGHT = ("light_resnet50", "light_vgg19", "light_densenet121", "light_inception_v1", "light_inception_v2",
         "light_shufflenet", "light_squeezenet", "light_bvlc_alexnet", "light_zfnet512")
RTOL, ATOL = 1e-4, 1e-5


def seeded_feeds(art, seed: int = 0) -> dict:
    import numpy as np

    rng = np.random.default_rng(seed)
    feeds = {}
    for b in art.bindings.inputs:
        dt = np.dtype(b.dtype)
        feeds[b.name] = (rng.standard_normal(b.shape).astype(dt) if dt.kind == "f"
                         else rng.integers(0, 2, size=b.shape).astype(dt))
    return feeds


def drop_unread_dropout_masks(model):
    """Remove the ``mask`` output of every Dropout whose mask nothing reads (inference Dropout is an
    identity; ONNX shape inference leaves such masks unshaped, which partitioner/lowering/lower.py refuses).
    Returns the number of masks removed."""
    read = {i for n in model.graph.node for i in n.input} | {o.name for o in model.graph.output}
    removed = 0
    for node in model.graph.node:
        if node.op_type == "Dropout" and len(node.output) > 1 and node.output[1] and node.output[1] not in read:
            del node.output[1:]
            removed += 1
    return removed


def random_weights(model, seed: int = 0):
    """The light models' weights are ``ConstantOfShape`` nodes that all hold 0.02, which makes every
    class score equal (the softmax output is exactly 1/1000 whatever the input), so a comparison
    would prove nothing. Fold the constants, then give every Conv/Gemm/MatMul weight seeded
    He-normal values (std sqrt(2/fan_in)); other constants keep their values."""
    import numpy as np
    import onnx_ir as ir
    from onnx import numpy_helper

    from partitioner.load import load
    from passes import run_pipeline

    folded = ir.serde.serialize_model(run_pipeline(load(model)))
    rng = np.random.default_rng(seed)
    weights = {n.input[1] for n in folded.graph.node if n.op_type in ("Conv", "Gemm", "MatMul") and len(n.input) > 1}
    for i, t in enumerate(folded.graph.initializer):
        if t.name in weights:
            a = numpy_helper.to_array(t)
            fan_in = int(np.prod(a.shape[1:])) if a.ndim > 1 else a.size
            gemm_t = any(n.op_type == "Gemm" and n.input[1] == t.name and any(x.name == "transB" and x.i == 0 for x in n.attribute)
                         for n in folded.graph.node)
            if gemm_t or a.ndim == 2 and not any(n.op_type == "Gemm" and n.input[1] == t.name for n in folded.graph.node):
                fan_in = a.shape[0]
            w = (rng.standard_normal(a.shape) * np.sqrt(2.0 / max(1, fan_in))).astype(a.dtype)
            folded.graph.initializer[i].CopyFrom(numpy_helper.from_array(w, t.name))
    return folded


def one_model(name: str, out_dir: Path, jobs: int | None, drop_masks: bool, randomize: bool = True) -> dict:
    from models_zoo import build
    from partitioner.compiler import compile as compile_artifact
    from partitioner.runtime.launch import check_outputs, run_in_process

    row: dict = {"model": name, "strategy": "pipeline", "devices": 2, "backend": "tvm"}
    model = build(name)
    if randomize:
        model = random_weights(model)
        row["weights"] = "seeded He-normal Conv/Gemm weights (see random_weights)"
    if drop_masks:
        row["dropout_masks_removed"] = drop_unread_dropout_masks(model)
    t0 = time.perf_counter()
    try:
        art = compile_artifact(model, "cpu:2", strategy="pipeline", backend="tvm", out_dir=out_dir / name,
                               jobs=jobs, progress=False)
    except Exception as exc:  # noqa: BLE001 - recorded, the next model still runs
        row.update(stage="compile", ok=False, error=f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}",
                   compile_s=round(time.perf_counter() - t0, 2))
        return row
    row["compile_s"] = round(time.perf_counter() - t0, 2)
    row["microbatches"] = art.microbatches
    row["build"] = [{k: r["build"].get(k) for k in ("segments", "comm_ops", "pipeline", "compiled")}
                    for r in art.manifest["ranks"]]
    feeds = seeded_feeds(art)
    try:
        t0 = time.perf_counter()
        outputs, _ = run_in_process(art, feeds, timeout=3600)
        row["run_s"] = round(time.perf_counter() - t0, 3)
        report = check_outputs(art, feeds, outputs, rtol=RTOL, atol=ATOL)
    except Exception as exc:  # noqa: BLE001
        row.update(stage="run", ok=False, error=f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
        return row
    row["outputs"] = [o.to_json() for o in report.outputs]
    row["max_abs"] = max(o.max_abs for o in report.outputs)
    row["max_rel"] = max(o.max_rel for o in report.outputs)
    row["ok"] = report.ok
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(LIGHT))
    ap.add_argument("--jobs", type=int, default=None, help="parallel rank builds (default: cores)")
    ap.add_argument("--drop-unread-dropout-masks", action="store_true",
                    help="work around partitioner/lowering/lower.py refusing unshaped Dropout masks (see the docstring)")
    ap.add_argument("--shipped-weights", action="store_true",
                    help="keep the shipped all-0.02 weights (outputs are then uniform, a weak check)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "light_models_pipeline.json"))
    args = ap.parse_args()

    import numpy
    import onnx
    import onnxruntime
    import tvm

    doc = {"machine": {"platform": platform.platform(), "python": platform.python_version(),
                       "processor": platform.processor() or platform.machine()},
           "versions": {"tvm": str(tvm.__version__), "onnx": onnx.__version__, "onnxruntime": onnxruntime.__version__,
                        "numpy": numpy.__version__},
           "settings": {"devices": 2, "strategy": "pipeline", "backend": "tvm", "rtol": RTOL, "atol": ATOL,
                        "runner": "in-process (threads, LocalWorld)", "inputs": "standard normal, seed 0",
                        "drop_unread_dropout_masks": args.drop_unread_dropout_masks,
                        "weights": "shipped (all 0.02)" if args.shipped_weights else "seeded He-normal Conv/Gemm weights"},
           "models": []}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="light-models-") as tmp:
        for name in args.models.split(","):
            row = one_model(name, Path(tmp), args.jobs, args.drop_unread_dropout_masks, not args.shipped_weights)
            doc["models"].append(row)
            doc["summary"] = {"passed": sum(1 for r in doc["models"] if r.get("ok")), "total": len(doc["models"])}
            out.write_text(json.dumps(doc, indent=2) + "\n")
            print(f"{name}: {'ok' if row.get('ok') else 'FAIL'} compile {row.get('compile_s')} s run {row.get('run_s')} s "
                  f"max_abs {row.get('max_abs')} max_rel {row.get('max_rel')} {row.get('error', '')}", flush=True)
    return 0 if all(r.get("ok") for r in doc["models"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
