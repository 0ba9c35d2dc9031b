"""One MPI rank of a run: ``python -m partitioner.runtime.worker DIR --inputs in.npz --outputs out.npz``.

``partitioner run`` starts it under ``mpiexec``; it also runs under a user's own ``mpiexec`` or
``srun`` across machines (every rank needs the artifact directory and the input file at the same
path, e.g. on a shared file system).

What each rank does, in order:
1. Verifies the whole artifact (hashes, layout, rank count) before it loads any library, and
   checks that the MPI world has exactly ``world_size`` ranks. With ``--trusted-key`` (or
   ``$PARTITIONER_TRUSTED_KEY``) it first checks the artifact's signature (exit 2 when refused).
2. Pins itself to its share of the host's cores (C cores / R ranks on this host, from
   ``COMM_TYPE_SHARED`` or ``--ranks-per-host``) and sets ``TVM_NUM_THREADS`` /
   ``OMP_NUM_THREADS`` before the backend (and so TVM) is imported.
3. Creates every collective group's communicator, in the manifest's global order.
4. Loads its executable with ``backends.get_backend(manifest backend).load`` from its own program
   only, read without its weights: the backend memory-maps ``rank<i>.data``
   (:mod:`partitioner.core.mapped_weights`), so no rank reads another's weights; a GPU rank then
   wraps its communicator with NCCL when that is selected (:mod:`partitioner.runtime.comm_nccl`).
5. Reads the inputs (every rank reads the .npz itself) and keeps its own slices
   (:func:`scatter_inputs`), runs its micro-batches (:mod:`partitioner.runtime.schedule`).
6. Sends its output slices to rank 0, which assembles them (:func:`gather_outputs`) and writes
   the .npz (and, with ``--timings``, a JSON of step times plus every rank's report: its core
   affinity and thread variables as the worker saw them after pinning, its peak RSS
   (``peak_rss_bytes``, VmHWM), which heavy modules were
   already imported at that point, and with ``--profile`` its per-step compute/comm/idle times).

On any error a rank prints one line ``rank R: <op>: <message>`` to stderr and calls
``MPI.COMM_WORLD.Abort(1)``, which ends every rank.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from partitioner.core.machine import peak_rss_bytes

#: tag base of the runtime's own output traffic (on a private duplicate communicator)
_OUTPUT_TAG = 1000
_REPORT_TAG = 999
PIN_ENV = "PARTITIONER_PIN"  # "0" disables core pinning


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("artifact", metavar="DIR", help="the artifact directory")
    p.add_argument("--inputs", required=True, metavar="NPZ", help="the inputs, an .npz file")
    p.add_argument("--outputs", default=None, metavar="NPZ", help="where rank 0 writes the outputs (.npz)")
    p.add_argument("--ranks-per-host", type=int, default=None, metavar="N",
                   help="ranks sharing one host's cores (default: detected from MPI)")
    p.add_argument("--warmup", type=int, default=0, metavar="K", help="untimed steps before the timed ones")
    p.add_argument("--repeat", type=int, default=1, metavar="N", help="timed steps")
    p.add_argument("--timings", default=None, metavar="JSON", help="where rank 0 writes the step times")
    p.add_argument("--error-file", default=None, metavar="PATH",
                   help="a failing rank appends its one-line reason here too (used by `partitioner run`)")
    p.add_argument("--nondeterministic-reduce", action="store_true",
                   help="use MPI's own reductions (faster, not bit-reproducible)")
    p.add_argument("--profile", action="store_true",
                   help="record per-step compute / comm / idle seconds on every rank (into --timings)")
    p.add_argument("--comm-timeout", type=float, default=None, metavar="S",
                   help="seconds a receive or collective may wait (default $PARTITIONER_COMM_TIMEOUT or 30)")
    from partitioner.signing import add_trusted_key_argument

    add_trusted_key_argument(p)


def read_npz(path: str | os.PathLike[str], what: str = "inputs") -> dict[str, np.ndarray]:
    """Read an .npz without pickle; InputError names the file when it is not one."""
    from partitioner.core.errors import InputError

    try:
        data = np.load(path, allow_pickle=False)
        if not isinstance(data, np.lib.npyio.NpzFile):
            raise InputError(f"{path}: the {what} must be an .npz file (numpy.savez), not a single array")
        with data:
            return {k: data[k] for k in data.files}
    except InputError:
        raise
    except FileNotFoundError:
        raise InputError(f"{path}: no such {what} file") from None
    except (OSError, ValueError, EOFError) as exc:
        raise InputError(f"{path}: cannot read the {what} as an .npz file ({str(exc).splitlines()[0]})") from None


def write_npz(path: str | os.PathLike[str], arrays: dict[str, np.ndarray]) -> None:
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp.npz")
    np.savez(tmp, **arrays)
    os.replace(tmp, path)


def pin_cores(local_rank: int, local_size: int) -> int:
    """Pin this process to its share of the cores it may use; returns the thread count to use."""
    try:
        cores = sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return max(1, (os.cpu_count() or 1) // max(1, local_size))
    share = max(1, len(cores) // max(1, local_size))
    if os.environ.get(PIN_ENV, "1") != "0" and len(cores) > 1:
        start = (local_rank * share) % len(cores)
        mine = cores[start:start + share] or cores[:share]
        try:
            os.sched_setaffinity(0, mine)
        except OSError:
            pass
    return share


_HEAVY_MODULES = ("tvm", "tvm_ffi", "onnxruntime")
# seconds a failing rank waits, after writing its one line, before MPI_Abort ends the job
ABORT_GRACE_S = 0.3


def rank_report(rank: int, threads: int, imported_before_pin: Sequence[str]) -> dict[str, Any]:
    """What this rank runs with, read back from the OS and the environment (not from our own plan)."""
    try:
        affinity: list[int] | None = sorted(os.sched_getaffinity(0))
    except AttributeError:
        affinity = None
    return {"rank": rank, "pid": os.getpid(), "affinity": affinity, "threads": threads,
            "env": {v: os.environ.get(v) for v in ("TVM_NUM_THREADS", "OMP_NUM_THREADS", "TVM_BIND_THREADS")},
            "imported_before_pin": list(imported_before_pin)}


def gather_reports(comm: Any, report: dict[str, Any]) -> list[dict[str, Any]] | None:
    """Every rank's JSON report, in rank order, on rank 0 (None elsewhere); each with the rank's
    peak RSS so far (``peak_rss_bytes``, VmHWM: its whole life, loading and steps)."""
    report = {**report, "peak_rss_bytes": peak_rss_bytes()}
    data = np.frombuffer(json.dumps(report).encode(), dtype=np.uint8)
    if comm.rank != 0:
        comm.send_array(data, 0, _REPORT_TAG)
        return None
    reports = [report]
    for r in range(1, comm.world_size):
        reports.append(json.loads(comm.recv_array(r, _REPORT_TAG).tobytes().decode()))
    return reports


def output_routes(bindings: Any) -> list[tuple[int, int, str]]:
    """(rank, micro-batch, local name) of every output slice rank 0 needs, in a fixed order."""
    routes: list[tuple[int, int, str]] = []
    for b in bindings.outputs:
        whole = [p for p in b.placements if p.axis is None]
        for k in range(bindings.microbatches):
            for p in (whole[:1] if whole else b.placements):
                routes.append((p.rank, k, p.local_name))
    return sorted(set(routes))


def gather_to_root(comm: Any, bindings: Any, mine: Sequence[dict[str, np.ndarray]]) -> dict[str, np.ndarray] | None:
    """Move the output slices to rank 0 and assemble them there (None on the other ranks)."""
    from partitioner.core.bindings import gather_outputs

    routes = output_routes(bindings)
    if comm.rank != 0:
        for i, (r, k, name) in enumerate(routes):
            if r == comm.rank:
                comm.send_array(mine[k][name], 0, _OUTPUT_TAG + i)
        return None
    per_rank: list[list[dict[str, np.ndarray]]] = [[{} for _ in range(bindings.microbatches)]
                                                   for _ in range(bindings.world_size)]
    for i, (r, k, name) in enumerate(routes):
        per_rank[r][k][name] = mine[k][name] if r == 0 else comm.recv_array(r, _OUTPUT_TAG + i)
    return gather_outputs(bindings, per_rank)


def _memory_baseline(backend: str) -> dict[str, Any]:
    """The process baseline for the measured peak memory (``bench``): the RSS once the backend's
    runtime library is imported, just before this rank's program and weights load; the high-water
    mark is reset there, so peak - baseline is what the program, its weights and its activations
    add (what the cost model predicts per rank)."""
    import importlib

    from partitioner.core.machine import reset_peak_rss, rss_bytes

    try:
        importlib.import_module({"tvm": "tvm", "onnxruntime": "onnxruntime"}.get(backend, "numpy"))
    except ImportError:
        pass
    return {"baseline_rss_bytes": rss_bytes(), "peak_reset": reset_peak_rss()}


def _memory_peak(memory: dict[str, Any]) -> dict[str, Any]:
    from partitioner.core.machine import peak_rss_bytes

    peak = peak_rss_bytes()
    return {**memory, "peak_rss_bytes": peak, "peak_over_baseline_bytes": max(0, peak - memory["baseline_rss_bytes"])}


def run_worker(args: argparse.Namespace) -> int:
    from mpi4py import MPI
    world = MPI.COMM_WORLD
    rank = world.Get_rank()
    phase = "verify"
    comm = None
    try:
        from partitioner.artifact import load_artifact
        from partitioner.core.errors import ArtifactError
        from partitioner.runtime.fault import from_env
        from partitioner.signing import check_trusted

        check_trusted(args.artifact, args.trusted_key)  # before anything of the artifact is read
        art = load_artifact(args.artifact)
        from backends.cuda_devices import require_matching_gpu

        require_matching_gpu(art.manifest, str(args.artifact))
        if world.Get_size() != art.world_size:
            raise ArtifactError(f"{args.artifact}: built for {art.world_size} ranks but MPI started "
                                f"{world.Get_size()}; run it with mpiexec -n {art.world_size}")
        phase = "pin"
        imported_before_pin = [m for m in _HEAVY_MODULES if m in sys.modules]
        local = world.Split_type(MPI.COMM_TYPE_SHARED)
        local_size = args.ranks_per_host or local.Get_size()
        threads = pin_cores(local.Get_rank() % local_size, local_size)
        for var in ("TVM_NUM_THREADS", "OMP_NUM_THREADS"):
            os.environ[var] = str(threads)
        # TVM would re-pin its threads starting from core 0, undoing the share chosen above
        os.environ.setdefault("TVM_BIND_THREADS", "0")
        report = rank_report(rank, threads, imported_before_pin)
        phase = "comm groups"
        from partitioner.runtime.comm_mpi import MPICommunicator

        hook = from_env(rank)
        comm = MPICommunicator(art.manifest["comm_groups"], timeout_s=args.comm_timeout,
                               deterministic=not args.nondeterministic_reduce, fault=hook)
        phase = "load"
        from backends import get_backend

        os.environ["PARTITIONER_LOCAL_RANK"] = str(local.Get_rank() % local_size)  # picks this rank's GPU
        memory = _memory_baseline(art.backend)
        exe = get_backend(art.backend).load(art.program(rank, load_data=False), art.backend_file(rank),
                                            threads=threads)  # its weights stay in rank<i>.data: mapped
        if getattr(exe, "device", None) is not None and exe.device.dlpack_device_type() != 1:
            phase = "gpu comm"
            from partitioner.runtime.comm_nccl import gpu_communicator
            from backends.cuda_devices import visible_gpus

            comm, report["gpu_comm"] = gpu_communicator(comm, art.manifest["comm_groups"], exe.device.index,
                                                        shared_gpu=local_size > len(visible_gpus()))
        phase = "inputs"
        from partitioner.core.bindings import scatter_inputs

        feeds = scatter_inputs(art.bindings, read_npz(args.inputs))[rank]
        hook.maybe_fail("start")
        phase = "run"
        from partitioner.runtime.schedule import timed_steps

        outs, times = timed_steps(exe, feeds, comm, warmup=max(0, args.warmup), repeat=max(1, args.repeat),
                                  barrier=comm.barrier, profile=args.profile)
        phase = "gather outputs"
        result = gather_to_root(comm, art.bindings, outs)
        if args.profile:
            report["profile"] = [p.to_json() for p in times.profile]
        reports = gather_reports(comm, {**report, "memory": _memory_peak(memory)})
        if result is not None:
            _write_results(args, art, threads, result, times, reports)
        comm.flush()
        comm.barrier()
        return 0
    except BaseException as exc:  # noqa: BLE001 - any failure must end every rank, now
        op = comm.current_op if comm is not None and phase == "run" else phase
        _report_failure(rank, op, exc, args.error_file)
        # under the user's own mpiexec there is no error file: give mpiexec a moment to forward the
        # line before Abort ends the job (seen: the refusal's exit code arrived without its line)
        time.sleep(ABORT_GRACE_S)
        from partitioner.signing import SignatureError

        world.Abort(2 if isinstance(exc, SignatureError) else 1)  # a refused signature is bad input
        return 1


def _write_results(args: argparse.Namespace, art: Any, threads: int, result: Any, times: Any,
                   reports: Any) -> None:
    """Rank 0: the gathered outputs (``--outputs``) and the step timings (``--timings``)."""
    if args.outputs:
        write_npz(args.outputs, result)
    if args.timings:
        doc = {"world_size": art.world_size, "threads_per_rank": threads, "backend": art.backend,
               **times.to_json(), "ranks": reports}
        doc.pop("profile", None)  # rank 0's profile is in ranks[0]
        Path(args.timings).write_text(json.dumps(doc, indent=2) + "\n")


def _report_failure(rank: int, op: str, exc: BaseException, error_file: str | None) -> None:
    """One line naming the rank and the phase, on stderr and in the launcher's error file (Abort
    may end the job before mpiexec forwards stderr)."""
    msg = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    sys.stderr.write(f"rank {rank}: {op}: {msg}\n")
    sys.stderr.flush()
    if error_file:
        try:
            with open(error_file, "a", encoding="utf-8") as fh:
                fh.write(f"rank {rank}: {op}: {msg}\n")
                fh.flush()
                os.fsync(fh.fileno())
        except OSError:
            pass


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m partitioner.runtime.worker",
                                     description="Run one MPI rank of an artifact.")
    add_arguments(parser)
    return run_worker(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
