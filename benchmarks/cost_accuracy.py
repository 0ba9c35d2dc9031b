"""How well does the analytical cost model predict single-device times?

For each zoo model and each backend B in (TVM with default schedules, ONNX Runtime):
predicted = Σ roofline op times (partitioner.cost.roofline.graph_op_times: per-class efficiency,
fused ops pay no launch) on one device calibrated *for B* (partitioner.calibrate.calibrate with
backend=B, run at the start of this script on micro-kernels only, never on these models), against
measured = the median of N runs of B on one thread (seeded random inputs, after warm-up; ORT with
intra/inter-op threads = 1 and default graph optimisations; TVM built with the default
``scheduled`` pipeline and loaded with threads=1).

For comparison the JSON also keeps the previous model ("baseline": one efficiency of 1.0 for every
op, the ORT launch overhead charged to every op, no fusion) against the ORT times.

Writes benchmarks/results/cost_accuracy.json: per model both predictions, both measurements, both
relative errors (predicted − measured) / measured, FLOPs and bytes; the median absolute relative
error per backend; the calibrated devices; the machine, package versions and date.

    .venv/bin/python benchmarks/cost_accuracy.py [--repeat 5] [--models mlp,resnet,...] [--quick]
    .venv/bin/python benchmarks/cost_accuracy.py --markdown      # the README table from the JSON
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import models_zoo  # noqa: E402
from timing import median_seconds  # noqa: E402

from partitioner.calibrate import Calibration, calibrate, cluster_from_calibration  # noqa: E402
from partitioner.cluster import Device  # noqa: E402
from partitioner.core.machine import cpu_model  # noqa: E402
from partitioner.cost.roofline import graph_op_times, op_time  # noqa: E402
from partitioner.cost.simulate import _dtype_name  # noqa: E402
from partitioner.cost.workdepth import analyze, constant_values, node_costs  # noqa: E402

# Small sizes: the whole run takes a few minutes on one core.
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
BACKENDS = ("tvm", "onnxruntime")
TVM_BUILD_LIMIT_S = 180  # a model whose TVM build takes longer is left out of the TVM column


def predict(model: ir.Model, device: Device) -> float:
    """Σ roofline op times with op classes and fusion (the model under test)."""
    graph = model.graph
    costs = node_costs(graph, constant_values(graph))
    return sum(graph_op_times(graph, device, costs, [_dtype_name(n) for n in graph]))


def predict_baseline(model: ir.Model, device: Device) -> float:
    """The previous model: device.efficiency for every op, a launch for every op, no fusion."""
    graph = model.graph
    costs = node_costs(graph, constant_values(graph))
    flat = Device(device.name, device.kind, dict(device.peak_flops), device.memory_bytes, device.memory_bandwidth,
                  1.0, device.launch_overhead_s)
    return sum(op_time(c, flat, _dtype_name(n)) for n, c in zip(graph, costs))


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


def _median(fn: Any, repeat: int) -> float:
    return median_seconds(fn, 2, repeat)


def measure_ort(proto: onnx.ModelProto, repeat: int) -> float:
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.inter_op_num_threads = 1
    sess = ort.InferenceSession(proto.SerializeToString(), so, providers=["CPUExecutionProvider"])
    feeds = _inputs(proto, np.random.default_rng(0))
    return _median(lambda: sess.run(None, feeds), repeat)


def build_tvm(proto: onnx.ModelProto, work: Path, limit_s: float) -> tuple[Path | None, float, str]:
    """Build in a subprocess (so a slow build can be stopped); (library or None, seconds, why)."""
    src, lib = work / f"{proto.graph.name or 'model'}.onnx", work / f"{proto.graph.name or 'model'}.so"
    onnx.save(proto, src)
    code = ("import sys, onnx; from backends.tvm.build import build; "
            "build(onnx.load(sys.argv[1]), sys.argv[2])")
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    t0 = time.perf_counter()
    try:
        out = subprocess.run([sys.executable, "-c", code, str(src), str(lib)], capture_output=True, text=True,
                             timeout=limit_s, env=env, cwd=ROOT, check=False)
    except subprocess.TimeoutExpired:
        return None, time.perf_counter() - t0, f"TVM build took longer than {limit_s:.0f} s"
    secs = time.perf_counter() - t0
    if out.returncode != 0:
        return None, secs, "TVM build failed: " + ((out.stderr.strip().splitlines() or ["?"])[-1])
    return lib, secs, ""


def measure_tvm(proto: onnx.ModelProto, lib: Path, repeat: int) -> float:
    from backends.tvm.executable import load
    from partitioner.runtime.comm_local import LocalWorld

    exe = load(proto, lib, threads=1)
    comm = LocalWorld(1).communicator(0)
    feeds = _inputs(proto, np.random.default_rng(0))
    return _median(lambda: exe.run(feeds, comm), repeat)


def _err(pred: float | None, meas: float | None) -> float | None:
    return None if pred is None or meas is None else (pred - meas) / meas


def _median_abs(values: list[float | None]) -> float | None:
    v = [abs(x) for x in values if x is not None]
    return statistics.median(v) if v else None


def _ms(x: float | None) -> str:
    return "—" if x is None else f"{x * 1e3:.3f}"


def _pct(x: float | None) -> str:
    return "—" if x is None else f"{x * 100:+.1f}%"


def markdown(doc: dict) -> str:
    """The README table, generated from the JSON this script writes."""
    lines = ["| model | TVM predicted ms | TVM measured ms | TVM error | ORT predicted ms | ORT measured ms | ORT error |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for r in doc["models"]:
        t, o = r["tvm"], r["onnxruntime"]
        lines.append(f"| {r['model']} | {_ms(t['predicted_s'])} | {_ms(t['measured_s'])} | {_pct(t['relative_error'])} | "
                     f"{_ms(o['predicted_s'])} | {_ms(o['measured_s'])} | {_pct(o['relative_error'])} |")
    med = doc["median_abs_relative_error"]
    base = doc.get("baseline", {}).get("median_abs_relative_error")
    skipped = [f"{r['model']} ({r['tvm']['note'].split(' (')[0][:80]})" for r in doc["models"] if r["tvm"].get("note")]
    lines.append(
        f"\nMedian absolute error: TVM {_pct(med['tvm']).lstrip('+')}, ONNX Runtime {_pct(med['onnxruntime']).lstrip('+')}"
        + (f" (the previous model, one efficiency and a launch per op: {_pct(base).lstrip('+')} against ORT)" if base is not None else "")
        + f". Each backend's device is calibrated on micro-kernels built by that backend "
          f"({doc['machine'].get('cpu', '?')}, 1 thread, {doc['date'][:10]})."
        + (f" Not in the TVM column: {'; '.join(skipped)}." if skipped else ""))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--models", default=None, help="comma-separated subset of: " + ",".join(MODELS))
    ap.add_argument("--quick", action="store_true", help="3 repeats, quick calibration, the builder models only")
    ap.add_argument("--backends", default=",".join(BACKENDS), help="comma-separated subset of: tvm,onnxruntime")
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
    backends = [b for b in args.backends.split(",") if b]
    repeat = 3 if args.quick else args.repeat

    cals: dict[str, Calibration] = {}
    devices: dict[str, Device] = {}
    for b in backends:
        print(f"calibrating the {b} backend on micro-kernels ...", flush=True)
        cals[b] = calibrate(quick=args.quick, backend=b, mpi=False)
        devices[b] = cluster_from_calibration(cals[b], 1).devices[0]
        print("  " + ", ".join(f"{k} {v:.2f}" for k, v in cals[b].efficiency_by_class.items())
              + f"; launch {cals[b].launch_overhead_s * 1e6:.2f} µs", flush=True)

    rows = []
    with tempfile.TemporaryDirectory(prefix="cost-accuracy-") as tmp:
        for name in names:
            proto = models_zoo.build(name, **MODELS.get(name, {}))
            proto = onnx.shape_inference.infer_shapes(proto, data_prop=True)
            model = ir.serde.deserialize_model(proto)
            stats = analyze(model)
            row: dict[str, Any] = {"model": name, "args": MODELS.get(name, {}), "flops": stats.total_flops,
                                   "bytes": stats.total_bytes, "nodes": stats.num_nodes}
            for b in BACKENDS:
                cell: dict[str, Any] = {"predicted_s": None, "measured_s": None, "relative_error": None}
                if b in devices:
                    cell["predicted_s"] = predict(model, devices[b])
                    if b == "onnxruntime":
                        cell["measured_s"] = measure_ort(proto, repeat)
                    else:
                        lib, secs, why = build_tvm(proto, Path(tmp), TVM_BUILD_LIMIT_S)
                        cell["build_s"] = round(secs, 2)
                        if lib is None:
                            cell["note"] = why
                        else:
                            cell["measured_s"] = measure_tvm(proto, lib, repeat)
                    cell["relative_error"] = _err(cell["predicted_s"], cell["measured_s"])
                row[b] = cell
            if "onnxruntime" in devices:
                base = predict_baseline(model, devices["onnxruntime"])
                row["baseline"] = {"predicted_s": base,
                                   "relative_error": _err(base, row["onnxruntime"]["measured_s"])}
            rows.append(row)
            print(f"{name:20s} " + "  ".join(
                f"{b}: pred {_ms(row[b]['predicted_s'])} ms meas {_ms(row[b]['measured_s'])} ms "
                f"err {_pct(row[b]['relative_error'])}" for b in BACKENDS if b in devices), flush=True)

    import onnxruntime
    import tvm

    med = {b: _median_abs([r[b]["relative_error"] for r in rows]) for b in BACKENDS}
    doc = {
        "benchmark": "cost_accuracy",
        "description": ("roofline prediction (per-class efficiency, fused ops launch nothing) on one device "
                        "calibrated for each backend on micro-kernels, vs that backend's measured time, "
                        "1 thread, median of runs"),
        "devices": {b: {"calibration": cals[b].to_json(), **devices[b].to_json()} for b in devices},
        "repeat": repeat,
        "models": rows,
        "median_abs_relative_error": med,
        "baseline": {"description": "previous model: efficiency 1.0 and one ORT launch per op, no classes, no fusion; "
                                    "against ORT",
                     "median_abs_relative_error": _median_abs([r.get("baseline", {}).get("relative_error")
                                                               for r in rows])},
        "machine": {"cpu": cpu_model(), "cores": os.cpu_count(), "platform": platform.platform(),
                    "loadavg_at_end": list(os.getloadavg())},  # other jobs on the cores skew the measured times
        "versions": {"python": platform.python_version(), "numpy": np.__version__, "onnx": onnx.__version__,
                     "onnxruntime": onnxruntime.__version__, "onnx_ir": ir.__version__, "tvm": str(tvm.__version__)},
        "date": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2) + "\n")
    print("median |relative error|: " + ", ".join(f"{b} {_pct(v)}" for b, v in med.items())
          + f"; baseline (ORT) {_pct(doc['baseline']['median_abs_relative_error'])}; wrote {out}")
    return 0



if __name__ == "__main__":
    sys.exit(main())
