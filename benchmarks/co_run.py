"""Per-core speed alone against every core busy at once: which work shares the machine.

    .venv/bin/python benchmarks/co_run.py [--kinds gemm,copy] [--rounds 8] [--seconds 0.25] [--json FILE]

One process per usable core (at most 8), each pinned to its core and single-threaded (BLAS
threads 1). Per round and kind, the first process runs the kind's loop alone for ``--seconds``
while the others wait, then every process runs it at once; the round's share is the mean rate
together over the lone rate. Kinds: ``gemm``, a 256x256 float32 ``numpy.matmul`` (in L2: compute);
``copy``, a 32 MiB float32 ``numpy.copyto`` (out of cache: the memory system). Why (session 22,
issue 16): two training ranks on the 2-core Zen 4 VM were priced as if each had the lone core's
bandwidth, and the data and pipeline steps came out 25-33% slower than predicted. Calibration
probe 7 (``partitioner.calibrate.co_run_bandwidth``) measures the copy share with threads; this
script also shows that compute does not share. Nothing is asserted; the JSON keeps every round.

``--sweep MIB[,MIB...]`` instead runs calibration probe 7 itself
(``partitioner.calibrate.co_run_bandwidth``, threads pinned one per core, 7 rounds) with copies
that move each given number of MiB (read + write): the share by working set that the
roofline's rule 8 interpolates (session 27).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_var] = "1"

ROOT = Path(__file__).resolve().parents[1]


def _worker(cpu: int, commands: Any, results: Any) -> None:
    """One pinned process: runs ``(kind, seconds)`` loops and reports its rate (GFLOP/s or GB/s)."""
    import numpy as np

    from partitioner.calibrate import sustained_rate

    os.sched_setaffinity(0, {cpu})
    a = np.random.default_rng(cpu).standard_normal((256, 256)).astype(np.float32)
    src, dst = np.ones(8 << 20, np.float32), np.empty(8 << 20, np.float32)
    work = {"gemm": (lambda: np.matmul(a, a), 2 * 256 ** 3 / 1e9),
            "copy": (lambda: np.copyto(dst, src), 2 * src.nbytes / 1e9)}
    while True:
        cmd = commands.get()
        if cmd is None:
            return
        kind, seconds = cmd
        fn, units = work[kind]
        fn()
        results.put((cpu, sustained_rate(fn, units, seconds)))


def measure(kinds: list[str], rounds: int, seconds: float) -> dict[str, Any]:
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    cpus = sorted(os.sched_getaffinity(0))[:8]
    queues, results = [ctx.Queue() for _ in cpus], ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(c, q, results), daemon=True) for c, q in zip(cpus, queues)]
    for p in procs:
        p.start()
    out: dict[str, Any] = {"cpus": cpus, "seconds": seconds, "kinds": {}}
    try:
        for kind in kinds:
            rows = []
            for _ in range(rounds):
                queues[0].put((kind, seconds))
                alone = results.get()[1]
                for q in queues:
                    q.put((kind, seconds))
                together = [results.get()[1] for _ in queues]
                rows.append({"alone": round(alone, 2), "together": [round(t, 2) for t in together],
                             "share": round(statistics.fmean(together) / alone, 3)})
                print(f"{kind}: alone {alone:.1f}, together {', '.join(f'{t:.1f}' for t in together)}, "
                      f"share {rows[-1]['share']:.2f}", file=sys.stderr, flush=True)
            out["kinds"][kind] = {"unit": "GFLOP/s" if kind == "gemm" else "GB/s", "rounds": rows,
                                  "median_share": statistics.median(r["share"] for r in rows)}
    finally:
        for q in queues:
            q.put(None)
        for p in procs:
            p.join(10)
    return out


def _sweep(spec: str, path: str) -> int:
    """``--sweep``: probe 7's shares per size moved, as calibration measures them."""
    from partitioner.calibrate import co_run_bandwidth

    try:
        sizes = [float(x) for x in spec.split(",") if x]
    except ValueError:
        sizes = []
    if not sizes or any(not (0.25 <= m <= 4096) for m in sizes):
        print(f"co_run: --sweep takes sizes in MiB between 0.25 and 4096, comma-separated (got {spec!r})",
              file=sys.stderr)
        return 2
    cores = min(8, len(os.sched_getaffinity(0)))
    rows = []
    for mib in sizes:
        shares = co_run_bandwidth(cores, quick=False, moved=int(mib * 2 ** 20))
        rows.append({"moved_mib": mib, "shares": list(shares), "median_share": statistics.median(shares)})
        print(f"copy of {mib:g} MiB moved: median share {rows[-1]['median_share']:.2f} "
              f"({', '.join(f'{x:.2f}' for x in shares)})", flush=True)
    doc = {"load_before": os.getloadavg(), "cores": cores, "sweep": rows}
    Path(path).write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kinds", default="gemm,copy")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=0.25, help="each phase's loop, per process")
    ap.add_argument("--sweep", default="", metavar="MIB[,MIB...]",
                    help="probe 7's copy at each size moved (MiB, read + write) instead of --kinds")
    ap.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "co_run.json"))
    args = ap.parse_args(argv)
    if args.sweep:
        return _sweep(args.sweep, args.json)
    kinds = [k for k in args.kinds.split(",") if k]
    bad = [k for k in kinds if k not in ("gemm", "copy")]
    if bad or args.rounds < 1 or not args.seconds > 0:
        print(f"co_run: --kinds takes gemm,copy (got {bad or kinds}); --rounds >= 1; --seconds > 0",
              file=sys.stderr)
        return 2
    doc = {"load_before": os.getloadavg(), **measure(kinds, args.rounds, args.seconds)}
    Path(args.json).write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    for kind, d in doc["kinds"].items():
        print(f"{kind}: median share {d['median_share']:.2f} over {len(d['rounds'])} rounds")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
