"""The physical limits of one CPU core, measured through TVM: fp32 FMA peak and memory bandwidth.

Every "% of peak" figure in the benchmarks divides by these numbers, so they must be the
machine's limit, not the rate of some library:

1. **FMA peak** (:func:`measure_fma_peak`): a TVM-built loop that keeps ``U`` independent vector
   accumulators (``U`` vectors of the target's ``V`` fp32 lanes) and updates each with one fused
   multiply-add per iteration, ``acc = acc * m + c``. ``U`` sweeps 8..24 so that enough FMAs are
   in flight to hide the FMA latency (latency 4 x 2 pipes = 8 on Zen 4 / Skylake), while the
   accumulators still fit the register file (16 AVX2 or 32 AVX-512 registers). ``m`` < 1 and
   ``c`` > 0 keep the values at a fixed point (no overflow, no denormals). The peak is the best
   configuration's median rate: FLOPs = 2 x U x V x iterations.
2. **Memory bandwidth** (:func:`measure_bandwidth`): a TVM-built, vectorised triad
   ``c = a + s * b`` over arrays each 2x the last-level cache (6x together), one thread; bytes counted
   = 3 x 4 x n (two reads and one write; the write-allocate read is not counted, as STREAM does).

3. **Fork/join cost** (:func:`measure_fork_join`): a TVM-built parallel loop with one trivial
   iteration per thread, timed on ``threads`` threads (wall clock, the calling thread waits for
   the others) minus the same loop serial; the lowest batch median (load only adds). It gives
   the threshold below which a kernel runs on one thread
   (:func:`backends.tvm.schedules.threads.threshold_from`: ``Peak.parallel_min_flops``, from
   the larger of the two costs below; ``partitioner calibrate`` stores it and builds use it).
   With ``idle_s`` > 0 each call comes ``idle_s`` after the previous one and is timed alone
   (median): the cost of the first parallel kernel of a model run, when the workers may have
   gone to sleep or spun through their share of the core (``Peak.fork_join_idle_s``, 1 ms
   idle; TVM's default idle spin made it ~4 ms on a shared machine: see
   :mod:`backends.tvm.schedules.threads`, "the pool's idle spin").

The first two run on the calling thread only (TVM's thread pool is not used: the loops are not
parallel), so the figures are per core; they are timed with the thread's CPU clock (equal to
wall time on a quiet machine; on a shared one, other processes' time slices do not count).
Sanity check against the CPU: peak ~= FMA units x lanes x 2 x clock (e.g. Zen 4: 2 x 256-bit
FMA pipes = 32 FLOP/cycle for AVX2 and AVX-512 alike; Skylake-SP/Ice Lake with two AVX-512 FMA
units: 64 FLOP/cycle).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

ACCUMULATOR_COUNTS = (8, 12, 16, 24)


@dataclass(frozen=True)
class Peak:
    """Measured per-core limits. ``fma_flops``: fp32 FLOP/s (best configuration's median);
    ``bandwidth``: bytes/s of the triad; ``lanes``/``accumulators``: the winning FMA loop shape;
    ``fma_flops_best``: the fastest single call (on a loaded machine, the closer estimate of the
    limit; on a quiet one it equals ``fma_flops`` within noise)."""

    fma_flops: float
    bandwidth: float
    lanes: int
    accumulators: int
    target: str
    fma_by_accumulators: dict[int, float]
    fma_flops_best: float = 0.0
    fork_join_s: float = 0.0
    parallel_min_flops: float = 0.0
    fork_join_idle_s: float = 0.0

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["fma_by_accumulators"] = {str(k): v for k, v in self.fma_by_accumulators.items()}
        return d


def _fma_func(accumulators: int, lanes: int) -> Any:
    from tvm.script import tirx as T

    U, V = accumulators, lanes

    @T.prim_func
    def fma(a: T.Buffer((U, V), "float32"), mc: T.Buffer((2, V), "float32"), out: T.Buffer((U, V), "float32"),
            n: T.int32):
        T.func_attr({"global_symbol": "fma", "tirx.noalias": True})
        acc = T.alloc_buffer((U, V), "float32", scope="local")
        for u in T.unroll(U):
            for v in T.vectorized(V):
                acc[u, v] = a[u, v]
        for _ in range(n):
            for u in T.unroll(U):
                for v in T.vectorized(V):
                    acc[u, v] = acc[u, v] * mc[0, v] + mc[1, v]
        for u in T.unroll(U):
            for v in T.vectorized(V):
                out[u, v] = acc[u, v]

    return fma


def _triad_func(n: int, lanes: int) -> Any:
    from tvm.script import tirx as T

    chunks = n // lanes

    @T.prim_func
    def triad(a: T.Buffer((chunks, lanes), "float32"), b: T.Buffer((chunks, lanes), "float32"),
              c: T.Buffer((chunks, lanes), "float32"), s: T.float32):
        T.func_attr({"global_symbol": "triad", "tirx.noalias": True})
        for i in range(chunks):
            for v in T.vectorized(lanes):
                c[i, v] = a[i, v] + s * b[i, v]

    return triad


def _target(target: Any) -> Any:
    import tvm

    from .target import resolve_target

    return target if isinstance(target, tvm.target.Target) else resolve_target(target)


def _clock() -> float:
    """CPU seconds of the calling thread: the probes run on this thread only, so on a quiet
    machine this equals wall time, and on a shared one the time slices given to other processes
    do not count (the figure stays the core's limit, not its share)."""
    return time.thread_time()


def _median_rate(call: Any, work: float, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = _clock()
        call()
        times.append(_clock() - t0)
    return work / statistics.median(times)


def measure_fma_peak(target: Any = None, seconds: float = 0.05,
                     repeats: int = 7) -> tuple[float, int, int, dict[int, float], float]:
    """(FLOP/s, lanes, accumulators, rate per accumulator count, best single call) of the FMA
    loop on one core.

    Each call runs about ``seconds``; the rate is the median of ``repeats`` calls; configurations
    are interleaved round by round so machine load hits them alike."""
    import numpy as np
    import tvm

    from .schedules.vector import vector_lanes

    tgt = _target(target)
    lanes = vector_lanes(tgt, 32)
    fns = {}
    for u in ACCUMULATOR_COUNTS:
        lib = tvm.compile(tvm.IRModule({"fma": _fma_func(u, lanes)}), target=tgt)
        fns[u] = lib["fma"]
    mc = tvm.runtime.tensor(np.array([[0.999] * lanes, [0.001] * lanes], "float32"))
    bufs = {u: (tvm.runtime.tensor(np.ones((u, lanes), "float32")), tvm.runtime.tensor(np.zeros((u, lanes), "float32")))
            for u in fns}
    # iterations per call: about `seconds` at a guessed 100 GFLOP/s, refined by one probe
    iters = {}
    for u, fn in fns.items():
        n = 10000
        t0 = _clock()
        fn(bufs[u][0], mc, bufs[u][1], n)
        dt = max(_clock() - t0, 1e-6)
        iters[u] = max(1000, int(n * seconds / dt))
    samples: dict[int, list[float]] = {u: [] for u in fns}
    for _ in range(repeats):
        for u, fn in fns.items():
            a, out = bufs[u]
            n = iters[u]
            t0 = _clock()
            fn(a, mc, out, n)
            samples[u].append(2.0 * u * lanes * n / max(_clock() - t0, 1e-9))
    rates = {u: statistics.median(s) for u, s in samples.items()}
    best = max(rates, key=rates.get)
    return rates[best], lanes, best, rates, max(max(s) for s in samples.values())


def _llc_bytes() -> int:
    """Largest cache size from sysfs (bytes), 32 MiB when unknown."""
    from pathlib import Path

    best = 0
    for p in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        txt = p.read_text().strip()
        mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(txt[-1:], 1)
        try:
            best = max(best, int(txt.rstrip("KMG")) * mult)
        except ValueError:
            continue
    return best or (32 << 20)


def measure_bandwidth(target: Any = None, repeats: int = 7, n: int | None = None) -> float:
    """Bytes/s of the TVM-built triad over arrays each 2x the last-level cache (one thread)."""
    import numpy as np
    import tvm

    from .schedules.vector import vector_lanes

    tgt = _target(target)
    lanes = vector_lanes(tgt, 32)
    if n is None:
        n = 2 * _llc_bytes() // 4  # elements: each array alone is 2x the LLC
    n = max(lanes, n // lanes * lanes)
    lib = tvm.compile(tvm.IRModule({"triad": _triad_func(n, lanes)}), target=tgt)
    fn = lib["triad"]
    shape = (n // lanes, lanes)
    a = tvm.runtime.tensor(np.ones(shape, "float32"))
    b = tvm.runtime.tensor(np.ones(shape, "float32"))
    c = tvm.runtime.tensor(np.zeros(shape, "float32"))
    fn(a, b, c, 0.5)
    return _median_rate(lambda: fn(a, b, c, 0.5), 3.0 * 4 * n, repeats)


def _fork_join_func(parallel: bool) -> Any:
    from tvm.script import tirx as T

    if parallel:
        @T.prim_func
        def probe(a: T.Buffer((64, 16), "float32")):
            T.func_attr({"global_symbol": "probe", "tirx.noalias": True})
            for t in T.parallel(64):
                a[t, 0] = a[t, 0] + T.float32(1)
        return probe

    @T.prim_func
    def probe(a: T.Buffer((64, 16), "float32")):
        T.func_attr({"global_symbol": "probe", "tirx.noalias": True})
        for t in range(64):
            a[t, 0] = a[t, 0] + T.float32(1)
    return probe


def measure_fork_join(target: Any = None, threads: int = 2, batches: int = 15, calls: int = 200,
                      idle_s: float = 0.0) -> float:
    """Seconds one fork/join of TVM's pool costs on ``threads`` threads (module docstring, 3;
    ``idle_s`` > 0: after that long idle).

    0.0 when the machine has fewer than 2 usable cores. Leaves the pool at ``threads``."""
    import numpy as np
    import tvm

    from .executable import _usable_cores, configure_threads

    if threads < 2 or _usable_cores() < 2:
        return 0.0
    tgt = _target(target)
    configure_threads(threads)
    fns = {par: tvm.compile(tvm.IRModule({"probe": _fork_join_func(par)}), target=tgt)["probe"] for par in (True, False)}
    a = tvm.runtime.tensor(np.zeros((64, 16), "float32"))
    if idle_s > 0:
        return _idle_fork_join(fns, a, idle_s, batches * 4)
    per_call: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(batches):
        for par, fn in fns.items():
            fn(a)
            t0 = time.perf_counter()
            for _ in range(calls):
                fn(a)
            per_call[par].append((time.perf_counter() - t0) / calls)
    return max(0.0, min(per_call[True]) - min(per_call[False]))


def _idle_fork_join(fns: dict[bool, Any], a: Any, idle_s: float, calls: int) -> float:
    """Median parallel-call time minus median serial-call time, each call ``idle_s`` after the last."""
    times: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(calls):
        for par, fn in fns.items():
            time.sleep(idle_s)
            t0 = time.perf_counter()
            fn(a)
            times[par].append(time.perf_counter() - t0)
    return max(0.0, statistics.median(times[True]) - statistics.median(times[False]))


def measure_peak(target: Any = None, quick: bool = False, threads: int = 2) -> Peak:
    """FMA peak and bandwidth of one core for ``target`` (default: the host), and the fork/join
    cost of ``threads`` threads with the parallel threshold it implies."""
    from .schedules.threads import DEFAULT_PARALLEL_MIN_FLOPS, threshold_from

    tgt = _target(target)
    flops, lanes, acc, rates, best = measure_fma_peak(tgt, seconds=0.02 if quick else 0.05, repeats=5 if quick else 9)
    bw = measure_bandwidth(tgt, repeats=3 if quick else 7)
    fj = measure_fork_join(tgt, threads, batches=5 if quick else 15)
    fj_idle = measure_fork_join(tgt, threads, batches=5 if quick else 15, idle_s=1e-3)
    worst = max(fj, fj_idle)  # in a model, workers often sleep between parallel kernels
    par_min = threshold_from(worst, best) if worst > 0 else DEFAULT_PARALLEL_MIN_FLOPS
    return Peak(flops, bw, lanes, acc, str(tgt), rates, best, fj, par_min, fj_idle)
