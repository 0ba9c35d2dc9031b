"""fp32 GEMM speed against the measured peak: our build, TVM's previous default, ONNX Runtime, numpy.

    python benchmarks/gemm.py [--quick] [--threads 1,2] [--repeats 15] [--shapes '512^3,gpt head']
    python benchmarks/gemm.py --markdown [--json FILE]      # render the saved table

Rows: square GEMMs 256^3..2048^3 and the weight GEMMs of the zoo's bert/gpt at batch 8 (the
per_device sizes: seq 64, hidden 128; M = 512) plus their batched attention products, on 1 and
2 threads. Columns:

- ``ours``: the ``scheduled`` pipeline (GemmPacked rule: packed constant weights, register tile);
- ``previous``: the same pipeline with GemmPacked disabled (TVM's previous default build here);
- ``ort``: ONNX Runtime, a one-node MatMul model with the same constant weight;
- ``numpy``: ``a @ b`` (its BLAS; threads set by threadpoolctl).

Each implementation is called in interleaved rounds (round r times every implementation once
at every thread count, each call repeated to ~10 ms), and its time is the median over rounds, so
machine load hits all of them, and the 1- and 2-thread figures of one row, alike. "% of peak" = 2MNK / time / (threads x the FMA peak of one core), the peak being
measured by :mod:`backends.tvm.peak` in the same process, before and after the rows (the larger
median is used; the peak is timed by the thread's CPU clock). On 1 thread the calling thread's
CPU time is recorded too (``thread_cpu_s``, ``pct_of_peak_cpu``): every implementation runs on
that thread, so on a shared machine it is the better estimate of the quiet-machine figure.
"2-thread scaling" (2-thread rows): the 1-thread time / (2 x the 2-thread time) of the same
implementation and shape, i.e. the per-core efficiency on 2 threads against 1 (target: >= 80%
for ours). Our kernel splits the fused (N panel, M tile) loop - or (M tile, N panel) when B fits
L2 - into one contiguous chunk per thread: on panels-outer GEMMs each core reads half of B,
on rows-outer ones half of A and all of B (from its own L2).
Thread pools: the four implementations live in one process and each has its own pool, whose
idle workers busy-wait after a call (TVM: bounded by ``configure_threads``, ORT ~20 ms, OpenBLAS
~25 ms of CPU). A pool still spinning when the next implementation's timed block starts takes the
second core from it: on 2 threads that made every library's small GEMMs ms-slow (256^3: ours 3.6
ms on 2 threads against 0.3 ms on 1). So OpenBLAS runs with ``OPENBLAS_THREAD_TIMEOUT=4`` (its
workers sleep at once; set before numpy loads) and every timed block starts after
``SETTLE_S`` of sleep, in which the previous block's pool goes idle.
On a shared machine the 2-thread medians measure the other processes more than the kernels: a
2-thread call needs both cores at once, and at a load above 2 the second thread waits for a
scheduler slice in most calls (measured at load 2.3-4: ours on 512x128x128, median 4.9 ms on 2
threads against 0.5 ms on 1; ORT 1.0 against 0.47). So every call is also timed singly, and the
``CALL_PERCENTILE``-th percentile of those wall times (``call_p_s``) estimates the uncontended
time: the calls in which both threads ran. ``scaling_call_p`` is the scaling from it, shown by
``--markdown`` for ``--loaded`` results. It is an estimate (the fastest tenth of the calls; on a
quiet machine it sits a few percent under the median), taken alike for every implementation.
Every TVM output is checked against numpy (rtol 1e-4, atol 1e-5 scaled by sqrt(K)).
Results: ``benchmarks/results/gemm.json``; ``loaded`` there records whether the machine was
known to be shared (then the figures are ratios only).
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
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")  # before numpy loads OpenBLAS (docstring)

import numpy as np  # noqa: E402

from benchmarks.module_settings import with_settings  # noqa: E402
from partitioner.core.machine import cpu_model  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "gemm.json"
SETTLE_S = 0.03  # idle time before each timed block: the previous pool stops spinning (docstring)
CALL_PERCENTILE = 10  # the single-call percentile behind the load-robust 2-thread scaling (docstring)
SQUARE = [256, 512, 1024, 2048]
# (label, batch dims, M, K, N, B constant): bert/gpt at batch 8, seq 64, hidden 128, 4 heads
ZOO = [
    ("bert/gpt qkv/out 512x128x128", (), 512, 128, 128, True),
    ("bert/gpt ffn-up 512x128x512", (), 512, 128, 512, True),
    ("bert/gpt ffn-down 512x512x128", (), 512, 512, 128, True),
    ("gpt head 512x128x1000", (), 512, 128, 1000, True),
    ("attn QK^T 32x(64x32x64)", (32,), 64, 32, 64, False),
    ("attn PV 32x(64x64x32)", (32,), 64, 64, 32, False),
]


def _model(batch: tuple[int, ...], m: int, k: int, n: int, w: np.ndarray | None) -> Any:
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    F = TensorProto.FLOAT
    inputs = [helper.make_tensor_value_info("a", F, [*batch, m, k])]
    inits = []
    if w is None:
        inputs.append(helper.make_tensor_value_info("b", F, [*batch, k, n]))
    else:
        inits.append(numpy_helper.from_array(w, "b"))
    g = helper.make_graph([helper.make_node("MatMul", ["a", "b"], ["y"])], "gemm", inputs,
                          [helper.make_tensor_value_info("y", F, [*batch, m, n])], inits)
    return onnx.shape_inference.infer_shapes(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]))


def _tvm(model: Any, target: Any, packed: bool) -> Callable[..., Any]:
    import tvm
    from tvm import relax

    from backends.tvm import parallel_scope
    from backends.tvm.lower import lower_program
    from backends.tvm.pipeline import run_pipeline
    from backends.tvm.schedules import gemm_packed

    original = gemm_packed.GemmPacked.apply
    if not packed:
        gemm_packed.GemmPacked.apply = lambda self, func, target, tunable: None  # type: ignore[method-assign]
    try:
        mod = run_pipeline(lower_program(model).mod, "scheduled", target)
    finally:
        gemm_packed.GemmPacked.apply = original  # type: ignore[method-assign]
    vm = relax.VirtualMachine(parallel_scope.compile(mod, target), tvm.cpu())  # as backends/tvm/build.py
    fn = vm["main"]
    return lambda *args: fn(*args)


def _calls_for(fn: Callable[[], Any], budget: float = 0.01) -> int:
    fn()
    t0 = time.perf_counter()
    fn()
    dt = max(time.perf_counter() - t0, 1e-7)
    return max(1, int(budget / dt))


def _interleaved(fns: dict[int, dict[str, Callable[[], Any]]], repeats: int) -> dict[int, tuple[dict[str, float], ...]]:
    """Per thread count: (median wall, best wall, median thread-CPU, low-percentile call) seconds
    per call of each function over ``repeats`` rounds. Each round times every implementation at
    every thread count (the pools reconfigured in between), so a slow spell of a shared machine
    hits the 1- and 2-thread figures alike and the scaling is a paired ratio. The thread-CPU
    time is the calling thread's: on one thread every implementation here runs on it, so it is
    the time the call would take on a quiet machine (a shared machine's time slicing does not
    count). The last is the :data:`CALL_PERCENTILE` percentile of the single calls' wall times
    (module docstring: the load-robust estimate for 2 threads)."""
    from threadpoolctl import threadpool_limits

    from backends.tvm.executable import configure_threads

    reps: dict[int, dict[str, int]] = {}
    samples: dict[int, dict[str, tuple[list[float], list[float], list[float]]]] = {}
    for threads, group in fns.items():
        configure_threads(threads)
        with threadpool_limits(threads):
            reps[threads] = {name: _calls_for(f) for name, f in group.items()}
        samples[threads] = {name: ([], [], []) for name in group}
    for _ in range(repeats):
        for threads, group in fns.items():
            configure_threads(threads)
            with threadpool_limits(threads):
                for name, f in group.items():
                    _time_block(f, reps[threads][name], samples[threads][name])
    return {t: ({n: statistics.median(w) for n, (w, _, _) in by.items()},
                {n: min(w) for n, (w, _, _) in by.items()},
                {n: statistics.median(c) for n, (_, c, _) in by.items()},
                {n: float(np.percentile(calls, CALL_PERCENTILE)) for n, (_, _, calls) in by.items()})
            for t, by in samples.items()}


def _time_block(f: Callable[[], Any], reps: int, out: tuple[list[float], list[float], list[float]]) -> None:
    """Call ``f`` ``reps`` times after :data:`SETTLE_S` of sleep; append the block's wall and
    thread-CPU time per call and every single call's wall time to ``out``."""
    wall, cpu, calls = out
    time.sleep(SETTLE_S)
    c0, t0 = time.thread_time(), time.perf_counter()
    last = t0
    for _ in range(reps):
        f()
        now = time.perf_counter()
        calls.append(now - last)
        last = now
    wall.append((last - t0) / reps)
    cpu.append((time.thread_time() - c0) / reps)


def parse_variants(items: list[str]) -> dict[str, list[Any]]:
    """``--variant NAME:MODULE.ATTR=VALUE`` items as {NAME: settings}; one NAME given several
    times collects all of its settings."""
    from benchmarks.module_settings import parse_settings

    by_name: dict[str, list[str]] = {}
    for item in items:
        name, sep, setting = item.partition(":")
        if not sep or not name or "=" not in setting:
            raise SystemExit(f"gemm: --variant {item!r}: expected NAME:MODULE.ATTR=VALUE")
        by_name.setdefault(name, []).append(setting)
    return {name: parse_settings(settings)[1] for name, settings in by_name.items()}


def run(threads_list: list[int], repeats: int, quick: bool, only: list[str] | None = None,
        variants: dict[str, list[Any]] | None = None) -> dict[str, Any]:
    import onnxruntime as ort
    import tvm

    from backends.tvm.executable import configure_threads
    from backends.tvm.peak import measure_peak
    from backends.tvm.target import resolve_target

    target = resolve_target(None)
    configure_threads(1)
    peak_before = measure_peak(target, quick=quick)
    rng = np.random.default_rng(0)
    shapes = [(f"{s}^3", (), s, s, s, True) for s in (SQUARE[:3] if quick else SQUARE)] + ZOO
    if only:
        shapes = [s for s in shapes if any(o in s[0] for o in only)]
    rows = []
    for label, batch, m, k, n, const in shapes:
        a = rng.standard_normal((*batch, m, k), dtype=np.float32)
        b = rng.standard_normal((*batch, k, n), dtype=np.float32)
        model = _model(batch, m, k, n, b if const else None)
        builds = {"ours": _tvm(model, target, True), "previous": _tvm(model, target, False)}
        for name, settings in (variants or {}).items():  # ours built with module settings changed
            builds[f"ours_{name}"] = with_settings(lambda: _tvm(model, target, True), settings)()
        ta, tb = tvm.runtime.tensor(a), tvm.runtime.tensor(b)
        targs = (ta,) if const else (ta, tb)
        ref = a @ b
        err = {}
        for name, fn in builds.items():
            res = fn(*targs)
            got = (res if isinstance(res, tvm.runtime.Tensor) else res[0]).numpy()
            tol = 1e-5 * np.sqrt(k)
            np.testing.assert_allclose(got, ref, rtol=1e-4, atol=tol, err_msg=f"{label} {name}")
            err[name] = float(np.max(np.abs(got - ref)))
        feeds = {"a": a} if const else {"a": a, "b": b}
        fns: dict[int, dict[str, Callable[[], Any]]] = {}
        for threads in threads_list:
            so = ort.SessionOptions()
            so.intra_op_num_threads = threads
            so.inter_op_num_threads = 1
            sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
            fns[threads] = {name: (lambda fn=fn: fn(*targs)) for name, fn in builds.items()}
            fns[threads]["ort"] = lambda sess=sess: sess.run(None, feeds)
            fns[threads]["numpy"] = lambda: a @ b
        timed = _interleaved(fns, repeats)
        flops = 2.0 * int(np.prod(batch or (1,))) * m * n * k
        for threads, (times, best, cpu, low) in timed.items():
            rows.append({"shape": label, "batch": list(batch), "m": m, "k": k, "n": n, "constant_b": const,
                         "threads": threads, "flops": flops, "times_s": times, "best_s": best, "call_p_s": low,
                         "max_abs_err": err,
                         **({"thread_cpu_s": cpu} if threads == 1 else {})})
            print(f"{label:32s} t={threads} " + "  ".join(f"{k_}={v * 1e3:8.3f}ms" for k_, v in times.items()),
                  flush=True)
    configure_threads(1)
    peak_after = measure_peak(target, quick=quick)
    peak = max(peak_before.fma_flops, peak_after.fma_flops)
    one = {r["shape"]: r for r in rows if r["threads"] == 1}
    for r in rows:
        if r["threads"] > 1 and r["shape"] in one:
            for key, col in (("scaling", "times_s"), ("scaling_call_p", "call_p_s")):
                r[key] = {k_: 100.0 * one[r["shape"]][col][k_] / (r["threads"] * t) for k_, t in r[col].items()}
        r["pct_of_peak"] = {k_: 100.0 * r["flops"] / t / (r["threads"] * peak) for k_, t in r["times_s"].items()}
        if "thread_cpu_s" in r:
            r["pct_of_peak_cpu"] = {k_: 100.0 * r["flops"] / t / peak for k_, t in r["thread_cpu_s"].items()}
    return {"machine": {"cpu": cpu_model(), "cores": os.cpu_count(), "platform": platform.platform(),
                        "target": str(target)},
            "versions": {"tvm": tvm.__version__, "onnxruntime": ort.__version__, "numpy": np.__version__},
            "peak": {"fma_flops_per_core": peak, "before": peak_before.to_json(), "after": peak_after.to_json()},
            "settings": {"threads": threads_list, "repeats": repeats, "quick": quick,
                         "call_percentile": CALL_PERCENTILE,
                         "variants": {name: [f"{mod.__name__}.{attr}={value!r}" for mod, attr, value in s]
                                      for name, s in (variants or {}).items()}},
            "rows": rows}



def markdown(data: dict[str, Any]) -> str:
    peak = data["peak"]["fma_flops_per_core"]
    loaded = bool(data.get("loaded"))
    out = [f"fp32 GEMM: time in ms (median of interleaved rounds) and % of the measured FMA peak "
           f"({peak / 1e9:.0f} GFLOP/s per core, {data['machine']['cpu']})"
           + (". Measured on a loaded machine: on 1 thread the % is from the thread's CPU time, "
              "on 2 threads from wall time (ratios only)" if loaded else ""),
           "",
           "| GEMM | threads | ours | TVM previous | ONNX Runtime | numpy |",
           "|---|---:|---:|---:|---:|---:|"]
    scaling = any("scaling" in r for r in data["rows"])  # results before the column existed have none
    # on a shared machine the scaling is taken from the low percentile of single calls (docstring)
    scale_key = "scaling_call_p" if loaded and any("scaling_call_p" in r for r in data["rows"]) else "scaling"
    if scaling:
        how = f" (p{data['settings'].get('call_percentile', 10)} of calls)" if scale_key != "scaling" else ""
        out[-2] += f" ours, 2-thread scaling{how} | ORT, 2-thread scaling{how} |"
        out[-1] += "---:|---:|"
    extra = list(data.get("settings", {}).get("variants") or {})  # --variant builds: a column each
    for name in extra:
        out[-2] += f" ours, {name} |"
        out[-1] += "---:|"
    for r in data["rows"]:
        pct = r["pct_of_peak_cpu"] if loaded and "pct_of_peak_cpu" in r else r["pct_of_peak"]
        cells = [f"{r['times_s'][k] * 1e3:.3f} ({pct[k]:.0f}%)" for k in ("ours", "previous", "ort", "numpy")]
        if scaling:
            cells += [f"{r[scale_key][k]:.0f}%" if scale_key in r else "-" for k in ("ours", "ort")]
        cells += [f"{r['times_s'][f'ours_{n}'] * 1e3:.3f} ({pct[f'ours_{n}']:.0f}%)" for n in extra]
        out.append(f"| {r['shape']} | {r['threads']} | " + " | ".join(cells) + " |")
    for name, settings in (data.get("settings", {}).get("variants") or {}).items():
        out.append(f"\n{name}: ours built with {', '.join(settings)}")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="square sizes up to 1024, shorter peak probe")
    ap.add_argument("--threads", default="1,2", help="comma-separated thread counts (default 1,2)")
    ap.add_argument("--repeats", type=int, default=15, help="interleaved rounds (default 15)")
    ap.add_argument("--shapes", default="", help="comma-separated substrings of row labels to run "
                    "(e.g. '512^3,gpt head'; default: all rows)")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME:MODULE.ATTR=VALUE",
                    help="also build ours with this module setting changed while building (repeatable; "
                         "a NAME given again adds a setting), timed in the same interleaved rounds: "
                         "column ours_NAME (e.g. "
                         "kb:backends.tvm.schedules.gemm_packed.PACK_A_BLOCK_BYTES=524288)")
    ap.add_argument("--loaded", action="store_true", help="mark the figures as measured on a shared machine")
    ap.add_argument("--markdown", action="store_true", help="print the saved table as markdown")
    ap.add_argument("--json", default=str(RESULTS), help=f"results file (default {RESULTS.relative_to(ROOT)})")
    args = ap.parse_args(argv)
    path = Path(args.json)
    if args.markdown:
        if not path.exists():
            print(f"gemm: no results at {path}; run benchmarks/gemm.py first", file=sys.stderr)
            return 2
        print(markdown(json.loads(path.read_text())))
        return 0
    only = [s.strip() for s in args.shapes.split(",") if s.strip()]
    labels = [f"{s}^3" for s in SQUARE] + [z[0] for z in ZOO]
    if only and not any(o in lab for o in only for lab in labels):
        print(f"gemm: --shapes {args.shapes!r} matches no row (rows: {', '.join(labels)})", file=sys.stderr)
        return 2
    data = run([int(t) for t in args.threads.split(",")], args.repeats, args.quick, only or None,
               parse_variants(args.variant))
    data["loaded"] = bool(args.loaded)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1))
    print(markdown(data))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
