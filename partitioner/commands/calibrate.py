"""``partitioner calibrate``: measure this machine's per-core GEMM rate, memory bandwidth, the
chosen backend's per-op launch overhead and per-op-class efficiencies (on micro-kernels that
backend builds), and MPI α/β, and write a cluster file (see partitioner/calibrate.py).

``--backend tvm`` (default) calibrates the code the TVM backend generates with its default
schedules; ``--backend onnxruntime`` calibrates ONNX Runtime's kernels (for predicting ORT).

Without ``-o`` the file goes to the ``local`` preset's path (``~/.cache/partitioner/local.json``
or ``$PARTITIONER_CALIBRATION``) and to this machine's calibration cache
(``~/.cache/partitioner/calibration/<cpu>-<cores>c-1t-<backend>.json``, or under
``$PARTITIONER_CACHE_DIR``), which ``cpu:N`` and ``--devices N`` read from then on; run it again
to refresh the figures. With ``-o FILE`` it goes to FILE only.
"""

from __future__ import annotations

import argparse

from partitioner.commands._options import add_json_argument, print_json

NAME = "calibrate"
HELP = ("measure this machine (GEMM FLOP/s, memory bandwidth, per-op-class efficiency and launch overhead "
        "of a backend's kernels, MPI alpha/beta) and write a cluster file")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("-o", "--output", default=None, metavar="FILE",
                   help="write the cluster file here instead of the 'local' preset's path")
    p.add_argument("--quick", action="store_true", help="smaller, faster probes (well under a minute)")
    p.add_argument("--backend", choices=("tvm", "onnxruntime"), default="tvm",
                   help="whose kernels the per-class efficiencies describe (default: tvm)")
    p.add_argument("--devices", type=int, default=None, metavar="N",
                   help="devices in the written cluster (default: all cores)")
    add_json_argument(p)


def run(args: argparse.Namespace) -> int:
    from partitioner.calibrate import CO_RUN_CACHED_BYTES, calibrate, cluster_from_calibration
    from partitioner.cluster import calibration_path
    from partitioner.core.errors import UsageError

    if args.devices is not None and args.devices < 1:
        raise UsageError("--devices must be at least 1")
    cal = calibrate(quick=args.quick, backend=args.backend)
    cluster = cluster_from_calibration(cal, args.devices)
    written = []
    if not args.output:  # this machine's cache, which cpu:N reads (partitioner/calibrate_cache.py)
        from partitioner.calibrate_cache import save_cached

        try:
            written.append(str(save_cached(cluster_from_calibration(cal, 1).to_json(), cal.to_json(), cal.backend)))
        except OSError as exc:
            raise UsageError(f"cannot write the calibration cache: {exc.strerror or exc}") from None
    for path in [args.output] if args.output else [str(calibration_path())]:
        try:
            cluster.save(path)
        except OSError as exc:
            raise UsageError(f"cannot write the cluster file {path!r}: {exc.strerror or exc}") from None
        written.append(path)
    if args.json:
        print_json({"calibration": cal.to_json(), "cluster": cluster.to_json(), "written": written})
        return 0
    print(f"GEMM (1 core, n={cal.gemm_n}):  {cal.gemm_flops / 1e9:8.1f} GFLOP/s")
    print(f"memory bandwidth (1 core):  {cal.memory_bandwidth / 1e9:8.1f} GB/s")
    if cal.fma_peak_flops:
        print(f"FMA peak (1 core, TVM):     {cal.fma_peak_flops / 1e9:8.1f} GFLOP/s")
    if cal.stream_bandwidth:
        print(f"triad bandwidth (1 core):   {cal.stream_bandwidth / 1e9:8.1f} GB/s")
    if cal.parallel_min_flops:
        print(f"parallel threshold (TVM):   {cal.parallel_min_flops / 1e6:8.2f} MFLOP per kernel "
              "(builds here use it)")
    print(f"launch overhead ({cal.backend}):{' ' * max(1, 15 - len(cal.backend))}{cal.launch_overhead_s * 1e6:8.2f} µs/op")
    print(f"call overhead (per run):    {cal.call_overhead_s * 1e6:8.2f} µs")
    print(f"comm-op overhead (per op):  {cal.comm_op_overhead_s * 1e6:8.2f} µs")
    if cal.co_run_rounds:
        share = cal.co_run_bandwidth
        print(f"co-run bandwidth share:     {share:8.2f}   (each core, all {cal.threads_probed} copying)")
        if cal.co_run_cached_rounds:
            print(f"  in cache:                 {cal.co_run_cached_bandwidth:8.2f}   "
                  f"(copies of {CO_RUN_CACHED_BYTES // 2 ** 20} MiB moved)")
    else:
        print("co-run bandwidth share:         1.00   (not measured: the cores were busy)")
    for cls, eff in cal.efficiency_by_class.items():
        print(f"efficiency {cls + ':':<17s}{eff:8.3f}")
    if cal.mpi_ok:
        print(f"MPI alpha:                  {cal.alpha_s * 1e6:8.2f} µs")
        print(f"MPI bandwidth (1/beta):     {1 / cal.beta_s_per_byte / 1e9:8.2f} GB/s")
        for n, t in cal.allreduce:
            print(f"allreduce 2 ranks {int(n):>9d} B: {t * 1e6:10.1f} µs")
    else:
        print(f"MPI probe failed ({cal.mpi_error}): the link uses nominal shared-memory numbers")
    print(f"took {cal.seconds:.1f} s; wrote {', '.join(written)}")
    return 0
