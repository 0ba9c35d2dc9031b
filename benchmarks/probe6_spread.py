"""How much calibration probe 6 (thread efficiency per op class) moves between runs on this machine.

    .venv/bin/python benchmarks/probe6_spread.py [--runs 3] [--backend tvm] [--spin-seconds 20] [--json FILE]

Each run is what ``partitioner calibrate`` does for probe 6: the micro-kernels on 1 thread in one
subprocess, then on every usable core in another (``partitioner.calibrate._run_probe``), and the
per-class efficiency from the two (``thread_efficiency``). The JSON keeps every kernel's two
times per run. ``--spin-seconds``: before the runs, one pinned process per core counts a fixed
Python loop for that long and reports its iterations per second, second by second: a machine
whose cores' speed moves by itself (other tenants of a shared host) shows it there, with nothing
of this project involved. Why (session 24, issue 15): the ``conv`` class came out at 0.20 in one
calibration while convs inside a model ran about 2x faster on 2 threads. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _spin(cpu: int, seconds: float, out: Any) -> None:
    """Pinned to ``cpu``: loop iterations per wall second in units of 10,000, one figure per second."""
    os.sched_setaffinity(0, {cpu})
    rates, end = [], time.perf_counter() + seconds
    while time.perf_counter() < end:
        t0, n = time.perf_counter(), 0
        while time.perf_counter() - t0 < 1.0:
            for _ in range(10000):
                n += 1
        rates.append(n // 10000)
    out.put((cpu, rates))


def spin_check(seconds: float) -> dict[str, list[int]]:
    """One :func:`_spin` process per usable core, all at once."""
    cpus = sorted(os.sched_getaffinity(0))[:8]
    out: Any = mp.Queue()
    procs = [mp.Process(target=_spin, args=(c, seconds, out)) for c in cpus]
    for p in procs:
        p.start()
    rates = dict(out.get() for _ in procs)
    for p in procs:
        p.join()
    return {str(c): rates[c] for c in cpus}


def probe6_run(backend: str, quick: bool) -> dict[str, Any]:
    """One probe-6 measurement, as ``calibrate`` makes it (``calibrate.run_thread_probe``)."""
    from partitioner.calibrate import probe_threads, run_thread_probe

    threads = probe_threads()
    t0 = time.time()
    eff, kernels = run_thread_probe(quick, backend, threads)
    return {"started": time.strftime("%H:%M:%S", time.gmtime(t0)), "threads": threads,
            "seconds": round(time.time() - t0, 1), "load_average": os.getloadavg()[0],
            "efficiency_by_class": eff, "kernels": list(kernels)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--backend", default="tvm", choices=("tvm", "onnxruntime"))
    p.add_argument("--spin-seconds", type=float, default=20.0, help="0: skip the per-core loop check")
    p.add_argument("--quick", action="store_true", help="the probes' quick timing (as calibrate --quick)")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    if args.runs < 1:
        p.error("--runs must be at least 1")
    doc: dict[str, Any] = {"backend": args.backend, "load_average_before": os.getloadavg()[0]}
    if args.spin_seconds > 0:
        doc["spin_10k_iterations_per_s"] = spin_check(args.spin_seconds)
        for cpu, rates in doc["spin_10k_iterations_per_s"].items():
            print(f"core {cpu}: {min(rates)}-{max(rates)} x 10k loop iterations/s over {len(rates)} s")
    doc["runs"] = []
    for i in range(args.runs):
        run = probe6_run(args.backend, args.quick)
        doc["runs"].append(run)
        eff = run["efficiency_by_class"]
        print(f"run {i + 1} ({run['started']}, {run['seconds']} s): "
              + ", ".join(f"{c} {eff[c]:.2f}" for c in ("gemm", "gemm_large", "conv", "depthwise_conv", "pool")
                          if c in eff), flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
