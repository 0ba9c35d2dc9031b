"""Training throughput: samples/s of the zoo mlp, resnet and bert training step on 1 rank
(1 and 2 threads) and on 2 ranks (MPI processes, 1 thread each) with data, pipeline (1F1B, 8
micro-batches) and tensor (Megatron MLP pairs) parallelism, with the ONNX Runtime or TVM
backend, and the training cost model's predicted step time beside each measured one.

Each configuration runs ``partitioner.train`` on seeded random data for ``--steps`` steps after
one warm-up epoch is discarded, and the median step time gives samples/s. The prediction is
:func:`partitioner.training.plan.predict_training` on ``cpu:<ranks>`` (the calibrated figures
when ``partitioner calibrate`` has run). A plan the model does not admit (tensor on resnet: no
MLP pair) is recorded with its reason. Writes ``benchmarks/results/train_step_<model>_<backend>.json``
with the machine and versions. Measure on a quiet machine; figures from a shared one are not
comparable. Targets (issue 16): data >= 1.7x and pipeline >= 1.5x the 1-rank 1-thread samples/s;
predicted step time within 25% of measured.

    .venv/bin/python benchmarks/train_step.py [--models mlp,resnet,bert] [--backend onnxruntime|tvm] [--steps 20]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CASES = {
    "mlp": ({"batch": 64}, "cross_entropy"),
    "resnet": ({"batch": 16, "image": 64, "classes": 10}, "cross_entropy"),
    "bert": ({"batch": 16, "seq": 32}, "mse"),
}


def _data(model, loss: str, n: int, path: Path) -> None:
    import numpy as np

    rng = np.random.default_rng(0)
    vi = model.graph.input[0]
    shape = [n] + [d.dim_value for d in vi.type.tensor_type.shape.dim][1:]
    x = rng.integers(0, 100, shape) if vi.type.tensor_type.elem_type == 7 else rng.standard_normal(shape)
    out = [d.dim_value for d in model.graph.output[0].type.tensor_type.shape.dim]
    y = rng.integers(0, out[-1], [n] + out[1:-1]) if loss == "cross_entropy" else rng.standard_normal([n] + out[1:])
    np.savez(path, x=x.astype(np.int64 if x.dtype.kind == "i" else np.float32),
             y=y.astype(np.int64 if loss == "cross_entropy" else np.float32))


#: (label, ranks, strategy, threads per rank); 2-rank runs are MPI processes
CONFIGS = (("1 rank, 1 thread", 1, "single", 1), ("1 rank, 2 threads", 1, "single", 2),
           ("2 ranks data (MPI)", 2, "data", 1), ("2 ranks pipeline 1f1b x8 (MPI)", 2, "pipeline", 1),
           ("2 ranks tensor (MPI)", 2, "tensor", 1))
MICRO_BATCHES = 8


def _measure(name: str, tmp: Path, label: str, devices: int, strategy: str, threads: int, backend: str, loss: str,
             batch: int, steps: int) -> dict:
    from partitioner.core.errors import UsageError
    from partitioner.training import train
    from partitioner.training.plan import predict_training

    extra = {"schedule": "1f1b", "micro_batches": MICRO_BATCHES} if strategy == "pipeline" else {}
    try:
        predicted = predict_training(str(tmp / "m.onnx"), strategy, devices, batch=batch, optimizer="sgd", **extra)
    except UsageError as exc:
        print(f"{name:<8} {backend:<12} {label:<32} not applicable: {exc}", flush=True)
        return {"not_applicable": str(exc)}
    res = train(str(tmp / "m.onnx"), str(tmp / "d.npz"), loss=loss, optimizer="sgd", lr=1e-3, batch=batch,
                epochs=2, devices=devices, backend=backend, launcher="mpi" if devices > 1 else "threads",
                strategy="data" if strategy == "single" else strategy, progress=False, threads=threads,
                out_dir=tmp / label.replace(" ", "_").replace(",", ""), **extra)
    times = [batch / h["samples_per_s"] for h in res.history[steps:]]  # epoch 2 only (warm)
    run_dir = tmp / label.replace(" ", "_").replace(",", "")
    measured_mem = [json.loads((run_dir / f"memory_rank{r}.json").read_text())["training_bytes"]
                    for r in range(devices) if (run_dir / f"memory_rank{r}.json").is_file()] or None
    med = statistics.median(times)
    # the cost model has no intra-op thread model: the 2-thread run has no prediction
    pred_s = predicted.step_time_s if threads == 1 else None
    print(f"{name:<8} {backend:<12} {label:<32} {batch / med:10.1f} samples/s  measured {med * 1e3:8.2f} ms"
          + (f"  predicted {pred_s * 1e3:8.2f} ms" if pred_s else ""), flush=True)
    return {"median_step_s": med, "samples_per_s": batch / med, "steps": len(times), "predicted_step_s": pred_s,
            "predicted_memory_per_rank": predicted.memory_per_rank if threads == 1 else None,
            "measured_memory_per_rank": measured_mem,  # MPI ranks: peak RSS - RSS with the backend loaded
            "predicted_over_measured": pred_s / med if pred_s else None}


def run_case(name: str, backend: str, steps: int) -> dict:
    import onnx

    import models_zoo

    kwargs, loss = CASES[name]
    batch = kwargs["batch"]
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model = models_zoo.build(name, **kwargs)
        onnx.save(model, str(tmp / "m.onnx"))
        _data(model, loss, batch * steps, tmp / "d.npz")
        for label, devices, strategy, threads in CONFIGS:
            results[label] = _measure(name, tmp, label, devices, strategy, threads, backend, loss, batch, steps)
    return results


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--models", default="mlp,resnet,bert")
    p.add_argument("--backend", default="onnxruntime", choices=("onnxruntime", "tvm"))
    p.add_argument("--steps", type=int, default=20)
    args = p.parse_args()
    import onnxruntime
    import tvm

    out_dir = ROOT / "benchmarks" / "results"
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in args.models.split(","):
        doc = {"model": name, "backend": args.backend, "config": CASES[name][0], "loss": CASES[name][1],
               "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                           "python": platform.python_version()},
               "versions": {"onnxruntime": onnxruntime.__version__, "tvm": tvm.__version__},
               "results": run_case(name, args.backend, args.steps),
               "note": ("threads = the backend's intra-op threads per rank; MPI ranks are pinned to half the cores "
                        "each; pipeline = 1F1B with 8 micro-batches; predicted = training cost model on cpu:<ranks>")}
        (out_dir / f"train_step_{name}_{args.backend}.json").write_text(json.dumps(doc, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
