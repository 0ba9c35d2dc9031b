"""Training throughput: samples/s of the zoo mlp, resnet and bert training step on 1 rank
(1 and 2 threads) and on 2 ranks (MPI processes, 1 thread each) with data, pipeline (1F1B, 8
micro-batches) and tensor (Megatron MLP pairs) parallelism, with the ONNX Runtime or TVM
backend, the training cost model's predicted step time and peak memory per rank beside each
measured one.

Each configuration is ``partitioner train --bench`` (:func:`partitioner.training.bench.bench_training`),
run in a fresh spawned process of its own (``FRESH_PROCESS``: a 1-rank run trains in that
process, and memory is measured as its RSS growth), on seeded random data: 2 epochs of ``--steps`` steps, epoch 1 discarded (warm-up), the median
step of epoch 2; memory per rank = the training steps' peak RSS minus the RSS before the program
loads (docs/training.md). The prediction is :func:`partitioner.training.plan.predict_training`
on ``cpu:<ranks>`` with this machine's cached calibration for the backend, made first (a full
``partitioner calibrate --backend B``) when there is none or when it has no training probes
(:func:`calibration`; the figures used are recorded as ``calibration``); the 2-thread
run has no predicted time (the cost model has no intra-op thread model). A plan the model does
not admit (tensor on resnet: no MLP pair) is recorded with its reason. The predicted step holds
this machine's fixed costs (Python driver, per program call, per node, per returned byte, per
pipeline micro-batch: :mod:`partitioner.training.overheads`, cost rule 7), measured at the start
and recorded as ``overheads_us``; ``predicted_compute_step_s`` is the same prediction without
them (compute and communication only: the model before rule 7). Writes
``benchmarks/results/train_step_<model>_<backend>.json`` with the machine, the versions and the
load average before and after (``loaded`` when the 1-minute load exceeded 0.5 at either point:
another process shared the cores, and the times are not comparable). ``--quick``: small models,
4 steps, for a smoke run (marked ``quick``). Targets (issue 16): data >= 1.7x and pipeline >= 1.5x
the 1-rank 1-thread samples/s; predicted step time and peak memory within 25% of measured.

Sizes: the speed targets are about compute, so each model is sized so that one 1-rank step is
well over 50 ms of arithmetic, where what does not shrink with the batch share is a few percent:
the fixed costs (tens of microseconds per call), and the weight-sized passes (the gradient
AllReduce, the buckets' copies and the optimizer for data; the per-micro-batch gradient
accumulation for pipeline), which grow with the weights while the arithmetic grows with
weights x batch. The mlp has 4 equal 1024-wide layers (16 MiB of weights, about 26 GFLOP per
step at batch 1024), so its 2 pipeline stages split evenly and each 1F1B micro-batch is a
128-row GEMM; bert has 2 layers 256 wide over 64 tokens at batch 32 (about 20 GFLOP); the resnet
is the zoo resnet-18 on 64x64 images (45 MiB of weights) at batch 64, so that each of the 8
1F1B micro-batches has 8 images (since session 24; 16 before, which is ``--batch 16``). At 2
images a micro-batch the weight-sized passes were not a few percent: layer4's maps are 2x2, its
GEMMs 8 rows, each micro-batch re-reads every weight and accumulates 34 MiB of gradients, and the
two TVM stages, each timed alone, cost 1.56x the 1-rank step (docs/training.md, session 18), so
1F1B could not pass 1.14x whatever the schedule. With 1F1B and 8 micro-batches on 2
stages the bubble caps the pipeline at 16/9 = 1.78x. The cost model (this machine's ORT
calibration) predicts data 1.84x / 1.91x and pipeline 1.61x / 1.66x for mlp / bert; for resnet
at batch 16 data 1.76x but pipeline under 1x: its last stage holds layer4 (three quarters of the weights)
and adds 34 MiB of gradients per micro-batch. The quiet run takes about 5-8 minutes on 2 cores
(``--models`` to run fewer).

    .venv/bin/python benchmarks/train_step.py [--models mlp,resnet,bert] [--backend onnxruntime|tvm] [--steps 20]
        [--baseline partitioner.cost.training.TRAIN_WHERE_CLASS=False ...]  # also predict with a rule off
    .venv/bin/python benchmarks/train_step.py --quick       # smoke run
    .venv/bin/python benchmarks/train_step.py --markdown    # the README table from the JSON files
    .venv/bin/python benchmarks/train_step.py --repredict recorded [--baseline M.ATTR=V] [--json FILE]
        # every recorded row predicted again with its run's own calibration under today's rules (or a
        # cache folder in place of "recorded"): benchmarks/results/train_step_repredicted.json
    .venv/bin/python benchmarks/train_step.py --models bert --paired-env PARTITIONER_TRAIN_FLAT_MATMUL_WGRAD=0 \
        --configs "1 rank, 1 thread;2 ranks data (MPI)" --rounds 2 --steps 10  # a knob's before/after, paired

Other sessions' load (session 16): every configuration records ``foreign_cpu_share``, the share
of all cores that processes outside this run used while it ran (:class:`ForeignCpu`: /proc/stat's
busy time minus this process tree's CPU; build and steps together). Such load moves the 2-rank /
1-rank ratio either way (measured, paired, at niceness 0 against -20: TVM resnet data 1.46x
against 1.91x, TVM mlp pipeline 1.64x against 2.26x; docs/training.md, session 16): a 2-rank row
compared with a 1-rank row is only evidence when both ran with this share near 0. The 1-minute
load average lags by a minute and counts this run's own ranks.
``--nice N`` (root for N < 0) runs every configuration at niceness N in an autogroup of its own,
its MPI ranks too (``$PARTITIONER_RANK_NICE``, :mod:`partitioner.training.mpi_worker` rule 2):
on a shared machine the nearest to a quiet one; ``--paired-env PARTITIONER_RANK_NICE=-20`` pairs
the two (a run's sensitivity to the load).
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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "benchmarks" / "results"

CASES = {  # compute-dominated sizes (module docstring)
    "mlp": ({"batch": 1024, "layers": 4, "hidden": 1024, "in_features": 1024}, "cross_entropy"),
    "resnet": ({"batch": 64, "image": 64, "classes": 10}, "cross_entropy"),  # 16 before session 24
    "bert": ({"batch": 32, "seq": 64, "hidden": 256, "heads": 4, "layers": 2}, "mse"),
}
QUICK = {
    "mlp": ({"batch": 16, "hidden": 64, "in_features": 32}, "cross_entropy"),
    "resnet": ({"batch": 16, "image": 32, "classes": 10}, "cross_entropy"),
    "bert": ({"batch": 16, "seq": 8, "hidden": 32, "heads": 2, "layers": 2, "vocab": 50}, "mse"),
}

#: (label, ranks, strategy, threads per rank); 2-rank runs are MPI processes
CONFIGS = (("1 rank, 1 thread", 1, "single", 1), ("1 rank, 2 threads", 1, "single", 2),
           ("2 ranks data (MPI)", 2, "data", 1), ("2 ranks pipeline 1f1b x8 (MPI)", 2, "pipeline", 1),
           ("2 ranks tensor (MPI)", 2, "tensor", 1))
MICRO_BATCHES = 8


def _data(model, loss: str, n: int, path: Path) -> None:
    import numpy as np

    rng = np.random.default_rng(0)
    vi = model.graph.input[0]
    shape = [n] + [d.dim_value for d in vi.type.tensor_type.shape.dim][1:]
    x = rng.integers(0, 50, shape) if vi.type.tensor_type.elem_type == 7 else rng.standard_normal(shape)
    out = [d.dim_value for d in model.graph.output[0].type.tensor_type.shape.dim]
    y = rng.integers(0, out[-1], [n] + out[1:-1]) if loss == "cross_entropy" else rng.standard_normal([n] + out[1:])
    np.savez(path, x=x.astype(np.int64 if x.dtype.kind == "i" else np.float32),
             y=y.astype(np.int64 if loss == "cross_entropy" else np.float32))


class ForeignCpu:
    """The share of all cores that processes outside this one's tree used between ``start`` and
    ``stop``: /proc/stat's busy time (user, nice, system, irq, softirq, steal) minus the CPU of
    this process and its descendants, sampled every ``interval`` s by a thread (a descendant
    that ended counts with its last sample: one that lived under ``interval`` is missed, and so
    counted as foreign). None where /proc/stat or psutil is missing."""

    def __init__(self, interval: float = 0.2) -> None:
        import threading

        self.interval = interval
        self._first: dict[tuple[int, float], float] = {}
        self._last: dict[tuple[int, float], float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self.share: float | None = None

    @staticmethod
    def _busy_s() -> float:
        f = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        return (f[0] + f[1] + f[2] + f[5] + f[6] + (f[7] if len(f) > 7 else 0)) / os.sysconf("SC_CLK_TCK")

    def _sample(self) -> None:
        import psutil

        me = psutil.Process()
        first = not self._last  # what ran before ``start`` counts from its CPU at the start
        for p in [me, *me.children(recursive=True)]:
            try:
                t = p.cpu_times()
                key = (p.pid, p.create_time())
            except psutil.Error:
                continue
            self._first.setdefault(key, t.user + t.system if first else 0.0)
            self._last[key] = t.user + t.system

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def __enter__(self) -> "ForeignCpu":
        try:
            import psutil  # noqa: F401

            self._busy0, self._t0 = self._busy_s(), time.perf_counter()
            self._sample()
            self._thread.start()
        except (ImportError, OSError, ValueError):
            self._busy0 = None
        return self

    def __exit__(self, *exc) -> None:
        if self._busy0 is None:
            return
        self._stop.set()
        self._thread.join()
        self._sample()
        ours = sum(v - self._first.get(k, 0.0) for k, v in self._last.items())
        wall = time.perf_counter() - self._t0
        foreign = self._busy_s() - self._busy0 - ours
        self.share = round(max(0.0, foreign) / (wall * (os.cpu_count() or 1)), 3) if wall > 0 else None


def _in_own_priority() -> None:
    """``--nice`` / ``$PARTITIONER_RANK_NICE`` in a configuration's fresh process: a session (so an
    autogroup) of its own first, so that the niceness stays with this configuration."""
    from partitioner.training.mpi_worker import RANK_NICE_ENV, apply_rank_nice

    if os.environ.get(RANK_NICE_ENV, "").strip() not in ("", "0"):
        try:
            os.setsid()
        except OSError:  # already a session leader
            pass
        apply_rank_nice()


def _measure(name: str, tmp: Path, label: str, devices: int, strategy: str, threads: int, backend: str, loss: str,
             batch: int, steps: int, baseline: dict | None = None) -> dict:
    from partitioner.core.errors import UsageError
    from partitioner.training.bench import bench_training

    if FRESH_PROCESS:
        _in_own_priority()

    extra = {"schedule": "1f1b", "micro_batches": MICRO_BATCHES} if strategy == "pipeline" else {}
    try:
        doc = bench_training(str(tmp / "m.onnx"), str(tmp / "d.npz"), devices=devices, strategy=strategy,
                             batch=batch, optimizer="sgd", warmup=steps, loss=loss, lr=1e-3, epochs=2,
                             backend=backend, threads=threads, progress=False,
                             out_dir=str(tmp / label.replace(" ", "_").replace(",", "")),
                             baseline=baseline if threads == 1 else None, **extra)
    except UsageError as exc:
        print(f"{name:<8} {backend:<12} {label:<32} not applicable: {exc}", flush=True)
        return {"not_applicable": str(exc)}
    st = doc["step_time_s"]
    if threads != 1:  # no intra-op thread model: no prediction
        st = {"measured": st["measured"]}
    mem = doc["memory_per_rank"]
    print(f"{name:<8} {backend:<12} {label:<32} {batch / st['measured']:10.1f} samples/s  measured "
          f"{st['measured'] * 1e3:8.2f} ms" + (f"  predicted {st['predicted'] * 1e3:8.2f} ms" if "predicted" in st
                                               else "")
          + f"  memory MiB/rank measured {max(m['measured'] for m in mem) / 2**20:.1f} predicted "
          f"{max(m['predicted'] for m in mem) / 2**20:.1f}", flush=True)
    fixed = doc["predicted_breakdown_s"].get("fixed_s", 0.0)
    return {"median_step_s": st["measured"], "samples_per_s": batch / st["measured"], "steps": doc["steps_timed"],
            "predicted_step_s": st.get("predicted"),
            "predicted_compute_step_s": st["predicted"] - fixed if "predicted" in st else None,
            "predicted_breakdown_s": doc["predicted_breakdown_s"], "overheads_us": doc.get("overheads_us"),
            "median_step_cpu_s": doc.get("step_cpu_s"),
            **({"baseline": doc["baseline"], "predicted_baseline_step_s": doc["baseline_step_time_s"]["predicted"]}
               if "baseline" in doc else {}),
            "predicted_memory_per_rank": [m["predicted"] for m in mem],
            "measured_memory_per_rank": [m["measured"] for m in mem]}


def case(name: str, quick: bool, batch: int | None = None) -> tuple[dict, str]:
    """The model's builder arguments and loss (``QUICK`` or ``CASES``), its batch replaced by
    ``batch`` when given (``--batch``)."""
    kwargs, loss = (QUICK if quick else CASES)[name]
    return ({**kwargs, "batch": batch} if batch else dict(kwargs)), loss


def run_case(name: str, backend: str, steps: int, quick: bool, baseline: dict | None = None,
             batch: int | None = None) -> dict:
    import onnx

    import models_zoo

    kwargs, loss = case(name, quick, batch)
    batch = kwargs["batch"]
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model = models_zoo.build(name, **kwargs)
        onnx.save(model, str(tmp / "m.onnx"))
        _data(model, loss, batch * steps, tmp / "d.npz")
        for label, devices, strategy, threads in CONFIGS:
            args = (name, tmp, label, devices, strategy, threads, backend, loss, batch, steps, baseline)
            with ForeignCpu() as foreign:
                results[label] = _in_fresh_process(_measure, args) if FRESH_PROCESS else _measure(*args)
            results[label]["foreign_cpu_share"] = foreign.share
            print(f"{name:<8} {backend:<12} {label:<32} other processes used {foreign.share} of the cores", flush=True)
    return results


def run_paired(name: str, backend: str, steps: int, env: str, labels: list[str], rounds: int,
               batch: int | None = None) -> list[dict]:
    """A knob's before/after measured in one run (``--paired-env NAME=VALUE``): every configuration
    of ``labels`` runs with the environment as it is (``setting`` "default") and with ``NAME=VALUE``
    ("env"), each in a fresh process (the environment reaches its MPI ranks), the order alternating
    per round so that neither side always runs first on a machine whose load drifts. A knob read
    at import (``os.environ.get`` in a module constant) is what this pairs."""
    import onnx

    import models_zoo

    pairs = [e.partition("=") for e in env.split(",")]  # NAME=VALUE[,NAME=VALUE...]: set together
    if not pairs or any(not k or not v for k, _, v in pairs):
        raise SystemExit(f"--paired-env {env!r}: expected NAME=VALUE[,NAME=VALUE...]")
    kwargs, loss = case(name, False, batch)  # ``batch``: --batch, else the model's default
    batch, old = kwargs["batch"], {k: os.environ.get(k) for k, _, _ in pairs}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model = models_zoo.build(name, **kwargs)
        onnx.save(model, str(tmp / "m.onnx"))
        _data(model, loss, batch * steps, tmp / "d.npz")
        try:
            for r in range(rounds):
                for label, devices, strategy, threads in (c for c in CONFIGS if c[0] in labels):
                    for setting in (("default", "env") if r % 2 == 0 else ("env", "default")):
                        for k, _, v in pairs:
                            _set_env(k, v if setting == "env" else old[k])
                        args = (name, tmp, label, devices, strategy, threads, backend, loss, batch, steps, None)
                        load = _load()
                        with ForeignCpu() as foreign:
                            got = _in_fresh_process(_measure, args)
                        rows.append({"round": r, "setting": setting, "label": label, "load": load, **got,
                                     "foreign_cpu_share": foreign.share})
        finally:
            for k, _, _ in pairs:
                _set_env(k, old[k])
    return rows


def _set_env(key: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(key, None)
    else:
        os.environ[key] = value


#: each configuration runs in a process of its own (spawned): a 1-rank run trains in the process
#: that runs it, and one that followed another in the same process started from a heap and a
#: backend memory pool the earlier run had grown, so its steps' peak RSS barely rose above the
#: window's start (TVM, 1 rank 2 threads after 1 thread: 22 / 44 / 92 MiB measured for bert / mlp
#: / resnet against 166 / 114 / 309 MiB at 1 thread). Off: every configuration in this process.
FRESH_PROCESS = True


def _in_fresh_process(fn, args: tuple) -> dict:
    """``fn(*args)`` in a new spawned Python process (nothing inherited from this one's heap)."""
    import multiprocessing

    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(fn, args)


def calibration(backend: str) -> dict:
    """The cached calibration the predictions use (``cpu:<ranks>`` reads it), made first when
    there is none or when it predates the training probes (no ``gemm_backward`` /
    ``conv_backward``: the backward would run at the forward classes' rates, cost rule 1) or
    lacks one of today's probes (the conv weight gradient's GEMM form, the out-of-cache GEMM, say, or
    probe 7's in-cache co-run copy, session 27): a full ``partitioner calibrate --backend B`` (about
    a minute). Returns the figures the JSON records."""
    from partitioner.calibrate import calibrate_and_cache
    from partitioner.calibrate_cache import cache_path, load_cached
    from partitioner.cluster import BACKWARD_CLASSES

    from partitioner.calibrate import micro_kernels

    doc = load_cached(backend)
    classes = (((doc or {}).get("cluster") or {}).get("devices") or [{}])[0].get("efficiency_by_class") or {}
    probed = {k.get("kernel") for k in ((doc or {}).get("calibration") or {}).get("kernels") or []}
    co_run_old = "co_run_cached_rounds" not in ((doc or {}).get("calibration") or {})
    if doc is None or any(c not in classes for c in BACKWARD_CLASSES) or co_run_old or \
            any(k.name not in probed for k in micro_kernels(quick=False)):
        print(f"calibrating the {backend} backend (training probes included) into {cache_path(backend)} ...",
              flush=True)
        try:
            calibrate_and_cache(backend, quick=False)
        except Exception as exc:  # noqa: BLE001 - the table is still worth having, with this said
            print(f"calibration failed ({type(exc).__name__}: {exc}); predicting with the figures there are",
                  flush=True)
            return {"file": str(cache_path(backend)), "error": f"{type(exc).__name__}: {exc}"}
        doc = load_cached(backend) or {}
    dev = ((doc.get("cluster") or {}).get("devices") or [{}])[0]
    cal = doc.get("calibration") or {}
    return {"file": str(cache_path(backend)), "efficiency_by_class": dev.get("efficiency_by_class"),
            "peak_flops": dev.get("peak_flops"), "memory_bandwidth": dev.get("memory_bandwidth"),
            "co_run_bandwidth": dev.get("co_run_bandwidth", 1.0),
            "co_run_cached_bandwidth": dev.get("co_run_cached_bandwidth", 0.0), "seconds": cal.get("seconds")}


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else []


def _row(doc: dict, label: str, r: dict, base: float | None, run: str) -> str:
    """One table row (a configuration of one JSON file)."""
    batch, default = (doc.get("config") or {}).get("batch"), CASES.get(doc["model"], ({}, ""))[0].get("batch")
    model = doc["model"] if doc.get("quick") or batch in (None, default) else f"{doc['model']} (batch {batch})"
    head = f"| {model} | {doc['backend']} | {label} |"
    if "not_applicable" in r:
        return head + " - | - | - | - | - | - | - | - | - | - | not applicable |"
    pred, meas = r.get("predicted_step_s"), r["median_step_s"]
    bare = r.get("predicted_compute_step_s")  # the prediction without cost rule 7's fixed costs
    mm, pm = r.get("measured_memory_per_rank") or [], r.get("predicted_memory_per_rank") or []
    cpu = r.get("median_step_cpu_s")
    cells = [f"{r['samples_per_s']:.1f}", f"{r['samples_per_s'] / base:.2f}x" if base else "-", f"{meas * 1e3:.2f}",
             f"{cpu * 1e3:.1f}" if cpu else "-", f"{pred * 1e3:.2f}" if pred else "-", f"{pred / meas - 1:+.0%}" if pred else "-",
             f"{bare / meas - 1:+.0%}" if bare else "-",
             " / ".join(f"{m / 2**20:.0f}" for m in mm) or "-", " / ".join(f"{m / 2**20:.0f}" for m in pm) or "-",
             f"{max(pm) / max(mm) - 1:+.0%}" if mm and pm and max(mm) > 0 else "-", run]
    return head + "".join(f" {c} |" for c in cells)


def _table_files(results_dir: Path) -> list[Path]:
    """The full runs' JSON files (``--paired-env`` runs write ``*_paired.json``: another table;
    ``--repredict`` writes ``train_step_repredicted*.json``: records, not a run)."""
    return [p for p in sorted(results_dir.glob("train_step_*.json"))
            if not p.stem.endswith("_paired") and not p.stem.startswith("train_step_repredicted")]


def paired_markdown(results_dir: Path = RESULTS) -> str:
    """The ``--paired-env`` runs' table: per configuration, the median step of the default
    setting and of the environment's, over the interleaved rounds, and their ratio."""
    rows = ["| model | backend | setting compared | configuration | rounds | default step ms (median) | "
            "with the setting ms (median) | default / with it | load avg |",
            "|---|---|---|---|---|---|---|---|---|"]
    for path in sorted(results_dir.glob("train_step_*_paired.json")):
        doc = json.loads(path.read_text())
        labels = list(dict.fromkeys(r["label"] for r in doc["rows"]))
        for label in labels:
            got = {k: [r for r in doc["rows"] if r["label"] == label and r["setting"] == k] for k in ("default", "env")}
            if not got["default"] or not got["env"]:
                continue
            med = {k: statistics.median(r["median_step_s"] for r in v) for k, v in got.items()}
            loads = [r["load"][0] for v in got.values() for r in v if r.get("load")]
            load = f"{min(loads):.1f}-{max(loads):.1f}" if loads else "-"
            rows.append(f"| {doc['model']} | {doc['backend']} | `{doc['env']}` | {label} | {len(got['default'])} | "
                        f"{med['default'] * 1e3:.1f} | {med['env'] * 1e3:.1f} | {med['default'] / med['env']:.2f} | "
                        f"{load} |")
    return "\n".join(rows)


def markdown(results_dir: Path = RESULTS) -> str:
    """The README table: one row per (model, backend, configuration) of every JSON file.
    ``step CPU ms (rank 0)``: rank 0's process CPU seconds per step (bench rule 6): on a loaded
    machine the wall time holds other processes' time slices, the CPU time much less so (a
    1-rank 1-thread step's CPU time is its compute; an MPI rank's also counts its busy waits)."""
    rows = ["| model | backend | configuration | samples/s | vs 1 rank, 1 thread | step ms | step CPU ms (rank 0) | "
            "predicted ms | time error | time error without fixed costs | peak MiB/rank (measured) | "
            "predicted MiB/rank | memory error | run (load avg before, after) |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for path in _table_files(results_dir):
        doc = json.loads(path.read_text())
        loads = [x[0] for x in doc.get("load_average_before_after") or [] if x]
        run = ("quick, " if doc.get("quick") else "") + ("loaded" if doc.get("loaded") else "quiet") + \
            (f" ({', '.join(f'{x:.1f}' for x in loads)})" if loads else " (load not recorded)")
        base = (doc["results"].get("1 rank, 1 thread") or {}).get("samples_per_s")
        rows += [_row(doc, label, r, base, run) for label, r in doc["results"].items()]
    return "\n".join(rows)


_ACTIVE: dict = {}  # the --baseline settings a repredict runs under (recorded with its figures)
#: ``--repredict recorded``: each file's own calibration (the figures its run recorded), not a cache
RECORDED = "recorded"


def recorded_cache(results_dir: Path, out: Path) -> Path:
    """A calibration cache under ``out`` that holds, per backend, the figures the JSON files of
    ``results_dir`` recorded (``calibration``: the device's ``efficiency_by_class``,
    ``peak_flops`` and ``memory_bandwidth``) in this machine's cached cluster for that backend
    (its link and the rest as cached), and this machine's measured pipeline cuts: the rows
    predicted again as their run predicted them (the same figures), under today's rules."""
    from partitioner.calibrate_cache import cache_dir, cache_path, load_cached

    (out / "calibration").mkdir(parents=True, exist_ok=True)
    cuts = cache_dir() / "measured_cut"
    if cuts.is_dir() and not (out / "measured_cut").exists():
        (out / "measured_cut").symlink_to(cuts)
    for path in _table_files(results_dir):
        doc = json.loads(path.read_text())
        cal, cached = doc.get("calibration") or {}, load_cached(doc["backend"])
        if cached is None or not cal.get("efficiency_by_class"):
            raise SystemExit(f"--repredict {RECORDED}: {path.name} has no recorded calibration or this machine no "
                             f"cached {doc['backend']} calibration to hold it")
        for dev in cached["cluster"]["devices"]:
            dev.update({k: cal[k] for k in ("efficiency_by_class", "peak_flops", "memory_bandwidth")})
        (out / "calibration" / cache_path(doc["backend"]).name).write_text(json.dumps(cached))
    return out


def repredict(results_dir: Path, cache: Path, settings: dict | None = None) -> list[dict]:
    """Each measured row of ``results_dir``'s JSON files predicted again with the calibration
    cache under ``cache`` (``$PARTITIONER_CACHE_DIR``), the row's recorded fixed costs and the
    ``--baseline`` settings if any: a calibration's or a rule's before/after against the same
    measured steps. Returns one record per row (the measured files are left as they are):
    measured wall and CPU seconds, the run's own prediction and this one, and their errors."""
    from partitioner.training.bench import _with_settings

    if settings:
        _ACTIVE.update(settings)
        try:
            module_settings = {k: v for k, v in settings.items() if k != "no_fixed"}
            return _with_settings(module_settings, lambda: repredict(results_dir, cache))
        finally:
            _ACTIVE.clear()
    import onnx

    import models_zoo
    from partitioner.cluster import resolve_cluster
    from partitioner.cost.training import StepOverheads
    from partitioner.training.buckets import LIST_ALLREDUCE
    from partitioner.training.plan import predict_training

    os.environ["PARTITIONER_CACHE_DIR"] = str(cache)
    rows = []
    for path in _table_files(results_dir):
        doc = json.loads(path.read_text())
        model = models_zoo.build(doc["model"], **doc["config"])
        for label, devices, strategy, threads in CONFIGS:
            r = doc["results"].get(label) or {}
            if not r.get("predicted_step_s") or threads != 1:
                continue
            fixed = None if _ACTIVE.get("no_fixed") else \
                StepOverheads(**{k: (v if k == "backend" else v * 1e-6) for k, v in r["overheads_us"].items()})
            extra = {"schedule": "1f1b", "micro_batches": MICRO_BATCHES} if strategy == "pipeline" else {}
            pred = predict_training(onnx.load_from_string(model.SerializeToString()), "single" if devices == 1 else strategy,
                                    devices, batch=doc["config"]["batch"], loss=doc["loss"], overheads=fixed,
                                    overlap=doc["backend"] == "onnxruntime" or LIST_ALLREDUCE,
                                    cluster=resolve_cluster(f"cpu:{devices}", doc["backend"]), **extra)
            measured = r["median_step_s"]
            rows.append({"model": doc["model"], "backend": doc["backend"], "configuration": label,
                         "measured_step_s": measured, "median_step_cpu_s": r.get("median_step_cpu_s"),
                         "predicted_step_s": r["predicted_step_s"], "repredicted_step_s": pred.step_time_s,
                         "error": r["predicted_step_s"] / measured - 1, "repredicted_error": pred.step_time_s / measured - 1,
                         "measured_memory_per_rank": r.get("measured_memory_per_rank"),
                         "predicted_memory_per_rank": r.get("predicted_memory_per_rank"),
                         "repredicted_memory_per_rank": pred.memory_per_rank})
    return rows


def repredict_main(args) -> int:
    """``--repredict``: prints one line per row and writes the records (:func:`repredict`) with the
    cache and settings to ``--json`` (default ``<results-dir>/train_step_repredicted.json``)."""
    settings = {**(_settings(args.baseline) or {}), **({"no_fixed": True} if args.no_fixed else {})}
    cache = args.repredict
    with tempfile.TemporaryDirectory(prefix="train-step-recorded-") as tmp:
        if str(cache) == RECORDED:
            cache = recorded_cache(args.results_dir, Path(tmp))
        rows = repredict(args.results_dir, cache, settings or None)
    for r in rows:
        cpu = r["median_step_cpu_s"]
        print(f"{r['model']} {r['backend']} {r['configuration']}: measured {r['measured_step_s'] * 1e3:.1f} ms (CPU "
              f"{cpu * 1e3 if cpu else float('nan'):.1f}), predicted {r['predicted_step_s'] * 1e3:.1f} "
              f"({r['error']:+.1%}), repredicted {r['repredicted_step_s'] * 1e3:.1f} ({r['repredicted_error']:+.1%})")
    within = [sum(abs(r[k]) <= 0.25 for r in rows) for k in ("error", "repredicted_error")]
    print(f"within 25%: {within[0]} of {len(rows)} recorded, {within[1]} of {len(rows)} repredicted")
    out = args.json or args.results_dir / "train_step_repredicted.json"
    out.write_text(json.dumps({"cache": str(args.repredict), "settings": {k: repr(v) for k, v in settings.items()},
                               "load_average": _load(), "rows": rows}, indent=2) + "\n")
    return 0


def _settings(items: list[str]) -> dict | None:
    """``--baseline`` items as {"module.ATTR": value} (values as Python literals)."""
    import ast

    out = {}
    for item in items:
        key, _, value = item.partition("=")
        if "." not in key or not value:
            raise SystemExit(f"--baseline {item!r}: expected MODULE.ATTR=VALUE")
        out[key] = ast.literal_eval(value)
    return out or None


def paired_main(args) -> int:
    """``--paired-env``: :func:`run_paired` per model; prints each row, writes the JSON."""
    args.results_dir.mkdir(parents=True, exist_ok=True)
    for name in args.models.split(","):
        rows = run_paired(name, args.backend, args.steps, args.paired_env, args.configs.split(";"), args.rounds,
                          args.batch)
        for r in rows:
            cpu = r.get("median_step_cpu_s")
            print(f"{name} {r['label']:<32} {r['setting']:<8} round {r['round']}  wall "
                  f"{r.get('median_step_s', float('nan')) * 1e3:8.2f} ms  CPU "
                  f"{(cpu or float('nan')) * 1e3:8.2f} ms  load {r['load'][:1]}  foreign CPU "
                  f"{r.get('foreign_cpu_share')}")
        doc = {"model": name, "backend": args.backend, "env": args.paired_env, "steps": args.steps, "rows": rows,
               "batch": case(name, False, args.batch)[0]["batch"]}
        (args.results_dir / f"train_step_{name}_{args.backend}_paired.json").write_text(json.dumps(doc, indent=2) + "\n")
    return 0


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--models", default="mlp,resnet,bert")
    p.add_argument("--backend", default="onnxruntime", choices=("onnxruntime", "tvm"))
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--quick", action="store_true", help="small models, 4 steps: a smoke run")
    p.add_argument("--batch", type=int, default=None,
                   help="every model's global batch instead of its default (e.g. resnet at 64: 8 images per "
                        "pipeline micro-batch); use with --results-dir so the default rows are kept")
    p.add_argument("--markdown", action="store_true", help="print the README table from the JSON files and exit")
    p.add_argument("--results-dir", type=Path, default=RESULTS,
                   help="where the JSON files go (default benchmarks/results; another folder for a trial run)")
    p.add_argument("--baseline", action="append", default=[], metavar="MODULE.ATTR=VALUE",
                   help="also predict each row with this setting (a cost rule's constant; repeatable, all "
                        "applied together): the rule's before/after on the same calibration and run")
    p.add_argument("--repredict", type=Path, default=None, metavar="CACHE_DIR",
                   help="predict the rows of --results-dir again with the calibration cache under CACHE_DIR "
                        "(another calibration against the same measured steps; with --baseline settings), or "
                        f"'{RECORDED}': with each file's recorded calibration; writes --json and exits")
    p.add_argument("--json", type=Path, default=None, metavar="FILE",
                   help="with --repredict: where the records go (default <results-dir>/train_step_repredicted.json)")
    p.add_argument("--no-fixed", action="store_true",
                   help="with --repredict: compute and communication only (no fixed costs: those recorded on a "
                        "loaded run are inflated by it), to compare with the rows' CPU time")
    p.add_argument("--paired-env", default=None, metavar="NAME=VALUE[,NAME=VALUE...]",
                   help="measure each configuration with and without this environment setting (a knob read "
                        "at import), interleaved over --rounds; writes train_step_<model>_<backend>_paired.json")
    p.add_argument("--paired", action="store_true",
                   help="with --markdown: the --paired-env runs' table (train_step_*_paired.json)")
    p.add_argument("--configs", default=";".join(c[0] for c in CONFIGS),
                   help="with --paired-env: the configuration labels to run, separated by ';'")
    p.add_argument("--rounds", type=int, default=2, help="with --paired-env: rounds (order alternates)")
    p.add_argument("--nice", type=int, default=None, metavar="N",
                   help="every configuration (and its MPI ranks) at niceness N in an autogroup of its own "
                        "(root for N < 0): the nearest to a quiet machine a shared one gives")
    args = p.parse_args()
    if args.nice is not None:
        if not -20 <= args.nice <= 19:
            p.error(f"--nice {args.nice}: expected a niceness in -20..19")
        os.environ["PARTITIONER_RANK_NICE"] = str(args.nice)  # mpi_worker rule 2; _in_own_priority
    if args.batch is not None and (args.batch < 1 or args.quick):
        p.error("--batch takes a positive batch, and not with --quick")
    if args.paired_env is not None:
        return paired_main(args)
    if args.repredict is not None:
        return repredict_main(args)
    if args.markdown:
        print(paired_markdown(args.results_dir) if args.paired else markdown(args.results_dir))
        return 0
    import onnxruntime
    import tvm

    steps = 4 if args.quick else args.steps
    args.results_dir.mkdir(parents=True, exist_ok=True)
    cal = calibration(args.backend)
    for name in args.models.split(","):
        before = _load()
        results = run_case(name, args.backend, steps, args.quick, _settings(args.baseline), args.batch)
        after = _load()
        config, loss = case(name, args.quick, args.batch)
        doc = {"model": name, "backend": args.backend, "config": config,
               "loss": loss, "quick": args.quick, "steps": steps,
               "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                           "python": platform.python_version()},
               "versions": {"onnxruntime": onnxruntime.__version__, "tvm": tvm.__version__},
               "load_average_before_after": [before[:1], after[:1]],
               **({"nice": args.nice} if args.nice is not None else {}),
               "loaded": any(x[0] > 0.5 for x in (before, after) if x),
               "calibration": cal,
               "results": results,
               "note": ("threads = the backend's intra-op threads per rank; MPI ranks are pinned to half the cores "
                        "each; pipeline = 1F1B with 8 micro-batches; predicted = training cost model on cpu:<ranks>; "
                        "memory = training steps' peak RSS minus the RSS before the program loads")}
        (args.results_dir / f"train_step_{name}_{args.backend}.json").write_text(json.dumps(doc, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
