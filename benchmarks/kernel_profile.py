"""Where a model's time goes, per kernel class: our default build against ONNX Runtime, 1 thread.

    python benchmarks/kernel_profile.py [--models mobilenet,resnet50] [--batches 1,8] [--runs 15]
                                        [--layers 12] [--baseline MODULE.ATTR=VALUE] [--scaling] [--json FILE]
                                        [--conv-algorithm direct|im2col|winograd|auto]
    python benchmarks/kernel_profile.py --models heldout_unet --batches 1 --outside 1,2 --runs 200

For each model (the ``benchmarks/per_device.py`` sizes) and batch:

- ours: the ``scheduled`` pipeline (convolutions ``--conv-algorithm``, default ``direct``; ``auto``
  takes this machine's cached per-conv choices, as the per_device default column) built once, for one thread (no parallel loops:
  ``backends/tvm/schedules/threads.py``, "Builds for one thread"; ``--scaling`` and ``--outside``,
  which also run 2 threads, build the parallel kernels); every kernel call of a run is timed with the
  calling thread's CPU time (``time.thread_time``) from a VM instrument hook (before/after each
  call), so a loaded machine's time slicing matters less and each kernel runs in the cache state
  the model leaves it. A kernel's time is its median over ``--runs`` runs.
- ONNX Runtime: one session (``intra_op_num_threads`` = 1, all graph optimisations), its node
  profiler (``enable_profiling``), median per node over the same number of runs. ORT reports
  wall time per node; with 1 thread and a core free it is the CPU time.

Kernel classes (the same rule on both sides, from the convolution's shape, not from names):
``stem`` (a conv with 3 input channels), ``depthwise`` (groups = channels), ``conv1x1``,
``conv3x3`` (and ``convKxK``), ``gemm`` (MatMul/Gemm), ``pool``, ``layout`` (transposes, ORT's
NCHWc reorders) and ``other`` (elementwise kernels that were not fused, softmax, ...). Each
side's fusions differ (ORT folds BN and fuses Relu/Clip/Add into its conv; we fuse BN, clamp and
residual add into the conv's epilogue), so a class's time includes what each side fused into it.
The table gives per class: our ms, ORT's ms, the difference (what to attack first: the largest
absolute excess) and the ratio; ``--layers`` lists the conv layers with the largest excess
(class, channels in -> out, output map). ``--baseline MODULE.ATTR=VALUE`` also builds with a
schedule setting changed (the "before" of a schedule change) and times both builds in
interleaved rounds, for a before/after ratio per class that a loaded machine's drift does not
bias. Calls to VM builtins (allocation, shape checks) are class ``other`` on our side: with the
hook's own ~1-2 us per call they are mostly the measurement's overhead.
``--scaling`` answers another question, whether each kernel of our build gains from a second
thread: per kernel call, its wall time on 1 and 2 threads, the minimum over ``--runs``
alternating runs (:func:`thread_scaling`); no ORT side.
``--outside 1,2`` answers a third, where a run's wall goes besides the kernels
(:func:`outside_kernels`): per thread count, the wall of plain runs against the kernel sum of
hooked runs, and per run the page faults, the main thread's context switches, the workers'
sleeps and whether the worker shared the main thread's CPU; no ORT side.
Results: ``benchmarks/results/kernel_profile.json`` (not committed from a loaded machine).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import statistics
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")

import numpy as np  # noqa: E402
import onnx  # noqa: E402

from benchmarks.module_settings import parse_settings, with_settings  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "kernel_profile.json"


def _per_device() -> Any:
    spec = importlib.util.spec_from_file_location("per_device", ROOT / "benchmarks" / "per_device.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def conv_class(ci: int, co: int, k: int, groups: int) -> str:
    """The class of a convolution from its shape (module docstring)."""
    if groups > 1 and groups == ci:
        return "depthwise"
    if ci == 3:
        return "stem"
    return f"conv{k}x{k}"


# ---------------------------------------------------------------- ours: classes from the TIR
def tir_kernel_info(func: Any, name: str) -> dict[str, Any]:
    """Class, layer key and FLOPs of one PrimFunc, read from its reduction block's iterators:
    conv2d_nhwc is (n, h, w, co, ry, rx, ci), group_conv2d_nhwc (n, h, w, c, ry, rx, 1)."""
    from tvm import s_tir, tirx

    try:
        sch = s_tir.Schedule(func)
        stmts = [sch.get(b) for b in sch.get_child_blocks(sch.get_sblock("root"))]
    except Exception:  # no root block (a packed/extern function)
        stmts = []
    blocks = [b for b in stmts if any(iv.iter_type == tirx.IterVar.CommReduce for iv in b.iter_vars)]
    low = name.lower()
    info: dict[str, Any] = {"class": "other", "layer": "[ours] " + re.sub(r"\d+$", "", name)[:40].rstrip("_"), "flops": 0.0}
    if "transpose" in low and not blocks:
        info["class"] = "layout"
        info["layer"] = None
    if not blocks:
        return info
    exts = [int(iv.dom.extent) for iv in blocks[0].iter_vars]
    flops = 2.0
    for e in exts:
        flops *= e
    info["flops"] = flops
    if "conv2d" in low and len(exts) == 7:
        n, h, w, co, ry, rx, rc = exts
        groups = co if rc == 1 else 1  # one input channel per group: depthwise
        ci = co if groups > 1 else rc
        info["class"] = conv_class(ci, co, ry, groups)
        info["layer"] = f"{info['class']} {ci}->{co} @{h}x{w}"
    elif "matmul" in low or "dense" in low:
        info["class"], info["layer"] = "gemm", None
    elif "pool" in low:
        info["class"], info["layer"] = "pool", None
    return info


def build_ours(m: onnx.ModelProto, target: Any, threads: int | None = None,
               conv_algorithm: str = "direct") -> tuple[Any, dict[str, dict[str, Any]]]:
    """The compiled VM executable and the info of every PrimFunc by symbol, built for ``threads``
    threads (``threads.building_for``: 1 = no parallel loops; None = the parallel build) with
    ``conv_algorithm`` (``"auto"``: this machine's cached choices, as ``backends.tvm.build``)."""
    import tvm
    from tvm import tirx

    from backends.tvm.lower import lower_program
    from backends.tvm.pipeline import run_pipeline
    from backends.tvm import parallel_scope
    from backends.tvm.schedules.threads import building_for

    from backends.tvm.conv_algorithms import machine_cache_file

    cache = machine_cache_file(target) if conv_algorithm == "auto" else None
    with building_for(threads):
        mod = run_pipeline(lower_program(m).mod, "scheduled", target, conv_algorithm=conv_algorithm, conv_cache=cache)
    infos = {gv.name_hint: tir_kernel_info(f, gv.name_hint) for gv, f in mod.functions_items()
             if isinstance(f, tirx.PrimFunc)}
    return parallel_scope.compile(mod, target), infos


def profile_ours(exes: list[Any], feeds: dict[str, np.ndarray], runs: int) -> list[list[tuple[str, float]]]:
    """Per executable: (symbol, median thread-CPU seconds) per kernel call site, in call order.
    The executables run in interleaved rounds, so a loaded machine's slow spells hit them alike."""
    import tvm
    from tvm import relax

    args = [tvm.runtime.tensor(v) for v in feeds.values()]
    state: dict[str, Any] = {"calls": []}

    def instrument(func: Any, symbol: str, before: bool, ret: Any, *a: Any) -> int:
        if before:
            state["t"] = time.thread_time()
        else:
            state["calls"].append((str(symbol), time.thread_time() - state["t"]))
        return 0

    vms = []
    for ex in exes:
        vm = relax.VirtualMachine(ex, tvm.cpu())
        vm["main"](*args)
        vm.set_instrument(instrument)
        vms.append(vm)
    per_run: list[list[list[tuple[str, float]]]] = [[] for _ in vms]
    for _ in range(runs):
        for i, vm in enumerate(vms):
            state["calls"] = []
            vm["main"](*args)
            per_run[i].append(state["calls"])
    return [[(runs_i[0][j][0], statistics.median(r[j][1] for r in runs_i)) for j in range(len(runs_i[0]))]
            for runs_i in per_run]


def time_calls(ex: Any, feeds: dict[str, np.ndarray], runs: int) -> dict[int, list[list[tuple[str, float]]]]:
    """Per thread count (1, 2): per run, (symbol, wall seconds) of every kernel call in order."""
    import tvm
    from tvm import relax

    from backends.tvm.executable import configure_threads

    args = [tvm.runtime.tensor(v) for v in feeds.values()]
    vm = relax.VirtualMachine(ex, tvm.cpu())
    state: dict[str, Any] = {"calls": []}

    def instrument(func: Any, symbol: str, before: bool, ret: Any, *a: Any) -> int:
        if before:
            state["t"] = time.perf_counter()
        else:
            state["calls"].append((str(symbol), time.perf_counter() - state["t"]))
        return 0

    vm.set_instrument(instrument)
    per: dict[int, list[list[tuple[str, float]]]] = {1: [], 2: []}
    for _ in range(runs):
        for threads in per:
            configure_threads(threads)
            state["calls"] = []
            vm["main"](*args)  # warm-up after the reconfiguration, not recorded
            state["calls"] = []
            vm["main"](*args)
            per[threads].append(state["calls"])
    return per


def thread_scaling(ex: Any, infos: dict[str, dict[str, Any]], feeds: dict[str, np.ndarray],
                   runs: int) -> list[dict[str, Any]]:
    """Per kernel call site of our build: its wall time on 1 and on 2 threads (``--scaling``).

    The two thread counts alternate run by run (``configure_threads`` between runs, one warm-up
    run after each switch), each call timed with ``time.perf_counter`` from the VM hook, and a
    call's time is its *minimum* over ``runs``: on a shared machine a 2-thread kernel is slowed
    whenever another process holds the second core (TVM splits a parallel loop statically, so
    the kernel waits for the slower half), and the minimum is the run where both cores were
    free. A ratio near 1.0 for a kernel that takes > 50 us means its parallel split does not
    pay (or the loop is serial: ``threads.worth_parallel``); the sum over kernels is the
    2-thread speed-up of the kernel time, free of the fork/join of idle gaps between runs."""
    per = time_calls(ex, feeds, runs)
    best = {threads: [min(call[1] for call in calls) for calls in zip(*runs_)] for threads, runs_ in per.items()}
    return [{"symbol": sym, "layer": infos.get(sym, {}).get("layer") or infos.get(sym, {}).get("class"),
             "t1_ms": 1e3 * t1, "t2_ms": 1e3 * t2}
            for (sym, _), t1, t2 in zip(per[1][0], best[1], best[2]) if not sym.startswith("vm.builtin")]


def paired_scaling(builds: list[tuple[Any, dict[str, dict[str, Any]]]], feeds: dict[str, np.ndarray],
                   rounds: int) -> list[list[dict[str, Any]]]:
    """:func:`thread_scaling` of several builds (``--scaling --baseline``) in ``rounds`` interleaved
    rounds of 3 runs each (the order alternating round by round), each call site's minimum over
    the rounds: a before/after of a schedule change on 2 threads from one process."""
    per: list[list[list[dict[str, Any]]]] = [[] for _ in builds]
    for r in range(rounds):
        order = range(len(builds)) if r % 2 == 0 else reversed(range(len(builds)))
        for i in order:
            per[i].append(thread_scaling(*builds[i], feeds, 3))
    return [[{**sites[0], "t1_ms": min(x["t1_ms"] for x in sites), "t2_ms": min(x["t2_ms"] for x in sites)}
             for sites in zip(*runs)] for runs in per]


def print_scaling(key: str, batch: int, rows: list[dict[str, Any]], n: int) -> None:
    t1, t2 = sum(r["t1_ms"] for r in rows), sum(r["t2_ms"] for r in rows)
    print(f"\n{key} b{batch}: kernel time 1 thread {t1:.2f} ms, 2 threads {t2:.2f} ms (speed-up {t1 / t2:.2f}x)")
    print("  kernels that gain least from the second thread (by time lost against a perfect split):")
    for r in sorted(rows, key=lambda r: -(r["t2_ms"] - r["t1_ms"] / 2))[:n]:
        print(f"    {r['symbol'][:44]:44s} {str(r['layer'])[:28]:28s} {r['t1_ms']:8.3f} {r['t2_ms']:8.3f}"
              f" x{r['t2_ms'] / max(r['t1_ms'], 1e-9):.2f}")


def _task_counters() -> dict[int, tuple[int, int, int]]:
    """Per thread of this process: (times scheduled in, voluntary switches = sleeps, last CPU),
    from ``/proc/self/task/*/{schedstat,status,stat}``; empty where /proc lacks them."""
    out = {}
    for task in Path("/proc/self/task").glob("*"):
        try:
            slices = int((task / "schedstat").read_text().split()[2])
            status = (task / "status").read_text()
            cpu = int((task / "stat").read_text().rsplit(")", 1)[1].split()[36])
        except (OSError, IndexError, ValueError):
            continue
        sleeps = int(status.split("\nvoluntary_ctxt_switches:")[1].split()[0])
        out[int(task.name)] = (slices, sleeps, cpu)
    return out


def outside_kernels(ex: Any, feeds: dict[str, np.ndarray], runs: int, threads: int) -> dict[str, Any]:
    """Where a run's wall time goes besides the kernels (``--outside``), on ``threads`` threads.

    Runs back to back, alternating a plain VM call (its wall: ``wall_ms``) and a call with the
    kernel hook (the sum of its kernel calls' walls: ``kernels_ms``; VM builtins excluded), and
    per plain run: page faults (``minflt``: storage allocated afresh), the main thread's context
    switches (``main_switches``: on 2 threads ~1 per parallel kernel when the pool's worker
    runs on the main thread's core and the two take turns), the other threads' sleeps
    (``worker_sleeps``: the worker went idle long enough to block, so the next fork wakes it) and
    the share of runs that ended with the worker on the main thread's CPU (``same_cpu``).
    Medians over ``runs``; ``wall_ms - kernels_ms`` is the time outside the kernels."""
    import resource

    import tvm
    from tvm import relax

    from backends.tvm.executable import configure_threads

    configure_threads(threads)
    args = [tvm.runtime.tensor(v) for v in feeds.values()]
    plain, hooked = relax.VirtualMachine(ex, tvm.cpu()), relax.VirtualMachine(ex, tvm.cpu())
    calls: list[float] = []
    t: dict[str, float] = {}

    def instrument(func: Any, symbol: str, before: bool, ret: Any, *a: Any) -> int:
        if before:
            t["0"] = time.perf_counter()
        elif not str(symbol).startswith("vm.builtin"):
            calls.append(time.perf_counter() - t["0"])
        return 0

    hooked.set_instrument(instrument)
    for vm in (plain, hooked, plain, hooked):
        vm["main"](*args)  # warm-up: pool started, storage allocated
    main = threading.get_native_id()
    rec: dict[str, list[float]] = defaultdict(list)
    for _ in range(runs):
        c0, f0 = _task_counters(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        t0 = time.perf_counter()
        plain["main"](*args)
        rec["wall_ms"].append(1e3 * (time.perf_counter() - t0))
        f1, c1 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, _task_counters()
        rec["minflt"].append(f1 - f0)
        if main in c0 and main in c1:
            rec["main_switches"].append(c1[main][0] - c0[main][0])
            others = [k for k in c1 if k in c0 and k != main]
            rec["worker_sleeps"].append(sum(c1[k][1] - c0[k][1] for k in others))
            rec["same_cpu"].append(float(any(c1[k][2] == c1[main][2] and c1[k][0] > c0[k][0] for k in others)))
        calls.clear()
        hooked["main"](*args)
        rec["kernels_ms"].append(1e3 * sum(calls))
    out = {"threads": threads, **{k: statistics.median(v) if k != "same_cpu" else statistics.fmean(v)
                                  for k, v in rec.items()}}
    # split the walls by whether the main thread kept its core through the run (<= 1 switch)
    for part, keep in (("alone", lambda n: n <= 1), ("switched", lambda n: n > 1)):
        walls = [w for w, n in zip(rec["wall_ms"], rec.get("main_switches", [])) if keep(n)]
        out[f"runs_{part}"] = len(walls)
        out[f"wall_ms_{part}"] = statistics.median(walls) if walls else None
    return out


def print_outside(key: str, batch: int, r: dict[str, Any]) -> None:
    print(f"{key} b{batch} {r['threads']} thread(s): wall {r['wall_ms']:.3f} ms, kernels {r['kernels_ms']:.3f} ms, "
          f"outside {r['wall_ms'] - r['kernels_ms']:.3f} ms; per run: minflt {r['minflt']:.0f}, main switches "
          f"{r.get('main_switches', -1):.0f}, worker sleeps {r.get('worker_sleeps', -1):.0f}, "
          f"worker on the main thread's CPU in {100 * r.get('same_cpu', 0):.0f}% of runs")
    for part, how in (("alone", "at most once"), ("switched", "more than once")):
        if r.get(f"runs_{part}"):
            print(f"  {r[f'runs_{part}']} runs with the main thread switched out {how}: wall {r[f'wall_ms_{part}']:.3f} ms")


# ---------------------------------------------------------------- ORT: classes from the ONNX nodes
def onnx_node_info(m: onnx.ModelProto) -> dict[str, dict[str, Any]]:
    """Class and layer key of every node of the (shape-inferred) model, by node name."""
    shapes = {vi.name: [d.dim_value for d in vi.type.tensor_type.shape.dim]
              for vi in list(m.graph.value_info) + list(m.graph.output) + list(m.graph.input)}
    inits = {t.name: list(t.dims) for t in m.graph.initializer}
    out: dict[str, dict[str, Any]] = {}
    for node in m.graph.node:
        info: dict[str, Any] = {"class": "other", "layer": f"[ORT] {node.op_type}"}
        if node.op_type == "Conv":
            w = inits.get(node.input[1]) or shapes.get(node.input[1])
            groups = next((a.i for a in node.attribute if a.name == "group"), 1)
            co, cig, k = w[0], w[1], w[2]
            ci = cig * groups
            y = shapes.get(node.output[0], [0, 0, 0, 0])
            info["class"] = conv_class(ci, co, k, groups)
            info["layer"] = f"{info['class']} {ci}->{co} @{y[2]}x{y[3]}"
        elif node.op_type in ("MatMul", "Gemm"):
            info["class"], info["layer"] = "gemm", None
        elif "Pool" in node.op_type:
            info["class"], info["layer"] = "pool", None
        elif node.op_type == "Transpose":
            info["class"], info["layer"] = "layout", None
        out[node.name] = info
    return out


def profile_ort(m: onnx.ModelProto, feeds: dict[str, np.ndarray], runs: int, tmp: Path) -> list[tuple[str, str, float]]:
    """(node name, op, median seconds) per node ORT ran."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads, so.inter_op_num_threads = 1, 1
    so.enable_profiling = True
    so.profile_file_prefix = str(tmp / "ort_prof")
    sess = ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])
    for _ in range(2):
        sess.run(None, feeds)
    events = json.loads(Path(sess.end_profiling()).read_text())
    sess2 = ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])
    sess2.run(None, feeds)
    for _ in range(runs):
        sess2.run(None, feeds)
    events = json.loads(Path(sess2.end_profiling()).read_text())
    per_node: dict[tuple[str, str], list[float]] = defaultdict(list)
    for e in events:
        if e.get("cat") == "Node" and e.get("name", "").endswith("_kernel_time"):
            per_node[(e["name"][:-len("_kernel_time")], e["args"].get("op_name", ""))].append(e["dur"] * 1e-6)
    out = []
    for (name, op), durs in per_node.items():
        # the first call of each node is the warm-up run: drop it when there are more
        out.append((name, op, statistics.median(durs[1:] if len(durs) > runs else durs)))
    return out


def ort_class(name: str, op: str, nodes: dict[str, dict[str, Any]]) -> dict[str, Any]:
    if name in nodes:
        return nodes[name]
    if op in ("ReorderInput", "ReorderOutput", "Transpose"):
        return {"class": "layout", "layer": None}
    base = next((n for n in nodes if name.startswith(n)), None)
    return nodes[base] if base else {"class": "other", "layer": f"[ORT] {op}"}


def compare(ours: list[tuple[str, float]], infos: dict[str, dict[str, Any]],
            ort: list[tuple[str, str, float]], nodes: dict[str, dict[str, Any]]) -> dict[str, Any]:
    cls: dict[str, dict[str, float]] = defaultdict(lambda: {"ours_ms": 0.0, "ort_ms": 0.0, "flops": 0.0})
    layers: dict[str, dict[str, float]] = defaultdict(lambda: {"ours_ms": 0.0, "ort_ms": 0.0, "n": 0})
    for sym, t in ours:
        info = infos.get(sym, {"class": "other", "layer": None, "flops": 0.0})
        cls[info["class"]]["ours_ms"] += 1e3 * t
        cls[info["class"]]["flops"] += info["flops"]
        if info["layer"]:
            layers[info["layer"]]["ours_ms"] += 1e3 * t
    for name, op, t in ort:
        info = ort_class(name, op, nodes)
        cls[info["class"]]["ort_ms"] += 1e3 * t
        if info["layer"]:
            layers[info["layer"]]["ort_ms"] += 1e3 * t
            layers[info["layer"]]["n"] += 1
    for d in list(cls.values()) + list(layers.values()):
        d["excess_ms"] = d["ours_ms"] - d["ort_ms"]
        d["ratio"] = d["ours_ms"] / d["ort_ms"] if d["ort_ms"] else float("inf")
    return {"classes": dict(cls), "layers": dict(layers),
            "total_ours_ms": sum(d["ours_ms"] for d in cls.values()),
            "total_ort_ms": sum(d["ort_ms"] for d in cls.values())}


def print_report(key: str, batch: int, res: dict[str, Any], n_layers: int) -> None:
    print(f"\n{key} b{batch}: kernels ours {res['total_ours_ms']:.2f} ms, ORT nodes {res['total_ort_ms']:.2f} ms"
          f" (x{res['total_ours_ms'] / max(res['total_ort_ms'], 1e-9):.2f})")
    print(f"  {'class':10s} {'ours ms':>9s} {'ORT ms':>9s} {'excess':>9s} {'ratio':>6s}")
    for c, d in sorted(res["classes"].items(), key=lambda kv: -kv[1]["excess_ms"]):
        print(f"  {c:10s} {d['ours_ms']:9.3f} {d['ort_ms']:9.3f} {d['excess_ms']:9.3f} {d['ratio']:6.2f}")
    print("  layers with the largest excess (all layers of that shape together):")
    for lay, d in sorted(res["layers"].items(), key=lambda kv: -kv[1]["excess_ms"])[:n_layers]:
        print(f"    {lay:28s} {d['ours_ms']:8.3f} {d['ort_ms']:8.3f} {d['excess_ms']:8.3f} x{d['ratio']:.2f}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="mobilenet,resnet50")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--runs", type=int, default=15)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--baseline", action="append", default=[], metavar="MODULE.ATTR=VALUE",
                    help="also build with this schedule setting (repeatable; e.g. "
                         "backends.tvm.schedules.depthwise.PAD_INLINE=False) and time both builds "
                         "in interleaved rounds: the before/after ratio per class")
    ap.add_argument("--scaling", action="store_true",
                    help="instead: per kernel, wall time on 1 vs 2 threads (min over --runs; no ORT); "
                         "with --baseline, both builds in --runs interleaved rounds of 3 runs")
    ap.add_argument("--outside", default="", metavar="THREADS",
                    help="instead: the time outside the kernels on these thread counts (e.g. 1,2): wall, "
                         "kernel sum, page faults, switches and worker sleeps per run (no ORT)")
    ap.add_argument("--conv-algorithm", default="direct", choices=("direct", "im2col", "winograd", "auto"),
                    help="convolution algorithm of our builds (default direct; auto: this machine's "
                         "cached per-conv choices, the per_device default column)")
    ap.add_argument("--json", default=str(RESULTS))
    args = ap.parse_args(argv)

    from backends.tvm.executable import configure_threads
    from backends.tvm.target import resolve_target

    configure_threads(1)
    target = resolve_target(None)
    # the 1-thread profile times builds made for one thread, as a 1-thread run gets them
    # (per_device.build_threads_for); --scaling and --outside run 2 threads: the parallel build
    bt = None if args.scaling or args.outside else 1
    pd = _per_device()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for key in args.models.split(","):
            for batch in (int(b) for b in args.batches.split(",")):
                m, _ = pd.model_for(key, batch, {})
                if m is None:
                    continue
                for i, node in enumerate(m.graph.node):
                    node.name = node.name or f"node{i}_{node.op_type}"
                feeds = pd._feeds(m)
                print(f"build {key} b{batch}", file=sys.stderr, flush=True)
                ex, infos = build_ours(m, target, bt, args.conv_algorithm)
                if args.outside:
                    rows = [outside_kernels(ex, feeds, args.runs, int(n)) for n in args.outside.split(",")]
                    for r in rows:
                        print_outside(key, batch, r)
                    results.append({"model": key, "batch": batch, "outside": rows})
                    continue
                if args.scaling and args.baseline:
                    base = with_settings(lambda: build_ours(m, target, bt, args.conv_algorithm),
                                         parse_settings(args.baseline)[1])()
                    rows, base_rows = paired_scaling([(ex, infos), base], feeds, args.runs)
                    print_scaling(key, batch, rows, args.layers)
                    print_scaling(f"{key} baseline ({' '.join(args.baseline)}), same rounds", batch, base_rows, 0)
                    results.append({"model": key, "batch": batch, "scaling": rows,
                                    "baseline": {"settings": args.baseline, "scaling": base_rows}})
                    continue
                if args.scaling:
                    rows = thread_scaling(ex, infos, feeds, args.runs)
                    print_scaling(key, batch, rows, args.layers)
                    results.append({"model": key, "batch": batch, "scaling": rows})
                    continue
                exes = [ex]
                if args.baseline:
                    baseline = parse_settings(args.baseline)[1]
                    base_ex, base_infos = with_settings(
                        lambda: build_ours(m, target, bt, args.conv_algorithm), baseline)()
                    exes.append(base_ex)
                timed = profile_ours(exes, feeds, args.runs)
                ort = profile_ort(m, feeds, args.runs, Path(tmp))
                nodes = onnx_node_info(m)
                res = compare(timed[0], infos, ort, nodes)
                print_report(key, batch, res, args.layers)
                row = {"model": key, "batch": batch, **res}
                if args.baseline:
                    base = compare(timed[1], base_infos, ort, nodes)
                    print(f"  baseline ({' '.join(args.baseline)}), same rounds: kernels {base['total_ours_ms']:.2f} ms")
                    print(f"  {'class':10s} {'new ms':>9s} {'base ms':>9s} {'new/base':>8s} {'ORT ms':>9s}")
                    for c, d in sorted(res["classes"].items(), key=lambda kv: -kv[1]["ours_ms"]):
                        b = base["classes"].get(c, {}).get("ours_ms", 0.0)
                        print(f"  {c:10s} {d['ours_ms']:9.3f} {b:9.3f} {d['ours_ms'] / b if b else float('nan'):8.2f} {d['ort_ms']:9.3f}")
                    row["baseline"] = {"settings": args.baseline, **base}
                results.append(row)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"target": str(target), "runs": args.runs, "threads": "1,2" if args.scaling else 1,
                                           "rows": results}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
