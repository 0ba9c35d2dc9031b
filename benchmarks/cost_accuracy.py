"""How well does the analytical cost model predict single-device times?

For each zoo model: predicted = Σ roofline op times (partitioner.cost.roofline) on one device of
the ``local`` cluster (the last ``partitioner calibrate``; ``cpu:1`` nominal numbers when there
is none), against measured = the median of N runs of ONNX Runtime on one thread (intra- and
inter-op threads = 1, default graph optimisations, seeded random inputs, after warm-up).

Writes benchmarks/results/cost_accuracy.json: per model the prediction, the measurement, the
relative error (predicted − measured) / measured, FLOPs and bytes; the median absolute relative
error; the device constants used; the machine and package versions.

    .venv/bin/python benchmarks/cost_accuracy.py [--repeat 5] [--models mlp,resnet,...] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import models_zoo  # noqa: E402

from partitioner.cluster import Cluster, calibration_path, cpu_cluster  # noqa: E402
from partitioner.cost.roofline import op_time  # noqa: E402
from partitioner.cost.simulate import _dtype_name  # noqa: E402
from partitioner.cost.workdepth import analyze, constant_values, node_costs  # noqa: E402

# Small sizes: the whole run takes a minute or two on one core.
MODELS: dict[str, dict[str, Any]] = {
    "mlp": {},
    "resnet": {"depth": 18, "image": 112},
    "bert": {},
    "gpt": {},
    "unet": {},
    "inception": {},
    "mobilenet": {},
    "light_squeezenet": {},
    "light_inception_v1": {},
    "light_resnet50": {},
}


def _device() -> tuple[Any, str]:
    if calibration_path().is_file():
        return Cluster.resolve("local").devices[0], f"local ({calibration_path()})"
    return cpu_cluster(1).devices[0], "cpu:1 (nominal, not calibrated)"


def predict(model: ir.Model, device: Any) -> float:
    graph = model.graph
    costs = node_costs(graph, constant_values(graph))
    return sum(op_time(c, device, _dtype_name(n)) for n, c in zip(graph, costs))


def _inputs(proto: onnx.ModelProto, rng: np.random.Generator) -> dict[str, np.ndarray]:
    inits = {i.name for i in proto.graph.initializer}
    feeds = {}
    for vi in proto.graph.input:
        if vi.name in inits:
            continue
        t = vi.type.tensor_type
        shape = [d.dim_value if d.dim_value > 0 else 1 for d in t.shape.dim]
        dtype = onnx.helper.tensor_dtype_to_np_dtype(t.elem_type)
        if np.issubdtype(dtype, np.integer):
            feeds[vi.name] = rng.integers(0, 2, size=shape).astype(dtype)
        else:
            feeds[vi.name] = rng.standard_normal(shape).astype(dtype)
    return feeds


def measure(proto: onnx.ModelProto, repeat: int) -> float:
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.inter_op_num_threads = 1
    sess = ort.InferenceSession(proto.SerializeToString(), so, providers=["CPUExecutionProvider"])
    feeds = _inputs(proto, np.random.default_rng(0))
    for _ in range(2):
        sess.run(None, feeds)
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        sess.run(None, feeds)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def markdown(doc: dict) -> str:
    """The README table, generated from the JSON this script writes."""
    lines = ["| model | predicted ms | measured ms (ORT, 1 thread) | error |", "|---|---:|---:|---:|"]
    for r in doc["models"]:
        lines.append(f"| {r['model']} | {r['predicted_s'] * 1e3:.3f} | {r['measured_s'] * 1e3:.3f} | "
                     f"{r['relative_error'] * 100:+.1f}% |")
    lines.append(f"\nMedian absolute error {doc['median_abs_relative_error'] * 100:.1f}% "
                 f"({doc['machine'].get('cpu', '?')}, {doc['date'][:10]}, device: {doc['device']['source']}).")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--models", default=None, help="comma-separated subset of: " + ",".join(MODELS))
    ap.add_argument("--quick", action="store_true", help="3 repeats and the builder models only")
    ap.add_argument("-o", "--output", default=str(ROOT / "benchmarks" / "results" / "cost_accuracy.json"))
    ap.add_argument("--markdown", action="store_true", help="print the README table from the JSON and exit")
    args = ap.parse_args(argv)
    if args.markdown:
        print(markdown(json.loads(Path(args.output).read_text())))
        return 0
    names = list(MODELS)
    if args.models:
        names = [n for n in args.models.split(",") if n]
    elif args.quick:
        names = [n for n in names if not n.startswith("light_")]
    repeat = 3 if args.quick else args.repeat
    device, device_src = _device()

    rows = []
    for name in names:
        proto = models_zoo.build(name, **MODELS.get(name, {}))
        proto = onnx.shape_inference.infer_shapes(proto, data_prop=True)
        model = ir.serde.deserialize_model(proto)
        stats = analyze(model)
        predicted = predict(model, device)
        measured = measure(proto, repeat)
        rel = (predicted - measured) / measured
        rows.append({"model": name, "args": MODELS.get(name, {}), "predicted_s": predicted, "measured_s": measured,
                     "relative_error": rel, "flops": stats.total_flops, "bytes": stats.total_bytes,
                     "nodes": stats.num_nodes})
        print(f"{name:20s} predicted {predicted * 1e3:9.3f} ms  measured {measured * 1e3:9.3f} ms  "
              f"error {rel * 100:+7.1f}%", flush=True)

    import onnxruntime

    med = statistics.median(abs(r["relative_error"]) for r in rows) if rows else None
    doc = {
        "benchmark": "cost_accuracy",
        "description": "roofline prediction on one calibrated device vs ONNX Runtime, 1 thread, median of runs",
        "device": {"source": device_src, **device.to_json()},
        "repeat": repeat,
        "models": rows,
        "median_abs_relative_error": med,
        "machine": {"cpu": _cpu_name(), "cores": os.cpu_count(), "platform": platform.platform()},
        "versions": {"python": platform.python_version(), "numpy": np.__version__, "onnx": onnx.__version__,
                     "onnxruntime": onnxruntime.__version__, "onnx_ir": ir.__version__},
        "date": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"median |relative error| = {med * 100:.1f}% ; wrote {out}" if med is not None else f"wrote {out}")
    return 0


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


if __name__ == "__main__":
    sys.exit(main())
