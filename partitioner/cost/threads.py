"""Threads per rank: a plan with fewer ranks than a node's CPU cores runs each rank on several
cores (``runtime/worker.py`` pins rank i of R on a host of C cores to C/R cores and sets
``TVM_NUM_THREADS`` / ``OMP_NUM_THREADS`` to that), so its kernels run faster than on the one
core a ``cpu:N`` device stands for.

Rules:
1. Threads: on a cluster whose devices are all CPU cores of one node (``cpu:N``, ``local``), a
   plan of R ranks gets N // R threads per rank; anything else (GPUs, several nodes, hand-written
   clusters with more than one node) 1, as before.
2. Speed-up of a rank's kernels on t threads: 1 + (t - 1) x e, where e is the device's
   calibrated efficiency for the op's class (``Device.thread_efficiency_by_class``, calibration
   probe 6: the micro-kernels on all cores against one) and THREAD_EFFICIENCY for classes it does
   not list (nominal devices). Measured on the 2-core development machine (2026-12-01): TVM's
   GEMM kernels ran 1.8-1.9x faster on 2 threads, its elementwise kernels not at all (a chain of
   32 Adds on 64 Ki values: 4.3 us per kernel on 1 thread and on 2), which is why the BERT
   encoder (many norm/elementwise kernels) gained 1.22x from a second thread and ResNet-18 1.69x.
   THREAD_EFFICIENCY, the nominal figure, was measured with the
   TVM backend, batch 8, 2 threads against 1 on the 2-core development machine (load average 1.3,
   ``benchmarks/results/runtime_*.json`` of 2026-11-30): ResNet-18 1.72x and 1.99x, a BERT encoder
   1.75x and 0.98x (the latter's kernels are a few microseconds: thread start-up eats the gain).
   0.75 takes the typical figure; the per-call overhead is not sped up.
3. Why it matters: ``auto`` compares every split against ``single x1`` on the same cores; counting
   the 1-rank plan on one core made a 2-way split look 2x faster when the 1-rank build on both
   cores measured within 15% of it (issue 13: ``auto`` must never pick a split slower than single).
4. The threads a rank's library is built for (:func:`build_threads`, ``partitioner.compiler``):
   on a one-node CPU cluster, the worker's own share, this machine's usable cores // R
   (``runtime/worker.py``'s ``pin_cores``, which counts the host's cores, not the cluster's
   devices: a ``cpu:1`` plan runs its one rank on every core); None (unknown) elsewhere. A
   build for 1 thread has no parallel loops (``backends/tvm/schedules/threads.py``).
"""

from __future__ import annotations

from typing import Any

from partitioner.core.machine import usable_cores as _usable_cores  # what pin_cores divides among ranks

THREAD_EFFICIENCY = 0.75


def _one_cpu_node(cluster: Any) -> bool:
    """Whether every device of ``cluster`` is a CPU core of its one node (rules 1 and 4)."""
    devices = getattr(cluster, "devices", ())
    return bool(devices) and len(getattr(cluster, "nodes", ())) == 1 and all(d.kind == "cpu" for d in devices)


def rank_threads(cluster: Any, world_size: int) -> int:
    """Rule 1: threads per rank of a ``world_size``-rank plan on ``cluster``."""
    if world_size < 1 or not _one_cpu_node(cluster):
        return 1
    return max(1, len(cluster.devices) // world_size)


def build_threads(cluster: Any, world_size: int) -> int | None:
    """Rule 4: the threads each rank of a ``world_size``-rank plan will run on, as the worker
    pins it on this machine; None when the cluster is not one node's CPU cores."""
    if world_size < 1 or not _one_cpu_node(cluster):
        return None
    return max(1, _usable_cores() // world_size)


def thread_speedup(threads: int) -> float:
    """Rule 2: how much faster a rank's kernels run on ``threads`` threads than on one."""
    return 1.0 + (max(1, threads) - 1) * THREAD_EFFICIENCY


def class_thread_speedup(device: Any, op_class: str | None, threads: int) -> float:
    """Rule 2 for one op class on ``device``: its calibrated thread efficiency, else the nominal."""
    if threads <= 1:
        return 1.0
    eff = (getattr(device, "thread_efficiency_by_class", None) or {}).get(op_class or "", THREAD_EFFICIENCY)
    return 1.0 + (threads - 1) * eff
