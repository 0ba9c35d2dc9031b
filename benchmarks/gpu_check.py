"""The device check: GPU artifacts built, run, checked against ONNX Runtime and timed (``make gpu-check``).

    python benchmarks/gpu_check.py [--target h200] [--quick] [--budget-s 540]
    python benchmarks/gpu_check.py --build-only DIR     # cross-compile them here, no GPU needed
    python benchmarks/gpu_check.py --artifacts DIR      # run artifacts built earlier (e.g. on a CPU machine)
    python benchmarks/gpu_check.py --markdown [--json FILE]   # render the saved table (README)

Steps, in one process, under 10 minutes on one GPU machine:
1. Probe: the CUDA driver must report a GPU whose compute capability runs the target's cubins
   (``backends/cuda_devices.py``); otherwise one line on stderr and exit 2, before any
   build. The NVRTC toolchain (``pip install .[cuda]``) must be installed (exit 2 otherwise).
2. Build the zoo ``resnet``, ``bert`` and ``gpt`` for 1 and 2 GPUs (``--target``, default h200;
   the planner uses the matching GPU cluster preset). 1 GPU: strategy ``single``; 2 GPUs:
   ``data`` for resnet, ``tensor`` for bert and gpt (so the 2-GPU run really uses both GPUs and
   their comm ops). With ``--artifacts DIR``, ``DIR/<model>_<ranks>gpu`` built earlier are used.
3. Run each artifact under ``mpiexec`` (``--warmup`` + ``--repeat`` steps; the median step time)
   and compare every output with ONNX Runtime on the unpartitioned model: its CUDA provider when
   ``onnxruntime-gpu`` provides one, else its CPU provider. Tolerance ``|got - want| <= atol +
   rtol * |want|``, rtol 1e-3, atol 1e-4 (float32 kernels in another order, and CUDA's fast
   math for exp/erf/tanh).
4. Per-device speed: the 1-GPU median step against ONNX Runtime's CUDA provider on the same
   inputs (median of the same number of runs; both include host<->device copies of inputs and
   outputs). Without the CUDA provider the comparison is recorded as missing, with the reason.
5. Write ``benchmarks/results/gpu.json`` (machine, GPUs, versions, rows); exit 1 when any check
   fails. Work that would start after ``--budget-s`` is skipped and listed, so the run ends in time.
When two ranks share one GPU (a 1-GPU machine), both run on it and the comm ops stage through the
host (NCCL needs one GPU per rank); the row records which path ran.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "gpu.json"
RTOL, ATOL = 1e-3, 1e-4

# name -> (zoo name, builder kwargs, 2-GPU strategy)
MODELS: dict[str, tuple[str, dict[str, Any], str]] = {
    "resnet": ("resnet", {"depth": 18, "image": 224, "batch": 8}, "data"),
    "bert": ("bert", {"seq": 128, "hidden": 256, "heads": 4, "layers": 4, "batch": 8}, "tensor"),
    "gpt": ("gpt", {"seq": 128, "hidden": 256, "heads": 4, "layers": 4, "batch": 8}, "tensor"),
}
QUICK: dict[str, dict[str, Any]] = {  # --quick: small sizes, to check the machinery in a minute
    "resnet": {"depth": 18, "image": 64, "batch": 2}, "bert": {"seq": 32, "batch": 2}, "gpt": {"seq": 32, "batch": 2},
}
# --small: the full sizes' shapes and batch with a quarter of the channels (a sixteenth of the
# weights), so that the six artifacts built here fit the lent device's 64 MiB transfer
# (benchmarks/device_bundle.py): an artifact holds its weights three times (source.onnx,
# rank<i>.data and packed in rank<i>.so), and at full size resnet's two are 365 MB
SMALL: dict[str, dict[str, Any]] = {
    "resnet": {**MODELS["resnet"][1], "width": 16},
    "bert": {**MODELS["bert"][1], "hidden": 64},
    "gpt": {**MODELS["gpt"][1], "hidden": 64},
}


def model_sizes(key: str, args: argparse.Namespace) -> dict[str, Any]:
    """The zoo builder's arguments for ``key`` under --quick / --small / the full sizes."""
    return QUICK[key] if args.quick else SMALL[key] if args.small else MODELS[key][1]


class CheckRefused(Exception):
    """The machine cannot run the check (no GPU, wrong GPU, no toolchain): one line, exit 2."""


def probe(target: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(target dict, visible GPUs) or CheckRefused naming what is missing."""
    from backends.cuda_devices import gpu_mismatch, visible_gpus

    gpus = visible_gpus()  # first, and cheap: the driver alone, before TVM is imported
    if not gpus:
        raise CheckRefused("gpu-check: no CUDA GPU is visible on this machine (no driver, no device, or "
                           "CUDA_VISIBLE_DEVICES is empty); run it on a machine with a GPU")
    from backends.tvm.target import target_dict
    from partitioner.core.errors import PartitionerError

    try:
        tdict = target_dict(target)
    except PartitionerError as e:
        raise CheckRefused(f"gpu-check: {e}") from None
    if tdict.get("kind") != "cuda":
        raise CheckRefused(f"gpu-check: --target {target} is not a GPU target; use h100, h200, a100 or l4")
    problem = gpu_mismatch(str(tdict["arch"]), gpus)
    if problem is not None:
        raise CheckRefused(f"gpu-check: --target {target}: {problem}")
    return tdict, [g.to_json() for g in gpus]


def _reference_session(model_bytes: bytes) -> tuple[Any, str]:
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    if "CUDAExecutionProvider" in ort.get_available_providers():
        sess = ort.InferenceSession(model_bytes, opts, providers=["CUDAExecutionProvider", "CPUExecutionProvider"])
        if "CUDAExecutionProvider" in sess.get_providers():
            return sess, "CUDAExecutionProvider"
    return ort.InferenceSession(model_bytes, opts, providers=["CPUExecutionProvider"]), "CPUExecutionProvider"


def _median_run(sess: Any, feeds: dict[str, np.ndarray], warmup: int, repeat: int) -> float:
    from timing import median_seconds

    return median_seconds(lambda: sess.run(None, feeds), warmup, repeat)


def _compare(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> dict[str, Any]:
    rows, ok = [], set(got) == set(want)
    for name, ref in want.items():
        g = np.asarray(got.get(name))
        if g.shape != ref.shape:
            rows.append({"name": name, "ok": False, "note": f"shape {list(g.shape)} != {list(ref.shape)}"})
            ok = False
            continue
        diff = np.abs(g.astype(np.float64) - ref.astype(np.float64))
        bound = ATOL + RTOL * np.abs(ref.astype(np.float64))
        good = bool(np.all(diff <= bound))
        ok = ok and good
        rows.append({"name": name, "ok": good, "max_abs": float(diff.max(initial=0.0)),
                     "max_rel": float((diff / np.maximum(np.abs(ref), 1e-12)).max(initial=0.0))})
    return {"ok": ok, "rtol": RTOL, "atol": ATOL, "outputs": rows}


def check_model(key: str, zoo_kwargs: dict[str, Any], strategy2: str, tdict: dict[str, Any], args: argparse.Namespace,
                deadline: float, out_dir: Path) -> list[dict[str, Any]]:
    import models_zoo
    from partitioner.compiler import compile as compile_artifact
    from partitioner.compiler import load_artifact
    from partitioner.runtime.launch import run_artifact

    model = models_zoo.build(MODELS[key][0], **zoo_kwargs)
    feeds = models_zoo.sample_inputs(model, 0)
    ref_sess, provider = _reference_session(model.SerializeToString())
    want = dict(zip([o.name for o in ref_sess.get_outputs()], ref_sess.run(None, feeds)))
    ort_cuda_s = None
    if provider == "CUDAExecutionProvider":
        ort_cuda_s = _median_run(ref_sess, feeds, args.warmup, args.repeat)
    no_ort_cuda = ort_cuda_s is None and not args.cpu_dry_run
    torch_ref = _torch_reference(model, feeds, want, args) if no_ort_cuda else {}
    rows = []
    for ranks in args.ranks:
        row: dict[str, Any] = {"model": key, "zoo": MODELS[key][0], "params": zoo_kwargs, "ranks": ranks,
                               "reference_provider": provider}
        rows.append(row)
        if time.monotonic() > deadline:
            row["skipped"] = f"over the --budget-s {args.budget_s:g} s"
            continue
        strategy = "single" if ranks == 1 else strategy2
        name = f"{key}_{ranks}gpu"
        try:
            t0 = time.perf_counter()
            if args.artifacts:
                art = load_artifact(Path(args.artifacts) / name)
                row["built"] = "given"
            else:
                from backends.tvm.target import gpu_cluster_spec

                cluster = gpu_cluster_spec(tdict, ranks) or f"cpu:{ranks}"  # cpu: --cpu-dry-run
                art = compile_artifact(model, cluster, strategy=strategy, target=tdict, out_dir=out_dir / name,
                                       progress=False)
                row["build_s"] = round(time.perf_counter() - t0, 2)
            row.update(strategy=art.manifest["plan_summary"].get("strategy", strategy), world_size=art.world_size,
                       arch=(art.manifest.get("target") or {}).get("arch"))
            res = run_artifact(art, feeds, warmup=args.warmup, repeat=args.repeat, timeout=args.run_timeout)
            row["check"] = _compare(res.outputs, want)
            timings = res.timings or {}
            row["median_s"] = timings.get("median_s")
            row["gpu_comm"] = sorted({json.dumps(r.get("gpu_comm")) for r in timings.get("ranks") or []
                                      if r.get("gpu_comm")})
            row["gpu_comm"] = [json.loads(x) for x in row["gpu_comm"]]
            if ranks == 1:
                row["ort_cuda_median_s"] = ort_cuda_s
                if ort_cuda_s and row["median_s"]:
                    row["speed_vs_ort_cuda"] = round(ort_cuda_s / row["median_s"], 3)  # > 1: faster than ORT
                elif ort_cuda_s is None:
                    row["speed_vs_ort_cuda"] = None
                    row["why_no_ort_cuda"] = "onnxruntime has no CUDAExecutionProvider here (pip install onnxruntime-gpu)"
                    row.update(torch_ref)
        except Exception as e:  # noqa: BLE001 - recorded per row; the check fails at the end
            row["error"] = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
        print(_row_line(row), file=sys.stderr, flush=True)
    return rows


def _torch_reference(model: Any, feeds: dict[str, np.ndarray], want: dict[str, np.ndarray],
                     args: argparse.Namespace) -> dict[str, Any]:
    """Without ORT's CUDA provider: PyTorch on the same model (benchmarks/torch_reference.py)."""
    from torch_reference import torch_cuda_reference

    ref, why = torch_cuda_reference(model, feeds, want, args.warmup, args.repeat)
    if ref is None:
        return {"why_no_torch_cuda": why}
    return {"torch_cuda_median_s": ref["median_s"], "torch_cuda": ref}


def _row_line(row: dict[str, Any]) -> str:
    status = ("skipped" if row.get("skipped") else "ERROR " + row["error"] if row.get("error")
              else "ok" if row.get("check", {}).get("ok") else "MISMATCH")
    t = f" {row['median_s'] * 1e3:.3f} ms" if row.get("median_s") else ""
    return f"gpu-check {row['model']} x{row['ranks']}: {status}{t}"


def versions() -> dict[str, str]:
    import onnx
    import onnxruntime as ort
    import tvm

    from backends.tvm.cuda_toolchain import nvrtc_version
    from partitioner.runtime.comm_nccl import nccl_version

    return {"python": platform.python_version(), "tvm": str(tvm.__version__), "onnx": onnx.__version__,
            "onnxruntime": ort.__version__, "onnxruntime_providers": ",".join(ort.get_available_providers()),
            "nvrtc": str(nvrtc_version()), "nccl": str(nccl_version())}


def build_only(args: argparse.Namespace) -> int:
    """Build every ``<model>_<n>gpu`` artifact into ``--build-only DIR`` (no GPU needed)."""
    import models_zoo
    from backends.tvm.target import gpu_cluster_spec, target_dict
    from partitioner.compiler import compile as compile_artifact
    from partitioner.core.errors import PartitionerError

    try:
        tdict = target_dict(args.target)
    except PartitionerError as e:
        raise CheckRefused(f"gpu-check: {e}") from None
    out = Path(args.build_only)
    for key in args.models:
        model = models_zoo.build(MODELS[key][0], **model_sizes(key, args))
        for ranks in args.ranks:
            art = compile_artifact(model, gpu_cluster_spec(tdict, ranks) or f"cpu:{ranks}",
                                   strategy="single" if ranks == 1 else MODELS[key][2], target=tdict,
                                   out_dir=out / f"{key}_{ranks}gpu", progress=False)
            print(f"gpu-check: built {art.root} ({art.world_size} rank(s), {tdict.get('arch')})", file=sys.stderr)
    return 0


def run_check(args: argparse.Namespace) -> int:
    import tempfile

    if args.build_only:  # cross-compile on a machine without a GPU, for --artifacts on the device
        return build_only(args)
    if args.cpu_dry_run:  # the same steps on the host CPU: checks this script where no GPU is
        from backends.tvm.target import target_dict

        tdict, gpus = target_dict("host"), []
    else:
        tdict, gpus = probe(args.target)
    started = time.monotonic()
    deadline = started + args.budget_s
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        for key in args.models:
            zoo_kwargs = model_sizes(key, args)
            rows.extend(check_model(key, zoo_kwargs, MODELS[key][2], tdict, args, deadline, Path(tmp)))
    doc = {"machine": {"host": platform.node(), "cpu": platform.processor() or platform.machine(), "gpus": gpus},
           "versions": versions(), "target": tdict,
           "settings": {"quick": args.quick, "small": args.small, "warmup": args.warmup,
                        "repeat": args.repeat, "rtol": RTOL, "atol": ATOL,
                        "budget_s": args.budget_s},
           "wall_s": round(time.monotonic() - started, 1), "rows": rows}
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2) + "\n")
    failed = [r for r in rows if r.get("error") or r.get("skipped") or not r.get("check", {}).get("ok")]
    print(f"gpu-check: {len(rows) - len(failed)}/{len(rows)} checks passed in {doc['wall_s']} s; wrote {out}",
          file=sys.stderr)
    return 1 if failed else 0


def _ms(seconds: float | None) -> str:
    return "-" if not seconds else f"{seconds * 1e3:.3f}"


def _sizes_note(doc: dict[str, Any]) -> str:
    """What the rows' sizes were, and why speed against ORT's CUDA provider is missing (if it is)."""
    settings, rows = doc["settings"], doc["rows"]
    sizes = "; ".join(sorted({f"{r['model']} " + ", ".join(f"{k} {v}" for k, v in r["params"].items())
                              for r in rows}))
    preset = "--small" if settings.get("small") else "--quick" if settings.get("quick") else "full"
    note = f" Sizes ({preset}): {sizes}."
    missing = {r["why_no_ort_cuda"] for r in rows if r.get("why_no_ort_cuda")}
    return note + (f" No speed against ORT CUDA: {missing.pop()}." if missing else "")


def markdown(path: Path) -> str:
    """The README table from gpu.json; a one-line note when no device run has been recorded."""
    if not path.exists():
        return ("_No GPU results recorded yet: `make gpu-check` on a machine with a GPU writes "
                "`benchmarks/results/gpu.json`._\n")
    doc = json.loads(path.read_text())
    gpus = ", ".join(sorted({g["name"] for g in doc["machine"]["gpus"]})) or "?"
    lines = [f"GPU: {gpus} ({len(doc['machine']['gpus'])} visible), target {doc['target'].get('model') or ''} "
             f"{doc['target'].get('arch', doc['target']['kind'])}, TVM {doc['versions']['tvm']}, onnxruntime {doc['versions']['onnxruntime']}; "
             f"median of {doc['settings']['repeat']} steps; check rtol {doc['settings']['rtol']:g}, "
             f"atol {doc['settings']['atol']:g}." + _sizes_note(doc), "",
             "| model | GPUs | strategy | check vs ORT | reference | max abs err | step (ms) | ORT CUDA (ms) "
             "| speed vs ORT CUDA | PyTorch CUDA (ms) | speed vs PyTorch | comm |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in doc["rows"]:
        check = r.get("check") or {}
        err = max((o.get("max_abs", 0.0) for o in check.get("outputs", [])), default=None)
        status = "skipped" if r.get("skipped") else "error" if r.get("error") else "pass" if check.get("ok") else "FAIL"
        comm = (", ".join(c["path"] for c in r.get("gpu_comm") or []) or "-") if r["ranks"] > 1 else "-"
        speed = r.get("speed_vs_ort_cuda")
        cells = [r["model"], str(r["ranks"]), r.get("strategy", "-"), status,
                 r["reference_provider"].replace("ExecutionProvider", ""),
                 "-" if err is None else f"{err:.2g}", _ms(r.get("median_s")), _ms(r.get("ort_cuda_median_s")),
                 "-" if speed is None else f"{speed:.2f}x", _ms(r.get("torch_cuda_median_s")),
                 _ratio(r.get("torch_cuda_median_s"), r.get("median_s")), comm]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines + _torch_note(doc["rows"])) + "\n"


def _ratio(reference_s: float | None, ours_s: float | None) -> str:
    return f"{reference_s / ours_s:.2f}x" if reference_s and ours_s else "-"


def _torch_note(rows: list[dict[str, Any]]) -> list[str]:
    """Where the PyTorch column came from (benchmarks/torch_reference.py), or why it is empty."""
    refs = [r["torch_cuda"] for r in rows if r.get("torch_cuda")]
    if refs:
        v = refs[0]["versions"]
        err = max(x["max_abs_vs_reference"] for x in refs)
        return ["", f"_PyTorch {v['torch']} eager on the same ONNX model (onnx2torch {v['onnx2torch']}), "
                    "float32 without TF32, cuDNN benchmark on, host copies included; its outputs within "
                    f"{err:.2g} of ONNX Runtime's. Speed columns: reference time / our time (above 1: ours is "
                    "faster)._"]
    why = sorted({r["why_no_torch_cuda"] for r in rows if r.get("why_no_torch_cuda")})
    return ["", f"_{why[0]}._"] if why else []


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="h200", help="GPU target preset or cuda JSON (default h200)")
    ap.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, from {', '.join(MODELS)}")
    ap.add_argument("--ranks", default="1,2", help="GPU counts to build and run (default 1,2)")
    ap.add_argument("--artifacts", default=None, metavar="DIR", help="use DIR/<model>_<n>gpu instead of building")
    ap.add_argument("--quick", action="store_true", help="small sizes (checks the machinery, not the speed)")
    ap.add_argument("--small", action="store_true",
                    help="the full shapes with a quarter of the channels (artifacts fit a 64 MiB transfer)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--budget-s", type=float, default=480.0, help="start no new build or run after this (default 480)")
    ap.add_argument("--run-timeout", type=float, default=120.0, help="seconds one artifact run may take")
    ap.add_argument("--json", default=str(RESULTS), help=f"results file (default {RESULTS.relative_to(ROOT)})")
    ap.add_argument("--markdown", action="store_true", help="print the README table from --json and exit")
    ap.add_argument("--build-only", default=None, metavar="DIR",
                    help="only cross-compile the artifacts into DIR (no GPU needed); run them later with --artifacts DIR")
    ap.add_argument("--cpu-dry-run", action="store_true",
                    help="run every step for the host CPU instead (tests the script without a GPU; "
                         "write the JSON elsewhere with --json)")
    args = ap.parse_args(argv)
    if args.markdown:
        sys.stdout.write(markdown(Path(args.json)))
        return 0
    args.models = [m for m in args.models.split(",") if m]
    unknown = [m for m in args.models if m not in MODELS]
    try:
        if unknown:
            raise CheckRefused(f"gpu-check: unknown model(s) {', '.join(unknown)}; use {', '.join(MODELS)}")
        args.ranks = [int(r) for r in args.ranks.split(",") if r]
        return run_check(args)
    except CheckRefused as e:
        print(str(e), file=sys.stderr)
        return 2
    except ValueError:
        print(f"gpu-check: --ranks {args.ranks!r}: expected comma-separated integers", file=sys.stderr)
        return 2


if __name__ == "__main__":
    os.environ.setdefault("PYTHONPATH", str(ROOT))
    sys.exit(main())
