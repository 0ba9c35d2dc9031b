"""Measure this machine and write a cluster file (COST_MODEL.md: "Calibrate the device and link
constants on real runs").

What is measured, and how:

1. Per-core GEMM rate: float32 ``numpy.matmul`` of n×n matrices on one thread (a subprocess with
   OMP/OPENBLAS/MKL thread counts set to 1), best of several runs, 2n³ FLOPs. It becomes the
   device's float32 peak (efficiency 1.0): it is the rate a tuned kernel reaches on one core.
2. Per-core memory bandwidth: a large array copy (read + write bytes / time), one thread.
3. Launch overhead: ONNX Runtime on one thread running a chain of tiny Relu nodes; time per node.
4. MPI α and β: ``mpiexec -n 2 python -m partitioner.calibrate_mpi`` ping-pong at several sizes,
   then a least-squares fit of one-way time = α + nβ weighted by 1/t (relative error), so both
   small and large messages count; α is clamped to [0, time of the smallest message]. The 2-rank allreduce times are kept for checking the model.

The result is a cluster of ``os.cpu_count()`` identical one-core devices in one node, named
``local``. Everything stays within a minute (``quick``: about 15 s).
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from partitioner.cluster import CPU_LINK, Cluster, Device, LinkLevel, total_memory_bytes
from partitioner.errors import PartitionerError

_SINGLE_THREAD_ENV = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
                      "NUMEXPR_NUM_THREADS": "1", "VECLIB_MAXIMUM_THREADS": "1"}


class CalibrationError(PartitionerError):
    """A calibration probe failed (the message says which and why)."""

    exit_code = 1


@dataclass(frozen=True)
class Calibration:
    gemm_flops: float
    gemm_n: int
    memory_bandwidth: float
    launch_overhead_s: float
    alpha_s: float
    beta_s_per_byte: float
    pingpong: tuple[tuple[float, float], ...]
    allreduce: tuple[tuple[float, float], ...]
    mpi_ok: bool
    seconds: float
    machine: dict[str, Any] = field(default_factory=dict, hash=False)

    def to_json(self) -> dict[str, Any]:
        return {
            "gemm_flops_per_core": self.gemm_flops, "gemm_n": self.gemm_n,
            "memory_bandwidth_per_core": self.memory_bandwidth, "launch_overhead_s": self.launch_overhead_s,
            "mpi": {"ok": self.mpi_ok, "alpha_s": self.alpha_s, "beta_s_per_byte": self.beta_s_per_byte,
                    "bandwidth": 1 / self.beta_s_per_byte if self.beta_s_per_byte > 0 else None,
                    "pingpong": [list(p) for p in self.pingpong],
                    "allreduce": [list(p) for p in self.allreduce]},
            "seconds": self.seconds, "machine": dict(self.machine),
        }


# ---- single-core probe (runs in a subprocess with one BLAS thread) ----------------------------

def _probe(quick: bool) -> dict[str, float]:
    import numpy as np

    n = 512 if quick else 1024
    rng = np.random.default_rng(0)
    a = rng.standard_normal((n, n), dtype=np.float32)
    b = rng.standard_normal((n, n), dtype=np.float32)
    a @ b  # warm-up
    best = float("inf")
    deadline = time.perf_counter() + (1.0 if quick else 3.0)
    reps = 0
    while reps < 3 or (time.perf_counter() < deadline and reps < 30):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
        reps += 1
    gemm = 2.0 * n ** 3 / best

    size = (64 if quick else 256) * 2 ** 20
    src = np.ones(size // 4, np.float32)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    bw_best = float("inf")
    for _ in range(3 if quick else 5):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        bw_best = min(bw_best, time.perf_counter() - t0)
    bandwidth = 2.0 * size / bw_best

    launch = _launch_overhead(120 if quick else 400)
    return {"gemm_flops": gemm, "gemm_n": n, "memory_bandwidth": bandwidth, "launch_overhead_s": launch}


def _launch_overhead(chain: int) -> float:
    """Seconds per tiny node in ONNX Runtime on one thread (0 when ORT is missing)."""
    try:
        import numpy as np
        import onnxruntime as ort
        from onnx import TensorProto, helper
    except ImportError:
        return 0.0
    nodes = [helper.make_node("Relu" if i % 2 == 0 else "Neg", [f"t{i}"], [f"t{i + 1}"]) for i in range(chain)]
    g = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info("t0", TensorProto.FLOAT, [4])],
                          [helper.make_tensor_value_info(f"t{chain}", TensorProto.FLOAT, [4])])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.inter_op_num_threads = 1
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    x = {"t0": np.ones(4, np.float32)}
    for _ in range(5):
        sess.run(None, x)
    best = float("inf")
    for _ in range(20):
        t0 = time.perf_counter()
        sess.run(None, x)
        best = min(best, time.perf_counter() - t0)
    return best / chain


def _probe_main() -> None:
    print(json.dumps(_probe("--quick" in sys.argv)))


def _run_probe(quick: bool, timeout: float) -> dict[str, float]:
    env = dict(os.environ, **_SINGLE_THREAD_ENV)
    code = "import sys; from partitioner.calibrate import _probe_main; _probe_main()"
    args = [sys.executable, "-c", code] + (["--quick"] if quick else [])
    try:
        out = subprocess.run(args, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        raise CalibrationError(f"the single-core probe took longer than {timeout:.0f} s") from None
    if out.returncode != 0:
        last = (out.stderr.strip().splitlines() or ["no output"])[-1]
        raise CalibrationError(f"the single-core probe failed: {last}")
    return json.loads(out.stdout.strip().splitlines()[-1])


# ---- MPI probe -------------------------------------------------------------------------------

def find_mpiexec() -> str | None:
    """``mpiexec`` next to the running interpreter (the mpich wheel), else on PATH."""
    here = Path(sys.executable).parent / "mpiexec"
    if here.is_file() and os.access(here, os.X_OK):
        return str(here)
    return shutil.which("mpiexec")


def fit_alpha_beta(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least squares t = α + nβ with each row weighted by 1/t (so relative errors count)."""
    import numpy as np

    n = np.array([p[0] for p in points], dtype=float)
    t = np.array([p[1] for p in points], dtype=float)
    w = 1.0 / np.maximum(t, 1e-12)
    A = np.stack([np.ones_like(n), n], axis=1) * w[:, None]
    (alpha, beta), *_ = np.linalg.lstsq(A, t * w, rcond=None)
    if beta <= 0:  # noise: fall back to the largest message
        beta = max(t[-1] - t[0], 1e-12) / max(n[-1] - n[0], 1.0)
    # α can be neither negative nor more than the smallest message's own time (noise on a
    # shared machine otherwise leaks the large-message protocol switch into α)
    i = int(np.argmin(n))
    alpha = min(max(alpha, 0.0), max(t[i] - n[i] * beta, 0.0)) if alpha > t[i] or alpha < 0 else alpha
    return float(alpha), float(beta)


def _run_mpi(quick: bool, timeout: float) -> dict[str, Any] | None:
    mpiexec = find_mpiexec()
    if mpiexec is None:
        return None
    args = [mpiexec, "-n", "2", sys.executable, "-m", "partitioner.calibrate_mpi"] + (["--quick"] if quick else [])
    env = dict(os.environ, **_SINGLE_THREAD_ENV)
    try:
        out = subprocess.run(args, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return None
    if out.returncode != 0 or not out.stdout.strip():
        return None
    try:
        data = json.loads(out.stdout.strip().splitlines()[-1])
    except json.JSONDecodeError:
        return None
    return data if "pingpong" in data else None


# ---- putting it together ---------------------------------------------------------------------

def machine_info() -> dict[str, Any]:
    cpu = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "platform": platform.platform(),
            "python": platform.python_version()}


def calibrate(quick: bool = False) -> Calibration:
    """Run the probes (module docstring) and return the measurements."""
    t0 = time.perf_counter()
    single = _run_probe(quick, timeout=30 if quick else 60)
    mpi = _run_mpi(quick, timeout=20 if quick else 40)
    if mpi is not None:
        pp = [tuple(map(float, p)) for p in mpi["pingpong"]]
        ar = [tuple(map(float, p)) for p in mpi.get("allreduce", [])]
        alpha, beta = fit_alpha_beta(pp)
    else:
        pp, ar = [], []
        alpha, beta = CPU_LINK.alpha_s, CPU_LINK.beta_s_per_byte
    return Calibration(
        gemm_flops=float(single["gemm_flops"]), gemm_n=int(single["gemm_n"]),
        memory_bandwidth=float(single["memory_bandwidth"]),
        launch_overhead_s=float(single["launch_overhead_s"]),
        alpha_s=alpha, beta_s_per_byte=beta, pingpong=tuple(pp), allreduce=tuple(ar),  # type: ignore[arg-type]
        mpi_ok=mpi is not None, seconds=time.perf_counter() - t0, machine=machine_info(),
    )


def cluster_from_calibration(cal: Calibration, n: int | None = None) -> Cluster:
    """``n`` (default: all cores) identical one-core devices sharing one node and the MPI link."""
    n = n or os.cpu_count() or 1
    f32 = cal.gemm_flops
    peak = {"float32": f32, "float16": f32, "bfloat16": f32, "int8": 2 * f32}
    mem = total_memory_bytes() / n
    devs = tuple(Device(f"cpu{i}", "cpu", dict(peak), mem, cal.memory_bandwidth, 1.0, cal.launch_overhead_s)
                 for i in range(n))
    link = LinkLevel("shm-mpi" if cal.mpi_ok else "shm", cal.alpha_s, cal.beta_s_per_byte)
    notes = (f"calibrated {time.strftime('%Y-%m-%d %H:%M:%S')} on {cal.machine.get('cpu', '?')}"
             f"{'' if cal.mpi_ok else '; MPI probe failed, link is nominal'}")
    return Cluster("local", devs, (tuple(range(n)),), (link,), notes)
