"""Which kernels of a model pay on 2 threads: per kernel call site, 1 against 2 threads.

    python benchmarks/thread_scaling.py [--models bert,gpt] [--batches 1,8] [--runs 20]
                                        [--percentile 10] [--top 12] [--json FILE]

For each model (the ``benchmarks/per_device.py`` sizes) and batch, our ``scheduled`` build is run
``--runs`` times on 1 thread and on 2, alternating run by run (TVM's pool reconfigured in
between), and every kernel call is timed in wall time by a VM instrument hook. A call site's time
is the ``--percentile``-th percentile of its calls over the runs (default 10): on a shared
machine most 2-thread calls wait for the second core, and the fast tenth are the calls in which
both threads ran (docs/gemm.md, "2 threads (session 8)"), so the figures estimate a quiet
machine's, optimistically, for 1 and 2 threads alike. Printed per model: the sum over call sites
on 1 and 2 threads and its scaling (1-thread time / (2 x 2-thread time)), then the call sites
that lose most (2-thread time - half the 1-thread time), with their kernel class
(``benchmarks/kernel_profile.py``'s classes) and per-site scaling. A kernel at ~50% ran on one
thread (below ``threads.parallel_min_flops``, a memory-bound or serial kernel, a VM builtin), or
its second thread did not get a core during any of the fast calls. Kernels built without a
parallel loop are marked ``serial``, and the report gives their share of the 1-thread time: a
kernel that stays on one thread keeps its 1-thread time on 2, so a model whose serial share is
``s`` gains at most ``1 / (s + (1 - s) / 2)`` from a second core (heldout_mbv2 at batch 1: most of
its time in 1x1 and depthwise convs under ``threads.parallel_min_flops``). Each contraction's
weight-side operand (``B``: :func:`operand_bytes`, a conv's or GEMM's weights) is given in MiB
with the rate at which the kernel streams it (``GB/s``, 1 and 2 threads), and the header gives
the whole model's, beside the one-core triad bandwidth measured first
(``backends.tvm.peak.measure_bandwidth``): at batch 1 the late, wide layers of a ResNet touch each weight once per run
(a 3x3 512 -> 512 conv on a 2x2 map: 9 MiB for 19 MFLOP), so a kernel whose 2-thread rate is
near what the machine streams from memory cannot gain from a schedule
(docs/per_device_speed.md, "resnet50 at batch 1 on 2 threads (session 13)"). Results:
``benchmarks/results/thread_scaling.json`` (not committed from a loaded machine).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "thread_scaling.json"


def _load(name: str) -> Any:
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def summarise(per: dict[int, list[list[tuple[str, float]]]], infos: dict[str, dict[str, Any]],
              percentile: float, serial: frozenset[str] = frozenset()) -> dict[str, Any]:
    """Sum and per-symbol figures (seconds) from ``kernel_profile.time_calls``' samples; ``serial``:
    the symbols of the kernels built without a parallel loop (their 1-thread sum: ``serial_t1_s``)."""
    sites = [call[0] for call in per[1][0]]
    by_symbol: dict[str, dict[str, Any]] = {}
    total = {1: 0.0, 2: 0.0}
    for j, symbol in enumerate(sites):
        info = infos.get(symbol, {})
        entry = by_symbol.setdefault(symbol, {"class": info.get("class", "builtin"), "b_bytes": info.get("b_bytes", 0),
                                              "serial": symbol in serial, "calls": 0, "t1_s": 0.0, "t2_s": 0.0})
        entry["calls"] += 1
        for threads in (1, 2):
            value = float(np.percentile([run[j][1] for run in per[threads]], percentile))
            entry[f"t{threads}_s"] += value
            total[threads] += value
    for entry in by_symbol.values():
        entry["scaling"] = entry["t1_s"] / (2 * entry["t2_s"]) if entry["t2_s"] else None
        entry["loss_s"] = entry["t2_s"] - entry["t1_s"] / 2
        for threads in (1, 2):  # bytes of B streamed per second over all calls of the site
            t = entry[f"t{threads}_s"]
            entry[f"b_rate{threads}"] = entry["b_bytes"] * entry["calls"] / t if t else None
    b_total = sum(e["b_bytes"] * e["calls"] for e in by_symbol.values())
    return {"t1_s": total[1], "t2_s": total[2], "scaling": total[1] / (2 * total[2]) if total[2] else None,
            "b_bytes": b_total, "b_rate1": b_total / total[1] if total[1] else None,
            "b_rate2": b_total / total[2] if total[2] else None,
            "serial_t1_s": sum(e["t1_s"] for e in by_symbol.values() if e["serial"]),
            "kernels": dict(sorted(by_symbol.items(), key=lambda kv: -kv[1]["loss_s"]))}


def operand_bytes(func: Any) -> int:
    """Bytes of the weight-side operand of a PrimFunc's reduction block (float32), 0 without one.

    Read from the block's iterators as ``kernel_profile.tir_kernel_info`` reads the FLOPs: the
    product of the reduction extents and of the output's last (vector) axis, x 4 bytes. That is
    the weight tensor of a convolution (``co x kh x kw x ci``; depthwise ``c x kh x kw``, its
    reduction over channels being 1) and ``B`` of a GEMM (``k x n``); a batched MatMul's ``B``
    per batch; a pooling window x channels (not read from memory: the report lists only what it
    gets). Shapes it is for: the ``benchmarks/per_device.py`` models' convs and GEMMs, whose
    weights are constants read once per call at batch 1."""
    from tvm import s_tir, tirx

    try:
        sch = s_tir.Schedule(func)
        stmts = [sch.get(b) for b in sch.get_child_blocks(sch.get_sblock("root"))]
    except Exception:  # no root block (a packed/extern function)
        return 0
    for stmt in stmts:
        ivs = list(stmt.iter_vars)
        red = [iv for iv in ivs if iv.iter_type == tirx.IterVar.CommReduce]
        spatial = [iv for iv in ivs if iv.iter_type == tirx.IterVar.DataPar]
        if red and spatial and all(isinstance(iv.dom.extent, tirx.IntImm) for iv in ivs):
            n = 4 * int(spatial[-1].dom.extent)
            for iv in red:
                n *= int(iv.dom.extent)
            return n
    return 0


def serial_symbols(mod: Any) -> frozenset[str]:
    """The PrimFuncs of a scheduled IRModule that have no parallel loop."""
    from tvm import tirx

    return frozenset(gv.name_hint for gv, f in mod.functions_items()
                     if isinstance(f, tirx.PrimFunc) and "T.parallel" not in f.script())


def print_report(key: str, batch: int, res: dict[str, Any], top: int, percentile: float) -> None:
    print(f"== {key} b{batch}: sum of per-call p{percentile:g}: 1 thread {res['t1_s'] * 1e3:.3f} ms, "
          f"2 threads {res['t2_s'] * 1e3:.3f} ms, scaling {100 * (res['scaling'] or 0):.0f}%; serial kernels "
          f"{res['serial_t1_s'] * 1e3:.3f} ms of the 1-thread sum ({100 * res['serial_t1_s'] / (res['t1_s'] or 1):.0f}%); "
          f"weights (B) {res.get('b_bytes', 0) / 2**20:.1f} MiB a run, {_gbs(res.get('b_rate1'))} / "
          f"{_gbs(res.get('b_rate2'))} GB/s on 1 / 2 threads")
    for symbol, e in list(res["kernels"].items())[:top]:
        cls = e["class"] + ("*" if e["serial"] else "")
        print(f"  {symbol[:48]:48s} {cls:10s} x{e['calls']:<3d} 1t {e['t1_s'] * 1e3:8.3f} "
              f"2t {e['t2_s'] * 1e3:8.3f} scaling {100 * (e['scaling'] or 0):4.0f}%  loss {e['loss_s'] * 1e3:.3f} ms"
              f"  B {e.get('b_bytes', 0) / 2**20:5.2f} MiB {_gbs(e.get('b_rate1'))} / {_gbs(e.get('b_rate2'))} GB/s")


def _gbs(rate: float | None) -> str:
    return f"{rate / 1e9:5.1f}" if rate else "    -"


def build(m: Any, target: Any, kp: Any) -> tuple[Any, dict[str, dict[str, Any]], frozenset[str]]:
    """``kernel_profile.build_ours`` plus the serial kernels' symbols (one pipeline run)."""
    import tvm

    from backends.tvm import parallel_scope
    from backends.tvm.lower import lower_program
    from backends.tvm.pipeline import run_pipeline

    mod = run_pipeline(lower_program(m).mod, "scheduled", target)
    funcs = [(gv.name_hint, f) for gv, f in mod.functions_items() if isinstance(f, tvm.tirx.PrimFunc)]
    infos = {n: {**kp.tir_kernel_info(f, n), "b_bytes": operand_bytes(f)} for n, f in funcs}
    return parallel_scope.compile(mod, target), infos, serial_symbols(mod)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="bert,gpt")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--runs", type=int, default=20, help="runs per thread count (default 20)")
    ap.add_argument("--percentile", type=float, default=10.0, help="per-call percentile (default 10)")
    ap.add_argument("--top", type=int, default=12, help="call sites listed per model (default 12)")
    ap.add_argument("--json", default=str(RESULTS))
    args = ap.parse_args(argv)
    pd = _load("per_device")
    models = [k for k in args.models.split(",") if k]
    bad = [k for k in models if k not in pd.MODELS and k not in pd.HELDOUT_KEYS and not k.endswith(".onnx")]
    if bad or not 0 < args.percentile <= 100 or args.runs < 1:
        print(f"thread_scaling: bad arguments (unknown models: {', '.join(bad) or '-'}; --percentile in "
              f"(0, 100], --runs >= 1); models: {', '.join([*pd.MODELS, *pd.HELDOUT_KEYS])} or an .onnx file",
              file=sys.stderr)
        return 2

    from backends.tvm.executable import configure_threads
    from backends.tvm.target import resolve_target

    from backends.tvm.peak import measure_bandwidth

    configure_threads(1)
    target, kp = resolve_target(None), _load("kernel_profile")
    bandwidth = measure_bandwidth(target, repeats=3)
    print(f"one-core triad bandwidth {bandwidth / 1e9:.1f} GB/s (backends/tvm/peak.py)")
    results = []
    for key in models:
        for batch in (int(b) for b in args.batches.split(",")):
            m, _ = pd.model_for(key, batch, {})
            if m is None:
                continue
            print(f"build {key} b{batch}", file=sys.stderr, flush=True)
            ex, infos, serial = build(m, target, kp)
            res = summarise(kp.time_calls(ex, pd._feeds(m), args.runs), infos, args.percentile, serial)
            print_report(key, batch, res, args.top, args.percentile)
            results.append({"model": key, "batch": batch, **res})
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"settings": vars(args), "bandwidth_one_core": bandwidth, "rows": results}, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
