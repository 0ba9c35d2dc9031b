"""Per-device speed of the TVM backend against ONNX Runtime on this machine's CPU.

    python benchmarks/per_device.py [--quick] [--batches 1,8] [--threads 1,2] [--tune-trials N]
    python benchmarks/per_device.py --models heldout_vit,heldout_mbv2,heldout_inception,heldout_unet
    python benchmarks/per_device.py --models path/to/model.onnx [--shape input=1,3,224,224]
    python benchmarks/per_device.py --markdown [--json FILE]      # render the saved table
    python benchmarks/per_device.py --models gpt,bert --tune-trials 256 --tune-plan [--json FILE]
    python benchmarks/per_device.py --models gpt --tune-trials 256 --tune-budget-s 1800 ...

``--tune-plan`` extracts the distinct tuning tasks of the chosen models and batches (the kernels a
``--tune-trials`` run would tune, shared kernels once) without tuning, and prints per kernel the
trials done (``trials.json``) and left and the estimated time left at the database's measured
seconds per trial (``backends/tvm/tuning.py`` rule 7); ``--json FILE`` saves it. ``--tune-budget-s S``
tunes those tasks first, the largest work first, and stops at about S seconds with the database
consistent (the next run continues); the tuned column is then built from the database as it is
(no further tuning), so it shows what the budget bought. ``--tune-budget-s 0`` tunes nothing (it
still compares each tuned kernel with its default schedule, rule 6).

``--models`` takes zoo keys (:data:`MODELS`), held-out architectures (``heldout_*``, generated
with seeded random weights by ``benchmarks/heldout_models.py``: not what the schedules were
tuned on) and ``.onnx`` files (symbolic dims bound by ``--shape`` / the batch on axis 0; a file
whose batch axis is fixed runs only at that batch).

"% of peak" (``tvm_*_pct_peak``): the model's FLOPs (``partitioner.cost.ops``, one multiply-add
= 2) / time / (the one-core FMA peak measured by ``backends/tvm/peak.py`` in the same run x
threads). ``flops_by_class`` gives the share of each kernel class (gemm, conv, depthwise_conv,
...), so a memory-bound model's low figure is visibly its depthwise/elementwise share.

Columns (one row per model x batch x threads): TVM untuned (``"zero"`` pipeline: TVM's
legalize+fuse, no schedules), TVM default schedules (``"scheduled"`` pipeline, with the build's
default conv algorithm, ``auto`` since session 14: the fastest per conv by measurement, cached per
machine; ``settings.default_conv_algorithm`` says which), TVM tuned
(MetaSchedule, ``--tune-trials`` per kernel, database in ``--tuning-db``; skipped when 0), for
the conv models TVM default schedules with ``--conv-algorithm`` (direct / im2col / Winograd /
``auto``, its own column; ``--conv-algorithm direct`` is the pre-session-14 default, a
before/after in one run; skipped when not given) and ONNX Runtime (CPUExecutionProvider, ``intra_op_num_threads`` = threads). ORT and the TVM
builds are timed together, the same way (:func:`paired_times`): ``--blocks`` rounds (5), one
block of ``--runs`` runs (5) per engine in each, the order reversed every other round, each block
after a settle pause and a warm-up; a time is the median of the engine's block medians, and the
row also keeps each block's median (``*_block_ms``), the 10th/90th percentile of all runs
(``*_spread_ms``) and the calling thread's context switches per run (``*_switches_per_run``: on 2
threads ~1 per parallel kernel means TVM's worker ran on the main thread's core), and how often
the contention guard dropped TVM to 1 thread meanwhile (``tvm_guard_drops``, and each drop's
record, ``tvm_guard_events``), and per block where
the machine's CPU went (``*_block_load``: other processes' share, the hypervisor's steal, this
process's CPU per wall second; session 20 found 2-thread blocks of every engine, ONNX Runtime's
included, at about the 1-thread time on an otherwise idle machine). The untuned
column is timed apart (``--zero-runs`` runs after one warm-up, since it is up to 100x slower).
Ratios are computed from times of the same invocation: ``tvm_*_vs_ort`` from the two medians,
and ``tvm_*_vs_ort_paired`` as the median over rounds of the two engines' block ratio in that
round (:func:`paired_ratio`, why). The TVM builds are compiled once per
kind of row (:func:`build_threads_for`): the 1-thread rows time builds made for one thread, which
have no parallel loops (a parallel loop's closure is slower even on a 1-thread pool:
``backends/tvm/schedules/threads.py``, "Builds for one thread"), the other rows the parallel
builds; so a run with ``--threads 1,2`` compiles every column twice. Every TVM output is
checked against ONNX Runtime (``--rtol`` 1e-4, ``--atol`` 1e-5 by default) and the max error is saved.

Sizes are chosen so that a full run stays under ~15 minutes on a 2-core machine (see
``MODELS``; the interleaved timing runs each engine ~30 times a row where one block ran 11); ``light_resnet50`` (224x224, batch 1 only) skips the untuned column (~7 s a run).
Results: ``benchmarks/results/per_device.json`` (machine, versions, settings, rows).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")  # numpy's pool must not spin into a timed block

import numpy as np  # noqa: E402
import onnx  # noqa: E402

from benchmarks.module_settings import parse_settings, with_settings  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "per_device.json"
# Idle time before each timed block: ORT's and TVM's workers busy-wait after a call and would take
# the second core from the next block (backends/tvm/schedules/threads.py, "the pool's idle spin").
SETTLE_S = 0.05

# name -> (zoo name, kwargs without batch, supports batch > 1, run the untuned column)
MODELS: dict[str, tuple[str, dict[str, Any], bool, bool]] = {
    "resnet18": ("resnet", {"depth": 18, "image": 112, "width": 64, "classes": 1000}, True, True),
    "resnet50": ("resnet", {"depth": 50, "image": 64, "width": 64, "classes": 1000}, True, True),
    "mobilenet": ("mobilenet", {"image": 112}, True, True),
    "bert": ("bert", {"seq": 64, "hidden": 128, "heads": 4, "layers": 2}, True, True),
    "gpt": ("gpt", {"seq": 64, "hidden": 128, "heads": 4, "layers": 2}, True, True),
    # the shipped weights are all 0.02 (a flat softmax checks nothing): seeded random weights,
    # the loader's default, named here so the JSON records them
    "light_resnet50": ("light_resnet50", {"weights": "random", "seed": 0}, False, False),
}
QUICK = ["resnet18", "mobilenet", "bert", "gpt"]
# benchmarks/heldout_models.py's HELDOUT keys (named here so --help does not import onnx builders)
HELDOUT_KEYS = ["heldout_vit", "heldout_mbv2", "heldout_inception", "heldout_unet"]
CONV_MODELS = {"resnet18", "resnet50", "mobilenet", "light_resnet50"}  # where --conv-algorithm applies


def _heldout() -> Any:
    import importlib.util

    spec = importlib.util.spec_from_file_location("heldout_models", ROOT / "benchmarks" / "heldout_models.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def model_for(key: str, batch: int, shapes: dict[str, list[int]]) -> tuple[onnx.ModelProto | None, dict[str, Any]]:
    """The shape-inferred model for ``key`` at ``batch`` and what the row records about it
    (source, args, whether the conv-algorithm / untuned columns apply); None when the model
    cannot run at that batch (a zoo builder without a batch argument, a file with a fixed batch)."""
    import models_zoo

    if key in MODELS:
        zoo, kwargs, batched, run_zero = MODELS[key]
        if batch > 1 and not batched:
            return None, {}
        m = models_zoo.build(zoo, **({**kwargs, "batch": batch} if batched else kwargs))
        info = {"source": "zoo", "zoo": zoo, "args": kwargs, "run_zero": run_zero, "conv": key in CONV_MODELS}
    elif key.endswith(".onnx"):
        from partitioner.bind_inputs import bind_dims

        m = onnx.load(key)
        fixed = [d.dim_value for i in m.graph.input[:1] for d in i.type.tensor_type.shape.dim[:1] if d.HasField("dim_value")]
        if not shapes and fixed and fixed[0] != batch:
            return None, {}
        bind_dims(m, key, None if shapes else batch, shapes)
        info = {"source": "file", "args": {"shape": shapes}, "run_zero": False,
                "conv": any(n.op_type == "Conv" for n in m.graph.node)}
    else:
        heldout = _heldout()
        if key not in heldout.HELDOUT:
            raise SystemExit(f"per_device.py: unknown model {key!r}: a zoo key ({', '.join(MODELS)}), "
                             f"{', '.join(heldout.HELDOUT)} or an .onnx file")
        m = heldout.HELDOUT[key](batch, 0)
        info = {"source": "heldout", "args": {"seed": 0}, "run_zero": False,
                "conv": any(n.op_type == "Conv" for n in m.graph.node)}
    return onnx.shape_inference.infer_shapes(m), info


def flops_by_class(m: onnx.ModelProto) -> dict[str, float]:
    """FLOPs of one inference per kernel class (``partitioner.cost.ops`` rules and classes)."""
    import onnx_ir as ir

    from partitioner.cost.ops import op_class, op_cost

    out: dict[str, float] = {}
    for node in ir.from_proto(m).graph:
        c = op_cost(node)
        if c.flops:
            out[op_class(node)] = out.get(op_class(node), 0.0) + float(c.flops)
    return out


def _feeds(m: onnx.ModelProto) -> dict[str, np.ndarray]:
    import models_zoo

    return models_zoo.sample_inputs(m, 0)


# Timing, the same for every engine (ONNX Runtime included): BLOCKS rounds, one block of ``--runs``
# runs per engine in each round, the order reversed every other round, and an engine's time is the
# median of its block medians. Why: a row's engines used to be timed in one block each, one after
# the other, each ~10-30 ms at batch 1; any slow episode of the shared machine that long (a
# scheduler placing the TVM worker on the main thread's core, another process waking) moved one
# engine's whole median and not the other's, and batch-1 2-thread rows swung 0.8x-1.8x between
# quiet runs an hour apart (docs/per_device_speed.md, "Time outside the kernels (session 9)").
# Interleaved blocks put such an episode in one block of each engine at most. BLOCKS = 1 is the
# old single-block timing.
BLOCKS = 5
# Warm-up before each block, after the settle pause: at least WARMUP_RUNS runs and WARMUP_S seconds.
# Seen once (heldout_unet b1, 2 threads, load ~0.4): the first ~8 ms of TVM runs after the pause
# took 1.4-1.6x the later ones, more than one 2 ms warm-up run covers; long runs keep one warm-up.
WARMUP_RUNS = 1
WARMUP_S = 0.02


def _thread_switches() -> int:
    """Times the calling thread was scheduled in so far (``/proc/thread-self/schedstat``, third
    field); -1 where the file does not exist (not Linux, no schedstats)."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            return int(f.read().split()[2])
    except (OSError, IndexError, ValueError):
        return -1


def _machine_ticks() -> tuple[int, int, int] | None:
    """``/proc/stat``'s all-CPU totals (clock ticks): busy (every state but idle and iowait),
    steal, and all; None where the file cannot be read (not Linux)."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = v[3] + (v[4] if len(v) > 4 else 0)
    steal = v[7] if len(v) > 7 else 0
    return sum(v) - idle - steal, steal, sum(v)


def _block_load(t0: tuple[int, int, int] | None, t1: tuple[int, int, int] | None, cpu_s: float,
                wall_s: float) -> dict[str, float]:
    """Where the machine's CPU went during one timed block: ``foreign_share``, the CPU used by
    other processes (the machine's busy ticks minus this process's CPU) as a share of all CPUs'
    time, and ``steal_share``, the hypervisor's steal as that share (both -1 without
    ``/proc/stat``); ``cpu_per_wall``, this process's CPU seconds per wall second (about the
    thread count while every thread runs or spins; lower when a core was taken away). The shares
    count ``/proc/stat`` ticks (10 ms at 100 Hz), so they mean something for blocks of 100 ms and
    more; ``cpu_per_wall`` is exact at any length."""
    out = {"cpu_per_wall": round(cpu_s / wall_s, 3) if wall_s > 0 else -1.0,
           "foreign_share": -1.0, "steal_share": -1.0}
    if t0 is not None and t1 is not None and t1[2] > t0[2]:
        tick = 1.0 / os.sysconf("SC_CLK_TCK")
        total = (t1[2] - t0[2]) * tick
        out["foreign_share"] = round(max(0.0, (t1[0] - t0[0]) * tick - cpu_s) / total, 3)
        out["steal_share"] = round((t1[1] - t0[1]) * tick / total, 3)
    return out


def _block(fn: Callable[[], Any], runs: int, clock: Callable[[], float], sleep: Callable[[float], None],
           warmup: tuple[int, float] = (WARMUP_RUNS, WARMUP_S)) -> tuple[list[float], float, dict[str, float]]:
    """One timed block: settle, warm up (``warmup``: at least that many runs and seconds), ``runs``
    timed runs. Returns the run times (s), the calling thread's context switches per timed run
    and the block's :func:`_block_load`."""
    sleep(SETTLE_S)  # the previous block's pool (ORT's, TVM's) stops spinning first
    t_end, n = clock() + warmup[1], 0
    while n < warmup[0] or clock() < t_end:
        fn()
        n += 1
    times = []
    # the load is measured in real time (process_time: every thread of this process, not in ticks)
    sw0, m0, c0, w0 = _thread_switches(), _machine_ticks(), time.process_time(), time.perf_counter()
    for _ in range(max(1, runs)):
        t0 = clock()
        fn()
        times.append(clock() - t0)
    sw1, m1, c1, w1 = _thread_switches(), _machine_ticks(), time.process_time(), time.perf_counter()
    return (times, ((sw1 - sw0) / len(times) if sw0 >= 0 and sw1 >= 0 else -1.0),
            _block_load(m0, m1, c1 - c0, w1 - w0))


def paired_times(fns: dict[str, Callable[[], Any]], runs: int, blocks: int | None = None, *,
                 clock: Callable[[], float] = time.perf_counter,
                 sleep: Callable[[float], None] = time.sleep) -> dict[str, dict[str, Any]]:
    """Time every engine of ``fns`` in ``blocks`` interleaved rounds (see BLOCKS). Per engine:
    ``s`` (median of the block medians), ``block_ms`` (each block's median), ``spread_ms`` (10th
    and 90th percentile of all its runs) and ``switches_per_run`` (the calling thread's context
    switches per run, median over blocks: on 2 threads about one per parallel kernel when TVM's
    worker shares the main thread's core, near 0 when each has its own) and ``block_load`` (each
    block's :func:`_block_load`: a slow block beside other processes' CPU or the hypervisor's
    steal was disturbed from outside; one whose ``cpu_per_wall`` fell without either lost a core
    some other way)."""
    blocks = BLOCKS if blocks is None else max(1, int(blocks))
    per: dict[str, list[tuple[list[float], float, dict[str, float]]]] = {name: [] for name in fns}
    names = list(fns)
    for b in range(blocks):
        for name in (names if b % 2 == 0 else names[::-1]):
            per[name].append(_block(fns[name], runs, clock, sleep))
    out = {}
    for name, got in per.items():
        meds = [statistics.median(t) for t, _, _ in got]
        runs_all = [x for t, _, _ in got for x in t]
        out[name] = {"s": statistics.median(meds), "block_ms": [round(1e3 * m, 4) for m in meds],
                     "spread_ms": [round(1e3 * float(q), 4) for q in np.percentile(runs_all, [10, 90])],
                     "switches_per_run": statistics.median(sw for _, sw, _ in got),
                     "block_load": [load for _, _, load in got]}
    return out


def paired_ratio(blocks_ms: list[float], ort_blocks_ms: list[float]) -> float:
    """The median over rounds of an engine's block median / ONNX Runtime's block median in the same
    round (``*_vs_ort_paired``). Why, beside the ratio of the two medians: on 2 threads the blocks
    of every engine come in two speeds (session 21, Zen 4: resnet18 b1 ORT 6.2-6.6 or 10.4-10.7 ms,
    TVM 5.5-6.6 or 8.7-9.1 ms, each block at 2.0 CPU seconds per wall second, no switches, no
    steal), and the slow state lasts one to a few blocks; a median of 5 blocks then falls in
    either state, independently per engine. A ratio within a round compares blocks taken
    ~0.1-0.3 s apart, mostly in one state."""
    return statistics.median(a / b for a, b in zip(blocks_ms, ort_blocks_ms))


def _median_s(fn: Callable[[], Any], runs: int) -> float:
    """One engine alone: one block, one warm-up run (the untuned column, up to 100x slower than
    the others: timed apart, as before)."""
    return statistics.median(_block(fn, runs, time.perf_counter, time.sleep, (1, 0.0))[0])


def _ort(m: onnx.ModelProto, threads: int):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    return ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])


def _tvm_build(m: onnx.ModelProto, out: Path, options: dict[str, Any]) -> tuple[Any, float]:
    from backends.tvm.build import build
    from backends.tvm.executable import load

    t0 = time.perf_counter()
    build(m, out, options=options)
    compile_s = time.perf_counter() - t0
    return load(m, out), compile_s


def build_threads_for(threads: int) -> int | None:
    """The build a row on ``threads`` threads times: built for 1 thread (``options["threads"]`` = 1,
    no parallel loops: ``backends/tvm/schedules/threads.py``, "Builds for one thread") for the
    1-thread rows, the usual parallel build (None: thread count not fixed) for the others."""
    return 1 if threads == 1 else None


def _tvm_builds(m: onnx.ModelProto, stem: str, variants: dict[str, dict[str, Any]], threads: int | None,
                work: Path) -> tuple[dict[str, Any], dict[str, float]]:
    """Every variant of :func:`bench_model` built for ``threads`` (see :func:`build_threads_for`)."""
    exes, compile_s = {}, {}
    suffix = f"_t{threads}" if threads else ""
    for name, opts in variants.items():
        print(f"  compile {stem} {name}{suffix}", file=sys.stderr, flush=True)
        opts = dict(opts)
        settings = opts.pop("build_settings", [])  # --build-baseline: module attributes set while it builds
        opts = {**opts, "threads": threads} if threads else opts
        exes[name], compile_s[name] = with_settings(
            lambda opts=opts, name=name: _tvm_build(m, work / f"{stem}_{name}{suffix}.so", opts), settings)()
    return exes, compile_s


def bench_model(key: str, batch: int, threads_list: list[int], args: argparse.Namespace, work: Path) -> list[dict[str, Any]]:
    from backends.tvm.executable import configure_threads
    from partitioner.runtime.comm_local import LocalWorld

    m, info = model_for(key, batch, args.shapes)
    if m is None:
        return []
    feeds = _feeds(m)
    by_class = flops_by_class(m)
    flops = sum(by_class.values())
    comm = LocalWorld(1).communicator(0)
    variants: dict[str, dict[str, Any]] = {"scheduled": {"pipeline": "scheduled"}}
    if args.build_baseline:  # the default build again, schedule settings changed while it builds
        variants["build_base"] = {"pipeline": "scheduled",
                                  "build_settings": parse_settings(args.build_baseline)[1]}
    if info["run_zero"] and not args.no_zero:
        variants["zero"] = {"pipeline": "zero"}
    if args.conv_algorithm and info["conv"]:
        variants["conv"] = {"pipeline": "scheduled", "conv_algorithm": args.conv_algorithm}
    if args.tune_trials > 0:
        # with a budget the tasks were tuned before the rows (tune_with_budget): apply the database only
        trials = 0 if args.tune_budget_s is not None else args.tune_trials
        variants["tuned"] = {"pipeline": "scheduled", "tune_trials": trials, "tuning_db": args.tuning_db,
                             "tune_progress": True}
        if "conv" in variants:  # tune what the conv-algorithm build runs (Winograd GEMMs included)
            variants["tuned"]["conv_algorithm"] = args.conv_algorithm
    builds: dict[int | None, tuple[dict[str, Any], dict[str, float]]] = {}
    base = {"model": Path(key).name, "source": info["source"], "zoo": info.get("zoo"), "args": info["args"],
            "batch": batch, "flops": flops, "flops_by_class": by_class}
    rows = []
    for threads in threads_list:
        group = build_threads_for(threads)
        if group not in builds:
            builds[group] = _tvm_builds(m, f"{key}_b{batch}", variants, group, work)
        exes, compile_s = builds[group]
        configure_threads(threads)
        row = {**base, "threads": threads, "tvm_build_threads": group, **time_row(m, feeds, exes, threads, args, comm)}
        for name in exes:
            row[f"tvm_{name}_compile_s"] = round(compile_s[name], 2)
            row[f"tvm_{name}_vs_ort"] = row[f"tvm_{name}_ms"] / row["ort_ms"]
        for name in [n for n in (*exes, "scheduled_base") if f"tvm_{n}_block_ms" in row]:
            row[f"tvm_{name}_vs_ort_paired"] = paired_ratio(row[f"tvm_{name}_block_ms"], row["ort_block_ms"])
        if "tvm_build_base_block_ms" in row:  # the schedule change's own before/after, paired by round
            row["tvm_build_base_settings"] = args.build_baseline
            row["tvm_scheduled_vs_build_base_paired"] = paired_ratio(row["tvm_scheduled_block_ms"],
                                                                     row["tvm_build_base_block_ms"])
            if args.peak_flops:
                row[f"tvm_{name}_pct_peak"] = pct_peak(flops, row[f"tvm_{name}_ms"], args.peak_flops, threads)
        if args.peak_flops:
            row["ort_pct_peak"] = pct_peak(flops, row["ort_ms"], args.peak_flops, threads)
        rows.append(row)
        print("  " + json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()
                                 if k != "args" and not k.endswith(("_block_ms", "_spread_ms", "_block_load"))}),
              file=sys.stderr, flush=True)
    return rows


def tuning_tasks(models: list[str], batches: list[int], args: argparse.Namespace) -> tuple[Any, list[tuple[str, Any]]]:
    """``(tuning target, [(model label, task)])``: the contraction kernels the tuned column of
    these rows tunes (the same conv algorithm as :func:`bench_model` gives it)."""
    import tvm

    from backends.tvm import deep_stack, tuning
    from backends.tvm.conv_algorithms import default_algorithm
    from backends.tvm.lower import lower_program
    from backends.tvm.target import target_dict

    target = tuning.tuning_target(tvm.target.Target(target_dict(None)))
    labelled: list[tuple[str, Any]] = []
    for key in models:
        for batch in batches:
            m, info = model_for(key, batch, args.shapes)
            if m is None:
                continue
            conv = args.conv_algorithm if (args.conv_algorithm and info["conv"]) else default_algorithm()
            print(f"  tasks of {key} b{batch}", file=sys.stderr, flush=True)

            def extract(m: onnx.ModelProto = m, conv: str = conv) -> list[Any]:
                prepared, _ = tuning.prepare_for_database(lower_program(m).mod, target, args.tuning_db, conv)
                return tuning.extract_tasks(prepared, target)

            labelled += [(f"{Path(key).name} b{batch}", t) for t in deep_stack.run(extract)]
    return target, labelled


def print_plan(p: dict[str, Any]) -> None:
    print(f"{p['tasks']} kernels, {p['trials_done']}/{p['tasks'] * p['trials_target']} trials done, "
          f"{p['trials_left']} left, ~{p['est_s_left'] / 60:.0f} min at {p['s_per_trial']} s/trial "
          f"({p['s_per_trial_source']}); database {p['database']}")
    for r in p["kernels"]:
        cmp = f"  default {r['default_us']} us, tuned {r['tuned_us']} us -> {r['use']}" if r.get("tuned_us") else ""
        print(f"  {r['kernel']:<40} x{r['occurrences']:<3} {r['flops'] / 1e6:9.2f} MFLOP  {r['trials_done']:>4}/"
              f"{p['trials_target']} trials  ~{r['est_s_left'] / 60:5.1f} min  {', '.join(r['models'])}{cmp}")


def time_row(m: onnx.ModelProto, feeds: dict[str, np.ndarray], exes: dict[str, Any], threads: int,
             args: argparse.Namespace, comm: Any) -> dict[str, Any]:
    """One row's checks and times: every build against ONNX Runtime (``--rtol``/``--atol``), then
    ORT and the builds timed together by :func:`paired_times` (the untuned one apart: too slow)."""
    sess = _ort(m, threads)
    ref = sess.run(None, feeds)
    row: dict[str, Any] = {}
    fns: dict[str, Callable[[], Any]] = {"ort": lambda: sess.run(None, feeds)}
    for name, ex in exes.items():
        got = ex.run(feeds, comm)
        row[f"tvm_{name}_max_abs_err"] = max(float(np.max(np.abs(got[o.name] - r))) for o, r in zip(m.graph.output, ref))
        row[f"tvm_{name}_matches_ort"] = all(np.allclose(got[o.name], r, rtol=args.rtol, atol=args.atol)
                                             for o, r in zip(m.graph.output, ref))
        if name == "zero":
            row["tvm_zero_ms"] = 1e3 * _median_s(lambda ex=ex: ex.run(feeds, comm), args.zero_runs)
            continue
        fns[f"tvm_{name}"] = lambda ex=ex: ex.run(feeds, comm)
        if name == "scheduled" and args.runtime_baseline:  # the same build, a runtime setting changed
            now, base = parse_settings(args.runtime_baseline)
            plain = fns["tvm_scheduled"]
            fns["tvm_scheduled"] = with_settings(plain, now)  # the same wrapper, the same cost
            fns["tvm_scheduled_base"] = with_settings(plain, base)
            row["tvm_scheduled_base_settings"] = args.runtime_baseline
    from backends.tvm.executable import _contention_guard

    guard = _contention_guard()
    drops = guard.dropped
    timed = paired_times(fns, args.runs, args.blocks)
    row["tvm_guard_drops"] = n = guard.dropped - drops  # backends/tvm/contention.py fired
    row["tvm_guard_events"] = guard.events[-n:] if n else []  # each drop: switches, CPU, idle gap, hold
    for name, t in timed.items():
        row[f"{name}_ms"] = 1e3 * t["s"]
        if name == "tvm_scheduled_base":
            row["tvm_scheduled_base_vs_ort"] = row[f"{name}_ms"] / row["ort_ms"]
        row[f"{name}_block_ms"] = t["block_ms"]
        row[f"{name}_spread_ms"] = t["spread_ms"]
        row[f"{name}_switches_per_run"] = t["switches_per_run"]
        row[f"{name}_block_load"] = t["block_load"]
    return row


def pct_peak(flops: float, ms: float, peak_per_core: float, threads: int) -> float:
    """100 x achieved FLOP/s over the measured peak of ``threads`` cores."""
    return 100.0 * flops / (ms * 1e-3) / (peak_per_core * threads)


def machine() -> dict[str, Any]:
    import onnxruntime
    import tvm

    from backends.tvm.target import _cpuinfo, detect_host_target

    model, _flags, vendor = _cpuinfo()
    return {"cpu": model, "vendor": vendor, "cores": os.cpu_count(), "platform": platform.platform(),
            "python": platform.python_version(), "tvm_target": detect_host_target(),
            "versions": {"tvm": str(tvm.__version__), "onnxruntime": onnxruntime.__version__, "onnx": onnx.__version__,
                         "numpy": np.__version__}}


def render_markdown(data: dict[str, Any]) -> str:
    """The results as a markdown table (what the README shows), from the saved JSON."""
    conv = data.get("settings", {}).get("conv_algorithm") or "direct"
    cols = [("untuned", "tvm_zero_ms"), ("default schedules", "tvm_scheduled_ms"),
            (f"default, conv {conv}", "tvm_conv_ms"), ("tuned", "tvm_tuned_ms"),
            ("default, runtime baseline", "tvm_scheduled_base_ms"),
            ("default, build baseline", "tvm_build_base_ms")]
    present = [(label, k) for label, k in cols if any(k in r for r in data["rows"])]
    tuned = any("tvm_tuned_ms" in r for r in data["rows"])
    peak = any("tvm_scheduled_pct_peak" in r for r in data["rows"])  # runs before the column existed have none
    paired = any("tvm_scheduled_vs_ort_paired" in r for r in data["rows"])  # since session 21
    head = "| model | batch | threads | " + " | ".join(f"TVM {label} (ms)" for label, _ in present) + \
        " | ONNX Runtime (ms) | default / ORT |" + (" same, paired by round |" if paired else "") + \
        (" tuned / ORT |" if tuned else "") + (" default % of peak | ORT % of peak |" if peak else "")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in data["rows"]:
        cells = [f"{r[k]:.2f}" if k in r else "-" for _, k in present]
        ratio = r.get("tvm_scheduled_vs_ort")
        ratio_s = f"{ratio:.2f}x" if ratio is not None else "-"
        if paired:
            p = r.get("tvm_scheduled_vs_ort_paired")
            ratio_s += f" | {p:.2f}x" if p is not None else " | -"
        tuned_s = ""
        if tuned:
            t = r.get("tvm_tuned_vs_ort")
            tuned_s = f" {t:.2f}x |" if t is not None else " - |"
        if peak:
            tuned_s += "".join(f" {r[k]:.1f}% |" if k in r else " - |" for k in ("tvm_scheduled_pct_peak", "ort_pct_peak"))
        lines.append(f"| {r['model']} | {r['batch']} | {r['threads']} | " + " | ".join(cells) +
                     f" | {r['ort_ms']:.2f} | {ratio_s} |" + tuned_s)
    m = data.get("machine", {})
    lines.append("")
    lines.append(f"{m.get('cpu', '?')} ({m.get('cores', '?')} cores), TVM {m.get('versions', {}).get('tvm', '?')}, "
                 f"ONNX Runtime {m.get('versions', {}).get('onnxruntime', '?')}; " + _timing_note(data['settings']) +
                 (f"; tuned: MetaSchedule, {data['settings']['tune_trials']} trials per contraction kernel"
                  + (f", conv models built with conv {conv}" if conv != "direct" else "") + "." if tuned else ".") +
                 f" Default column: conv {data.get('settings', {}).get('default_conv_algorithm', 'direct')}." +
                 (f" % of peak: model FLOPs / time / ({data['peak']['fma_flops'] / 1e9:.0f} GFLOP/s measured one-core FMA "
                  "peak x threads)." if peak and data.get("peak") else ""))
    return "\n".join(lines)


def _timing_note(settings: dict[str, Any]) -> str:
    """How the table's times were taken (runs before ``--blocks`` existed: one block each)."""
    blocks, runs, zero = settings.get("blocks", 1), settings["runs"], settings["zero_runs"]
    if blocks == 1:
        return f"median of {runs} runs after warm-up (untuned: {zero})"
    return (f"median of the medians of {blocks} interleaved blocks of {runs} runs per engine, after "
            f"warm-up (untuned: {zero} runs, timed apart)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=",".join([*MODELS, *HELDOUT_KEYS]),
                    help="zoo keys, heldout_* keys or .onnx files (default: all zoo and held-out models)")
    ap.add_argument("--quick", action="store_true", help=f"only {', '.join(QUICK)}, batch 1")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--runs", type=int, default=5, help="timed runs per block (default 5)")
    ap.add_argument("--blocks", type=int, default=BLOCKS,
                    help=f"interleaved rounds, one block per engine each (default {BLOCKS}; 1: one block each)")
    ap.add_argument("--zero-runs", type=int, default=1)
    ap.add_argument("--no-zero", action="store_true", help="skip the untuned column")
    ap.add_argument("--tune-trials", type=int, default=0)
    ap.add_argument("--tune-plan", action="store_true",
                    help="print the tuning tasks of these models/batches, trials done/left and the time left; no tuning")
    ap.add_argument("--tune-budget-s", type=float, default=None, metavar="S",
                    help="tune these models' kernels for about S seconds first (largest work first, resumable), "
                         "then time the tuned column as the database stands")
    ap.add_argument("--conv-algorithm", default=None, choices=("direct", "im2col", "winograd", "auto"),
                    help="also build the conv models with this convolution algorithm (its own column; "
                         "the default column uses the build's default, auto)")
    ap.add_argument("--runtime-baseline", action="append", default=[], metavar="MODULE.ATTR=VALUE",
                    help="also time the default build with this run-time setting changed (repeatable; e.g. "
                         "backends.tvm.contention.CONTENTION_SWITCHES=0), in the same interleaved blocks: "
                         "column tvm_scheduled_base_ms, a before/after from one run")
    ap.add_argument("--build-baseline", action="append", default=[], metavar="MODULE.ATTR=VALUE",
                    help="also build the default schedules with this module setting changed while building "
                         "(repeatable; e.g. "
                         "backends.tvm.schedules.contraction.FULL_WIDTH_NARROW_TILE=False), "
                         "timed in the same interleaved blocks: column tvm_build_base_ms and "
                         "tvm_scheduled_vs_build_base_paired, a schedule rule's before/after from one run")
    ap.add_argument("--tuning-db", default=str(ROOT / "benchmarks" / "results" / "tuning_db"))
    ap.add_argument("--shape", action="append", metavar="NAME=DIMS", default=[],
                    help="bind an .onnx model's input shape, e.g. --shape input=1,3,224,224 (repeatable)")
    ap.add_argument("--rtol", type=float, default=1e-4)
    ap.add_argument("--atol", type=float, default=1e-5)
    ap.add_argument("--no-peak", action="store_true", help="skip the FMA-peak measurement (no %% of peak column)")
    ap.add_argument("--json", default=None, help=f"results file (default {RESULTS.relative_to(ROOT)}; "
                                                 "with --tune-plan: where to save the plan, none by default)")
    ap.add_argument("--markdown", action="store_true", help="print the saved results as a markdown table and exit")
    args = ap.parse_args(argv)
    if (args.tune_plan or args.tune_budget_s is not None) and args.tune_trials <= 0:
        ap.error("--tune-plan and --tune-budget-s need --tune-trials N (the target per kernel)")
    if args.json is None and not args.tune_plan:
        args.json = str(RESULTS)
    if args.markdown:
        print(render_markdown(json.loads(Path(args.json).read_text())))
        return 0
    from backends.tvm.conv_algorithms import default_algorithm
    from partitioner.commands._options import parse_shape_option

    args.shapes = parse_shape_option(args.shape)
    models = QUICK if args.quick else [m for m in args.models.split(",") if m]
    batches = [1] if args.quick else [int(b) for b in args.batches.split(",")]
    tune_report: dict[str, Any] = {}
    if args.tune_plan or args.tune_budget_s is not None:
        from backends.tvm import tuning

        target, labelled = tuning_tasks(models, batches, args)
        if args.tune_budget_s is not None:
            t_tune = time.perf_counter()
            tune_report = tuning.tune_tasks_to([t for _, t in labelled], target, args.tune_trials, args.tuning_db,
                                               budget_s=args.tune_budget_s)
            tune_report = {"budget_s": args.tune_budget_s, "spent_s": round(time.perf_counter() - t_tune, 1),
                           "stopped_by_budget": tune_report["stopped_by_budget"],
                           "kernels_tuned": len(tune_report["tuned"])}
        p = tuning.plan(labelled, target, args.tune_trials, args.tuning_db)
        print_plan(p)
        if args.tune_plan:
            if args.json:
                Path(args.json).parent.mkdir(parents=True, exist_ok=True)
                Path(args.json).write_text(json.dumps(p, indent=1) + "\n")
            return 0
        tune_report["plan"] = p
    peak = None
    if not args.no_peak:
        from backends.tvm.peak import measure_peak

        peak = measure_peak(quick=True).to_json()
    args.peak_flops = peak["fma_flops"] if peak else None
    threads = [int(t) for t in args.threads.split(",")]
    rows: list[dict[str, Any]] = []
    t0 = time.perf_counter()

    def save(complete: bool) -> dict[str, Any]:
        # written after every model, so an interrupted run still leaves what it measured
        data = {"machine": machine(), "settings": {"models": models, "batches": batches, "threads": threads,
                                                   "runs": args.runs, "blocks": args.blocks,
                                                   "zero_runs": args.zero_runs,
                                                   "tune_trials": args.tune_trials, "tune_budget_s": args.tune_budget_s,
                                                   "conv_algorithm": args.conv_algorithm,
                                                   "build_baseline": args.build_baseline,
                                                   "default_conv_algorithm": default_algorithm(),
                                                   "rtol": args.rtol, "atol": args.atol,
                                                   "model_args": {k: MODELS[k][1] for k in models if k in MODELS}},
                "peak": peak, **({"tuning": tune_report} if tune_report else {}),
                "complete": complete, "wall_s": round(time.perf_counter() - t0, 1), "rows": rows}
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(data, indent=1) + "\n")
        return data

    with tempfile.TemporaryDirectory(prefix="per-device-") as tmp:
        for key in models:
            for batch in batches:
                rows.extend(bench_model(key, batch, threads, args, Path(tmp)))
                save(complete=False)
    data = save(complete=True)
    print(render_markdown(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
