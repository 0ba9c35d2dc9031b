"""A model larger than protobuf's 2 GB, end to end (issue 14's "Done when" row).

The model: ``--layers`` MatMul+Relu blocks with ``--hidden`` x ``--hidden`` float32 weights
(default ten 8192 x 8192, 2.68 GB), saved the standard way: a small ``big.onnx`` plus one
external data file ``big.data``, written one weight at a time from a seeded stream (the
benchmark itself never holds more than one weight).

Each step runs the CLI in a fresh process and records wall seconds, the process's peak RSS
(``getrusage`` in the child), the exit code and, on failure, the one-line error:

1. ``inspect`` and ``plan --cluster cpu:R --memory-limit L`` (lazy weights: RSS should not
   grow with the model);
2. ``compile -o DIR --cluster cpu:R --memory-limit L --backend B``: compile time, compile peak
   RSS and the artifact's bytes on disk;
3. ``run DIR --check --json`` (the ONNX Runtime reference runs in its own process) and
   ``bench DIR --json`` when compile succeeded: step time and every rank's peak RSS (VmHWM, as
   the MPI workers report it).

A step that fails is recorded as failed, with its message: the row says what works today.

Accuracy (why ``run --check`` gets a stated ``--atol`` here, docs/large_models.md): both backends
sum K = ``--hidden`` float32 products per output element, and the check's reference (ONNX
Runtime) rounds too. TVM's contraction kernel sums each element in order, one fused multiply-add
at a time (``tests/test_large_models.py`` proves it bit for bit); the rounding error of such a sum
is a random walk over its partial sums, with standard deviation about ``u * K * t / sqrt(2)``
(``u = 2**-24``, ``t`` the size of one term). With inputs ~ N(0, 1) and He-initialised weights
(std ``sqrt(2 / K)``, activations stay O(1) through the ReLUs), ``t = sqrt(2 / K)`` and that is
``u * sqrt(K)`` per layer, ``u * sqrt(K * layers)`` after ``layers`` of them. An output near zero
(a sum that cancels) keeps that absolute error while its ``rtol * |want|`` share vanishes, so the
default ``atol`` 1e-5 is under one standard deviation at K = 8192 over ten layers (about 1.7e-5):
a correct run misses it by chance on such an element. The check therefore uses ``atol = 6 * u * sqrt(K * layers)``
(:func:`stated_atol`; 1.0e-4 for the default model, still 4 orders of magnitude under the O(1)
error of a wrong shard, offset or transposition) with the default ``rtol``. The row also records
the error of the run and of ONNX Runtime against a float64 evaluation of the same model, and
whether the default tolerance held.

Writes ``benchmarks/results/large_model.json`` (machine, versions, the rows). Memory and byte
figures hold on a loaded machine; the seconds do not (a row says ``"times": "loaded"`` unless
``--quiet-machine`` is given by whoever ran it on an idle one):

    python benchmarks/large_model.py --ranks 4 --memory-limit 1GiB --backend tvm --quiet-machine
    python benchmarks/large_model.py --ranks 4 --memory-limit 1GiB --backend onnxruntime --quiet-machine
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "large_model.json"
UNIT_ROUNDOFF = 2.0**-24  # float32
DEFAULT_RTOL, DEFAULT_ATOL = 1e-4, 1e-5  # run --check's defaults

_MEASURE = """
import sys
from partitioner.cli import main
from partitioner.core.machine import peak_rss_bytes
try:
    rc = main(sys.argv[1:])
except SystemExit as exc:
    rc = exc.code if isinstance(exc.code, int) else 1
sys.stdout.flush()
sys.stderr.write("PEAK_RSS_BYTES %d\\n" % peak_rss_bytes())
sys.exit(rc)
"""


def make_model(folder: Path, hidden: int, layers: int, seed: int = 0) -> Path:
    """The model of the module docstring; returns the .onnx path."""
    import onnx
    from onnx import TensorProto, helper

    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    nodes, inits, x, offset = [], [], "x", 0
    with open(folder / "big.data", "wb") as data:
        for i in range(layers):
            w = (rng.standard_normal((hidden, hidden), dtype=np.float32) * np.float32(np.sqrt(2.0 / hidden)))
            data.write(w.tobytes())
            del w
            t = TensorProto(name=f"w{i}", data_type=TensorProto.FLOAT, dims=[hidden, hidden],
                            data_location=TensorProto.EXTERNAL)
            for key, value in (("location", "big.data"), ("offset", str(offset)), ("length", str(4 * hidden * hidden))):
                entry = t.external_data.add()
                entry.key, entry.value = key, value
            offset += 4 * hidden * hidden
            inits.append(t)
            nodes += [helper.make_node("MatMul", [x, f"w{i}"], [f"h{i}"], name=f"mm{i}"),
                      helper.make_node("Relu", [f"h{i}"], [f"r{i}"], name=f"relu{i}")]
            x = f"r{i}"
    graph = helper.make_graph(nodes, "big", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, hidden])],
                              [helper.make_tensor_value_info(x, TensorProto.FLOAT, [4, hidden])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    (folder / "big.onnx").write_bytes(model.SerializeToString())
    return folder / "big.onnx"


def stated_atol(hidden: int, layers: int) -> float:
    """The check's absolute tolerance for this model: 6 standard deviations of the rounding error
    of in-order float32 sums of ``hidden`` terms over ``layers`` layers (module docstring)."""
    return 6.0 * UNIT_ROUNDOFF * float(np.sqrt(hidden * layers))


def seeded_input(hidden: int, seed: int = 0) -> np.ndarray:
    """``x`` as ``run`` would draw it without ``--inputs`` (N(0, 1), float32)."""
    return np.random.default_rng(seed).standard_normal((4, hidden)).astype(np.float32)


def float64_outputs(folder: Path, x: np.ndarray, hidden: int, layers: int) -> np.ndarray:
    """The model evaluated in float64 from the memory-mapped weights, one weight at a time."""
    weights = np.memmap(folder / "big.data", dtype=np.float32, mode="r", shape=(layers, hidden, hidden))
    a = x.astype(np.float64)
    for i in range(layers):
        a = np.maximum(a @ np.asarray(weights[i], dtype=np.float64), 0.0)
    del weights
    return a


def onnxruntime_outputs(path: Path, inputs: Path, work: Path, timeout: float) -> np.ndarray | None:
    """ONNX Runtime on the whole model in a process of its own (the same program ``run --check``
    uses), or None when it fails."""
    from partitioner.runtime.worker import read_npz

    out = work / "onnxruntime_outputs.npz"
    proc = subprocess.run([sys.executable, "-m", "partitioner.runtime.reference", str(path), str(inputs), str(out),
                           "--threads", str(os.cpu_count() or 1)], capture_output=True, text=True, cwd=ROOT,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=timeout)
    if proc.returncode != 0 or not out.is_file():
        return None
    return next(iter(read_npz(out, what="reference outputs").values()))


def accuracy(row: dict, work: Path, path: Path, x: np.ndarray, timeout: float) -> None:
    """The row's accuracy fields: the run and ONNX Runtime against float64, and whether the run
    meets ONNX Runtime at the default tolerance (module docstring)."""
    from partitioner.runtime.worker import read_npz

    want = float64_outputs(path.parent, x, row["hidden"], row["layers"])
    row["output_max_abs"] = float(np.abs(want).max())
    got = next(iter(read_npz(work / "run_outputs.npz", what="run outputs").values())).astype(np.float64)
    row["run_vs_float64_max_abs"] = float(np.abs(got - want).max())
    ort = onnxruntime_outputs(path, work / "inputs.npz", work, timeout)
    if ort is not None:
        ort = ort.astype(np.float64)
        row["onnxruntime_vs_float64_max_abs"] = float(np.abs(ort - want).max())
        diff = np.abs(got - ort)
        row["default_tolerance_ok"] = bool(np.all(diff <= DEFAULT_ATOL + DEFAULT_RTOL * np.abs(ort)))


def cli(*args: str, timeout: float) -> dict:
    """One CLI command in a fresh process: seconds, peak RSS, exit code, error line, stdout."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    t0 = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, "-c", _MEASURE, *args], capture_output=True, text=True, env=env,
                              cwd=ROOT, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"ok": False, "seconds": time.perf_counter() - t0, "error": f"timed out after {timeout:.0f} s"}
    seconds = time.perf_counter() - t0
    lines = proc.stderr.splitlines()
    rss = [int(x.split()[1]) for x in lines if x.startswith("PEAK_RSS_BYTES")]
    errors = [x for x in lines if x.startswith("partitioner: error:")]
    return {"ok": proc.returncode == 0, "rc": proc.returncode, "seconds": seconds,
            "peak_rss_bytes": rss[0] if rss else None, "error": errors[0] if errors else None,
            "stdout": proc.stdout}


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def check_run(row: dict, steps: dict[str, dict], art: Path, work: Path, path: Path,
              args: argparse.Namespace) -> None:
    """``run --check`` with seeded inputs and the stated tolerance, then the accuracy fields."""
    from partitioner.runtime.worker import write_npz

    x = seeded_input(args.hidden)
    write_npz(work / "inputs.npz", {"x": x})
    row["check_rtol"], row["check_atol"] = DEFAULT_RTOL, stated_atol(args.hidden, args.layers)
    steps["run_check"] = cli("run", str(art), "--check", "--json", "--inputs", str(work / "inputs.npz"),
                             "--outputs", str(work / "run_outputs.npz"), "--rtol", repr(row["check_rtol"]),
                             "--atol", repr(row["check_atol"]), timeout=args.timeout)
    if not steps["run_check"]["stdout"].strip():
        return
    check = json.loads(steps["run_check"]["stdout"]).get("check") or {}
    row["check_ok"] = bool(check.get("ok")) and not check.get("skipped")
    row["check_max_abs"] = max((o["max_abs"] for o in check.get("outputs", [])), default=None)
    row["check_skipped"] = check.get("skipped")
    if (work / "run_outputs.npz").is_file():
        accuracy(row, work, path, x, args.timeout)


def run(args: argparse.Namespace) -> dict:
    work = Path(args.workdir or tempfile.mkdtemp(prefix="large-model-"))
    t0 = time.perf_counter()
    load = os.getloadavg()
    path = make_model(work / "model", args.hidden, args.layers)
    weights = (work / "model" / "big.data").stat().st_size
    row: dict = {"hidden": args.hidden, "layers": args.layers, "weight_bytes": weights, "ranks": args.ranks,
                 "memory_limit": args.memory_limit, "backend": args.backend,
                 "times": "quiet" if args.quiet_machine else "loaded", "load_average_at_start": list(load),
                 "make_model_s": time.perf_counter() - t0}
    cluster = ["--cluster", f"cpu:{args.ranks}", "--memory-limit", args.memory_limit]
    steps: dict[str, dict] = {}
    steps["inspect"] = cli("inspect", str(path), "--json", timeout=args.timeout)
    steps["plan"] = cli("plan", str(path), *cluster, "--json", timeout=args.timeout)
    art = work / "artifact"
    steps["compile"] = cli("compile", str(path), "-o", str(art), *cluster, "--backend", args.backend, "--json",
                           timeout=args.timeout)
    if steps["compile"]["ok"]:
        row["artifact_bytes"] = dir_bytes(art)
        row["artifact_over_weights"] = row["artifact_bytes"] / weights
        check_run(row, steps, art, work, path, args)
        steps["bench"] = cli("bench", str(art), "--json", "--repeat", str(args.repeat), timeout=args.timeout)
        if steps["bench"]["ok"]:
            part = json.loads(steps["bench"]["stdout"])["results"]["partitioned"]
            row["step_time_s"] = part["median_s"]
            row["per_rank_peak_rss_bytes"] = part.get("per_rank_peak_rss_bytes")
    rss = row.get("per_rank_peak_rss_bytes") or []
    row["max_rank_peak_rss_bytes"] = max(rss) if rss else None
    for name, step in steps.items():
        step.pop("stdout", None)
        row[f"{name}_s"] = step["seconds"]
        row[f"{name}_peak_rss_bytes"] = step.get("peak_rss_bytes")
        row[f"{name}_ok"] = step["ok"]
        if not step["ok"]:
            row[f"{name}_error"] = step.get("error")
    return row


def versions() -> dict:
    import onnx
    import onnx_ir
    import onnxruntime

    return {"python": platform.python_version(), "onnx": onnx.__version__, "onnx_ir": onnx_ir.__version__,
            "onnxruntime": onnxruntime.__version__}


def _gib(n: float | None) -> str:
    return "—" if n is None else f"{n / 2**30:.2f}"


def _err(v: float | None) -> str:
    return "—" if v is None else f"{v:.1e}"


def markdown(doc: dict) -> str:
    """The README table (benchmarks/readme_tables.py): one line per recorded row."""
    lines = ["| model | ranks | backend | compile s | compile peak RSS GiB | max rank peak RSS GiB | "
             "artifact / weights | check vs ORT (atol) | max error vs float64: run / ORT | step s | times |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in doc["rows"]:
        check = "ok" if r.get("check_ok") else (r.get("check_skipped") or r.get("run_check_error") or "failed")
        if r.get("check_atol") is not None:
            check += f" ({r['check_atol']:.1e})"
        step = f"{r['step_time_s']:.3f}" if r.get("step_time_s") is not None else "—"
        ratio = f"{r['artifact_over_weights']:.3f}" if r.get("artifact_over_weights") is not None else "—"
        lines.append(f"| {r['layers']} x {r['hidden']}² fp32 ({r['weight_bytes'] / 1e9:.2f} GB) | {r['ranks']} | "
                     f"{r['backend']} | {r['compile_s']:.1f} | {_gib(r.get('compile_peak_rss_bytes'))} | "
                     f"{_gib(r.get('max_rank_peak_rss_bytes'))} | {ratio} | {check} | "
                     f"{_err(r.get('run_vs_float64_max_abs'))} / {_err(r.get('onnxruntime_vs_float64_max_abs'))} | "
                     f"{step} | {r.get('times', 'loaded')} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=8192)
    ap.add_argument("--layers", type=int, default=10)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--memory-limit", default="1GiB")
    ap.add_argument("--backend", default="tvm", choices=("onnxruntime", "tvm"))
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per step")
    ap.add_argument("--repeat", type=int, default=5, help="timed steps of the bench step")
    ap.add_argument("--workdir", default=None, help="where the model and artifact go (default: a temp folder)")
    ap.add_argument("--quiet-machine", action="store_true",
                    help="say the machine was otherwise idle (the row's seconds are then marked quiet, not loaded)")
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--markdown", action="store_true", help="print the README table of --out's JSON and exit")
    args = ap.parse_args()
    if args.markdown:
        print(markdown(json.loads(Path(args.out).read_text(encoding="utf-8"))))
        return
    keep = args.workdir is not None
    args.workdir = args.workdir or tempfile.mkdtemp(prefix="large_model-")
    try:
        row = run(args)
    finally:
        if not keep:  # the model and artifact are gigabytes
            shutil.rmtree(args.workdir, ignore_errors=True)
    from partitioner.core.machine import machine_info

    key = ("backend", "hidden", "layers", "ranks", "memory_limit")
    rows = [row]
    if Path(args.out).is_file():  # keep the rows of other configurations (e.g. the other backend)
        old = json.loads(Path(args.out).read_text(encoding="utf-8")).get("rows", [])
        rows = [r for r in old if tuple(r.get(k) for k in key) != tuple(row[k] for k in key)] + rows
    doc = {"benchmark": "large_model", "machine": machine_info(), "versions": versions(), "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    print(json.dumps(row, indent=1))


if __name__ == "__main__":
    main()
