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
Writes ``benchmarks/results/large_model.json`` (machine, versions, the rows). Timings are only
meaningful on a quiet machine:

    python benchmarks/large_model.py --ranks 4 --memory-limit 1GiB --backend onnxruntime
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


def run(args: argparse.Namespace) -> dict:
    work = Path(args.workdir or tempfile.mkdtemp(prefix="large-model-"))
    t0 = time.perf_counter()
    path = make_model(work / "model", args.hidden, args.layers)
    weights = (work / "model" / "big.data").stat().st_size
    row: dict = {"hidden": args.hidden, "layers": args.layers, "weight_bytes": weights, "ranks": args.ranks,
                 "memory_limit": args.memory_limit, "backend": args.backend,
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
        steps["run_check"] = cli("run", str(art), "--check", "--json", timeout=args.timeout)
        if steps["run_check"]["ok"]:
            check = json.loads(steps["run_check"]["stdout"]).get("check") or {}
            row["check_ok"] = bool(check.get("ok")) and not check.get("skipped")
            row["check_max_abs"] = max((o["max_abs"] for o in check.get("outputs", [])), default=None)
            row["check_skipped"] = check.get("skipped")
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


def markdown(doc: dict) -> str:
    """The README table (benchmarks/readme_tables.py): one line per recorded row."""
    lines = ["| model | ranks | backend | compile s | compile peak RSS GiB | max rank peak RSS GiB | "
             "artifact / weights | check | step s |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in doc["rows"]:
        check = "ok" if r.get("check_ok") else (r.get("check_skipped") or r.get("run_check_error") or "failed")
        step = f"{r['step_time_s']:.3f}" if r.get("step_time_s") is not None else "—"
        ratio = f"{r['artifact_over_weights']:.3f}" if r.get("artifact_over_weights") is not None else "—"
        lines.append(f"| {r['layers']} x {r['hidden']}² fp32 ({r['weight_bytes'] / 1e9:.2f} GB) | {r['ranks']} | "
                     f"{r['backend']} | {r['compile_s']:.1f} | {_gib(r.get('compile_peak_rss_bytes'))} | "
                     f"{_gib(r.get('max_rank_peak_rss_bytes'))} | {ratio} | {check} | {step} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=8192)
    ap.add_argument("--layers", type=int, default=10)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--memory-limit", default="1GiB")
    ap.add_argument("--backend", default="onnxruntime", choices=("onnxruntime", "tvm"))
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per step")
    ap.add_argument("--repeat", type=int, default=5, help="timed steps of the bench step")
    ap.add_argument("--workdir", default=None, help="where the model and artifact go (default: a temp folder)")
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
