"""Threads that pay: which kernels run on TVM's thread pool and which stay on one thread.

Rule: a kernel's outer loop is parallel only when its work covers the pool's fork/join cost,
``flops >= parallel_min_flops()``. With ``T`` threads a kernel of ``W`` FLOPs at a per-core
rate ``R`` takes ``W/R`` on one thread and ``W/(T*R) + F`` on ``T`` (``F`` = fork/join); it pays
only when ``W > F * R * T/(T-1)`` (``2FR`` on 2 threads). The threshold is
``FORK_JOIN_MARGIN x 2 x F x R`` with ``R`` the measured FMA peak: a margin for imperfect
scaling (shared L2/L3 bandwidth, uneven tiles) and for kernels that reach their rate only on
long runs. On the development machine (Zen 4 under KVM, 2 cores) ``F`` ~ 3-10 us and ``R`` ~
118 GFLOP/s give 1.4-5 MFLOP; the default, :data:`DEFAULT_PARALLEL_MIN_FLOPS` = 2e6, is that
range's low end (measured earlier on GEMMs: below ~2 MFLOP the 2-thread run was slower).

Kernels that run well below the FMA peak on one thread pass ``peak_fraction`` to
:func:`worth_parallel` (the threshold is about time, so their FLOP threshold shrinks by that
share): the depthwise rule does (``depthwise.PARALLEL_PEAK_FRACTION``, 0.4), and so does a
contraction whose vectors are narrower than the machine's (:func:`lane_share`).

Narrow-vector contractions (:data:`NARROW_VECTOR_SHARE`, :func:`lane_share`). A contraction
(``schedules/contraction.py``) whose vector axis (a conv's output channels, a GEMM's columns) is
vectorised ``V`` lanes wide on a machine of ``L`` lanes (AVX-512 float32: 16) issues FMAs that
each do ``V`` of ``L`` lanes' work, so it runs at most ``V/L`` of the FMA peak the threshold is
sized for: its time is at least ``flops / (R x V/L)``, and the threshold on its FLOPs shrinks by
``V/L`` (a bound, not an estimate: such a kernel can only be slower). Shapes it is for: 1x1
convolution heads with fewer output channels than lanes over a full-resolution map (the U-Net
of ``benchmarks/heldout_models.py`` at batch 1: 16 -> 3 channels on 64x64, padded to 8 lanes, a
fused sigmoid, 1.05 MFLOP counted on the padded channels, 33-40 us on one thread at ~0.25 of the
peak, and ONNX Runtime runs that node on both threads), and convs or GEMMs of 4-12 (or 20-28,
...) channels generally. Kernels with full-width vectors (``V = L``), scalar ones (``V = 1``:
not vectorised on that axis, left as they were) and builds for one thread do not change.

Where the number comes from, first match wins:

1. ``PARTITIONER_PARALLEL_MIN_FLOPS`` in the environment (a float): for experiments;
2. :func:`set_parallel_min_flops` (``backends.tvm.peak.measure_fork_join`` +
   :func:`threshold_from` give the machine's own value);
3. this machine's calibration (``partitioner calibrate``, which stores ``Peak.parallel_min_flops``
   in the TVM calibration cache, ``partitioner/calibrate_cache.py``; read once per process): the
   threshold from the machine's measured fork/join, on every build of that machine, compile
   workers included. Measured on Zen 5 (session 29, 2 threads, batch 1, paired builds, 9-11
   blocks): the calibrated 0.94 MFLOP against the default 2 MFLOP ran heldout_vit 1.31-1.38x and
   heldout_mbv2 1.17-1.21x faster (their 0.5-2 MFLOP GEMMs and 1x1 convs go to the pool), and
   resnet18, resnet50, mobilenet, bert, gpt, inception and unet within 0.95-1.04x (noise); 0.72
   MFLOP (the hot fork/join) gave the same but resnet50 0.95x, hence the idle one (``peak.py``);
4. :data:`DEFAULT_PARALLEL_MIN_FLOPS` (no calibration).

Epilogue work (:data:`COUNT_EPILOGUE_OPS`, :func:`epilogue_ops`, :func:`with_epilogue`). The
FLOP count of a contraction is its multiply-adds; what is fused after them (bias, ReLU, a fast
``sigmoid``/``tanh``/``erf`` polynomial of ~20-30 distinct operations) runs once per output
element and takes time too. The kernel's work as the threshold sees it is its FLOPs plus
:data:`EPILOGUE_FLOPS_PER_OP` (2: one vector operation per lane takes about one FMA slot, 2
FLOPs) x the distinct arithmetic operations of its epilogue x its output elements (with N
padded: the vector computes the padding lanes too). Shapes it is for: small-K GEMMs and 1x1
convolutions with a transcendental epilogue, where the epilogue is as large as the product: the
U-Net head of ``benchmarks/heldout_models.py`` at batch 1 (1x1 conv 16 -> 3 channels, padded to
8, on 64x64, fused bias + sigmoid: 1.05 MFLOP of FMAs, 33-40 us on one thread, 0.26 of the FMA
peak, serial under the 2 MFLOP threshold; ONNX Runtime runs that node on both threads) counts
~3 MFLOP and goes to the pool. A bias + ReLU (3 operations: 6 FLOPs per element) moves only
products whose K is below ~10; kernels with K in the hundreds (every zoo GEMM) do not change.
Used by ``gemm_packed`` (where such heads land, N padded); the direct-convolution rule keeps
FLOPs alone. Zoo and held-out kernels it moves to the pool (2-thread builds, scheduling audit
with the knob on and off): heldout_unet b1's head, and heldout_mbv2 b1's two 1x1 expansions 16 ->
96 on 24x24 with a folded BN + ReLU6 (1.77 MFLOP + 3 ops x 55K elements); none in heldout_unet
b8, heldout_mbv2 b8, heldout_vit b1/b8, heldout_inception b1, bert b1/b8, gpt b1, mobilenet b1,
resnet18 b1, resnet50 b1 (other rows not audited). Measured
(``kernel_profile.py --scaling --baseline ...threads.COUNT_EPILOGUE_OPS=False``, 30 interleaved
rounds, each call's minimum, run under ``nice -20`` in its own autogroup at load ~15,
docs/per_device_speed.md, "heldout_unet at batch 1 on 2 threads (session 14)"): the U-Net head
30.5 -> 17.8 us on 2 threads (1 thread 29.6 / 30.2 us), the mbv2 expansions 19.1 / 19.0 -> 14.7 /
13.7 us.

Builds for one thread (:data:`SERIAL_WHEN_ONE_THREAD`). A build that knows it will run on one
thread (:func:`building_for`, set around the TVM build from the artifact's threads per rank:
each data-parallel rank on its own core, the 1-thread rows of ``benchmarks/per_device.py``)
emits no parallel loop at all: :func:`worth_parallel` and :func:`parallel_elements` answer False.
Why: TVM lowers a parallel loop into a closure called through ``TVMBackendParallelLaunch``, whose
buffer pointers lose their no-alias facts and whose accumulators come from a workspace
allocation, so such a kernel is slower even when the pool has a single thread (measured,
session 11, mobilenet batch 8 on one thread, thread CPU time: 1x1 convs 12.53 ms with parallel
loops against 11.00 ms all serial, depthwise 3.20 against 2.77; ``backends.tvm.parallel_scope``
now puts the accumulators on the stack, and the serial build is still 0.92x of the parallel one:
docs/per_device_speed.md, session 12). Shapes it is for: every kernel
of a 1-thread build, whatever its size. A build whose thread count is unknown (None: a plain
``partitioner compile`` for a cluster that is not one node's CPU cores, ``backends.tvm.build``
without ``options["threads"]``) keeps the thresholds above, as before.

Memory-bound kernels (elementwise, pads, transposes) use :data:`PARALLEL_MIN_ELEMENTS` instead,
in the same spirit: ~16K float32 elements is ~64 KiB, a few microseconds of copying.

The pool's idle spin (:data:`POOL_SPIN_COUNT`). After each parallel loop TVM's workers busy-wait
for the next task, ``TVM_THREAD_POOL_SPIN_COUNT`` ``sched_yield`` calls (TVM's default: 300000),
before they sleep. Measured on the development machine (2 cores, shared): with the default a
worker burnt ~100 ms of CPU in the 0.3 s after one parallel call, and a parallel call made 1 ms
after the previous one took ~4 ms instead of ~4 us: a worker that has spun through its CPU share
waits a scheduler slice for the core when work arrives. Any other thread pool in the process
(ONNX Runtime's, numpy's OpenBLAS) or another rank on the core pays for that spin too. This is
what made the 2-thread GEMM rows of ``benchmarks/gemm.py`` ms-slow on small shapes for every
library (TVM, ORT and OpenBLAS each spinning into the next one's timed block), not the fork/join
itself, which stays ~2-3 us hot and ~5-10 us from sleep. :data:`POOL_SPIN_COUNT` = 10000 yields
(~5 ms of spinning here) still covers the gaps between the kernels of one model run (hot fork/join
unchanged, 3 us) and leaves the core when the run is over;
``backends.tvm.executable.configure_threads`` sets it unless the user set
``TVM_THREAD_POOL_SPIN_COUNT``. The trade-off: on a heavily oversubscribed machine (load ~115 on
2 cores) the main thread is preempted for longer than the bounded spin, the workers sleep, and
the next fork waits for a wake-up slice (hot probe: ~2 ms in 2 of 3 runs, against 3 us with
TVM's default, which instead burns the core meanwhile). Not measured yet on a quiet machine
(the case the default is for): ``benchmarks/gemm.py --threads 1,2`` there, with and without
``TVM_THREAD_POOL_SPIN_COUNT=300000``, decides the value. Session 8, three alternating pairs of
processes at load ~4.4: no consistent difference between the two.

What this rule cannot change: the pool's split is static (``TVMBackendParallelLaunch`` hands
chunk i of a parallel loop to worker i), so when another process holds the second core the
calling thread waits for the worker's chunk, and a 2-thread kernel takes its 1-thread time (both
chunks on one core) instead of half of it; ONNX Runtime's calling thread instead runs the work
items no worker has claimed. When both cores are free the zoo's GEMMs scale 84-103% per core
(docs/gemm.md, "2 threads (session 8)": 10th percentile of single calls, load ~3.6), and whole
models (resnet18 at batch 1 and 8, bert, gpt) 78-89% summed per kernel; nothing here depends on
the batch. Worse, the calling thread waits for the workers' chunks by calling ``sched_yield`` in
a loop: when the worker shares its core, or another process is runnable there, every parallel
kernel hands the core away (gpt at batch 1 on 2 threads: 3.7-68 ms a run at load ~8 against
~1 ms on 1 thread). ``backends.tvm.contention`` (the contention guard) drops such a run's pool to
1 thread for a while; docs/per_device_speed.md, "Time outside the kernels (session 9)".
"""

from __future__ import annotations

import contextlib
import functools
import os
from typing import Any, Iterator

DEFAULT_PARALLEL_MIN_FLOPS = 2e6
FORK_JOIN_MARGIN = 2.0
PARALLEL_MIN_ELEMENTS = 16384
ENV = "PARTITIONER_PARALLEL_MIN_FLOPS"
POOL_SPIN_COUNT = 10000
SPIN_ENV = "TVM_THREAD_POOL_SPIN_COUNT"
#: a build for one thread emits no parallel loop (module docstring, "Builds for one thread");
#: False: the FLOP/element thresholds alone decide, whatever the build's thread count
SERIAL_WHEN_ONE_THREAD = True
#: count a contraction's fused epilogue in its work (module docstring, "Epilogue work"); False:
#: multiply-adds alone, as before
COUNT_EPILOGUE_OPS = True
EPILOGUE_FLOPS_PER_OP = 2.0
#: a contraction vectorised narrower than the machine's vectors scales its FLOP threshold by its
#: lane share (module docstring, "Narrow-vector contractions"); False: share 1.0, as before
NARROW_VECTOR_SHARE = True

_configured: float | None = None
_build_threads: int | None = None


def build_threads() -> int | None:
    """The thread count the kernels being built will run on (None: unknown, see :func:`building_for`)."""
    return _build_threads


@contextlib.contextmanager
def building_for(threads: int | None) -> Iterator[None]:
    """Schedule the kernels built inside this block for ``threads`` threads (None: unknown, the
    thresholds decide as before). Module state, not thread-local: a process builds one program
    at a time (``backends.tvm.build`` runs each rank's build on one thread, or in its own
    compile-worker process)."""
    global _build_threads
    saved = _build_threads
    _build_threads = None if threads is None else max(1, int(threads))
    try:
        yield
    finally:
        _build_threads = saved


def _serial_build() -> bool:
    return SERIAL_WHEN_ONE_THREAD and _build_threads == 1


def threshold_from(fork_join_s: float, flops_per_s: float) -> float:
    """FLOPs a kernel needs before a 2-thread run beats one thread, with the module's margin."""
    return FORK_JOIN_MARGIN * 2.0 * fork_join_s * flops_per_s


def set_parallel_min_flops(value: float | None) -> None:
    """Use ``value`` for the rest of the process (None: back to the default)."""
    global _configured
    _configured = None if value is None else float(value)


def parallel_min_flops() -> float:
    """The threshold in force (module docstring: environment, configured, calibrated, default)."""
    return parallel_min_flops_and_source()[0]


def parallel_min_flops_and_source() -> tuple[float, str]:
    """The threshold and where it came from: ``environment``, ``configured``, ``calibration``, ``default``."""
    env = os.environ.get(ENV)
    if env:
        try:
            return float(env), "environment"
        except ValueError:
            pass
    if _configured is not None:
        return _configured, "configured"
    calibrated = calibrated_parallel_min_flops()
    if calibrated is not None:
        return calibrated, "calibration"
    return DEFAULT_PARALLEL_MIN_FLOPS, "default"


@functools.lru_cache(maxsize=1)
def calibrated_parallel_min_flops() -> float | None:
    """This machine's measured threshold from the TVM calibration cache, or None (none cached)."""
    from partitioner.calibrate_cache import load_cached

    try:
        doc = load_cached("tvm")
    except Exception:  # noqa: BLE001 - an unreadable cache is no calibration, not a failed build
        return None
    value = ((doc or {}).get("calibration") or {}).get("parallel_min_flops")
    return float(value) if isinstance(value, (int, float)) and value > 0 else None


def worth_parallel(flops: float, peak_fraction: float = 1.0) -> bool:
    """True when a kernel of ``flops`` FLOPs should use the thread pool.

    ``peak_fraction``: the share of the FMA peak the kernel runs at on one thread (1.0: a
    compute-bound GEMM or conv, what :func:`parallel_min_flops` is sized for). The rule compares
    the kernel's *time* with the fork/join, so a kernel that runs at a fraction ``f`` of the peak
    needs only ``f x`` the FLOPs: a memory-bound depthwise conv at 0.4 of the peak takes as long
    per FLOP as 2.5 GEMM FLOPs (``depthwise.PARALLEL_PEAK_FRACTION``). Always False in a build
    for one thread (:data:`SERIAL_WHEN_ONE_THREAD`)."""
    return not _serial_build() and flops >= parallel_min_flops() * peak_fraction


def lane_share(vec: int, lanes: int) -> float:
    """The share of the FMA peak a contraction vectorised ``vec`` lanes wide can reach on a
    machine of ``lanes`` lanes: ``vec / lanes`` when ``4 <= vec < lanes`` and
    :data:`NARROW_VECTOR_SHARE` holds, else 1.0 (module docstring, "Narrow-vector
    contractions"); :func:`worth_parallel`'s ``peak_fraction``."""
    if not NARROW_VECTOR_SHARE or not 4 <= vec < lanes:
        return 1.0
    return vec / lanes


def epilogue_ops(sch: Any, red: Any) -> int:
    """Distinct arithmetic operations (structurally different subexpressions: what LLVM computes
    once after common-subexpression elimination) in the values the consumers of the reduction
    block ``red`` store, followed consumer to consumer: the epilogue a contraction fuses.
    Addressing (buffer indices) is not counted."""
    import tvm
    import tvm_ffi
    from tvm import tirx

    seen: set[int] = set()
    binary = (tirx.Add, tirx.Sub, tirx.Mul, tirx.Div, tirx.Min, tirx.Max, tirx.FloorDiv, tirx.FloorMod)

    def walk(e: Any) -> None:
        if isinstance(e, binary):
            kids = [e.a, e.b]
        elif isinstance(e, tvm.ir.Call):
            kids = list(e.args)
        elif isinstance(e, tirx.Cast):
            kids = [e.value]
        elif isinstance(e, tirx.Select):
            kids = [e.condition, e.true_value, e.false_value]
        else:
            return
        key = tvm_ffi.structural_hash(e)
        if key not in seen:  # a repeated subtree is computed once
            seen.add(key)
            for k in kids:
                walk(k)

    try:
        _walk_consumers(sch, red, walk)
    except (AttributeError, TypeError, ValueError):  # an epilogue shape not foreseen: no extra work
        return 0  # (raising would make the GEMM rule's caller fall back to another schedule)
    return len(seen)


def _walk_consumers(sch: Any, red: Any, walk: Any) -> None:
    """``walk`` the stored value of every block downstream of ``red``, each block once."""
    from tvm import tirx

    todo, done = list(sch.get_consumers(red)), set()
    while todo:
        blk = todo.pop()
        body = sch.get(blk).body
        if str(sch.get(blk).name_hint) in done:
            continue
        done.add(str(sch.get(blk).name_hint))
        if isinstance(body, tirx.BufferStore):
            walk(body.value)
        todo.extend(sch.get_consumers(blk))


def with_epilogue(flops: float, ops: int, elements: float) -> float:
    """``flops`` plus the epilogue's work (module docstring, "Epilogue work"): ``ops`` distinct
    operations per output element on ``elements`` elements; ``flops`` unchanged when
    :data:`COUNT_EPILOGUE_OPS` is off."""
    return flops + (EPILOGUE_FLOPS_PER_OP * ops * elements if COUNT_EPILOGUE_OPS else 0.0)


def parallel_elements(elements: float, minimum: float = PARALLEL_MIN_ELEMENTS) -> bool:
    """True when a memory-bound kernel (copy, pad, pack, row-wise norm) touching ``elements``
    elements should use the thread pool: at least ``minimum`` of them (the module docstring's
    :data:`PARALLEL_MIN_ELEMENTS`; a caller with its own bound passes it), and not a build for
    one thread (:data:`SERIAL_WHEN_ONE_THREAD`)."""
    return not _serial_build() and elements >= minimum
