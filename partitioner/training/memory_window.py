"""Measured memory of a training rank: the peak RSS of its training steps minus its baseline.

Rules (what ``train --bench`` reports, and what the training cost model's ``memory_per_rank``
is compared with):

1. ``process_baseline``: the process's resident memory once the backend's libraries are imported
   and before the model is loaded (:func:`baseline`).
2. ``build``: loading the model and building the step programs is a compile phase (as
   ``partitioner compile`` is for inference): it makes several transient copies of the weights
   (protobuf round trips, shape inference) and imports the builder's modules; the cost model
   does not predict it. Before the first step the build's objects are dropped, the garbage
   collector runs, ``malloc_trim`` gives freed heap back, and the kernel's peak-RSS counter
   (``VmHWM``) is reset (``/proc/self/clear_refs`` = 5, Linux >= 4.0). The build's own peak is
   kept (``build_bytes``).
3. The program's baseline (*before the program loads*): the RSS at that reset minus the bytes of
   the state the runners hold (weights, optimizer state, BN statistics, already resident then).
   ``training_bytes`` = the peak RSS of the steps minus this baseline: the resident state plus
   every buffer the steps allocate. That is what the cost model predicts per rank.
   ``process_bytes`` = the same peak minus rule 1's baseline (imports, sessions and the
   build's leftover heap included).
4. The peak is read after each epoch's last step, before the checkpoint (where rank 0 gathers
   every stage's state to write a 1-rank checkpoint), and reset after it; the maximum over
   epochs counts.
5. Only an armed window (``train --bench``, an MPI training rank) drops garbage and resets the
   counter: a plain run in a user's process leaves its peak-RSS figures alone.
6. Where the counter cannot be reset (no ``/proc``, an old kernel) ``window_reset`` is false and
   the peak includes the build: an upper bound.
"""

from __future__ import annotations

import ctypes
import gc
from dataclasses import asdict, dataclass
from typing import Any


def rss_bytes() -> int:
    """Resident memory now (``VmRSS``)."""
    from partitioner.core.machine import rss_bytes as now

    return now()


def peak_bytes() -> int:
    """Peak resident memory since start or the last reset (``VmHWM``)."""
    from partitioner.core.machine import peak_rss_bytes

    return peak_rss_bytes()


def release() -> None:
    """Collect garbage and return freed heap pages to the kernel (glibc ``malloc_trim``)."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def reset_peak() -> bool:
    """Rule 2: reset ``VmHWM`` to the current RSS; False where the kernel does not allow it."""
    from partitioner.core.machine import reset_peak_rss

    return reset_peak_rss()


def baseline(backend: str) -> int:
    """Rule 1: RSS with the backend's libraries imported, before any model is loaded."""
    try:
        import onnxruntime  # noqa: F401

        if backend == "tvm":
            import tvm  # noqa: F401
    except ImportError:
        pass
    return rss_bytes()


@dataclass
class MemoryWindow:
    """One rank's measured memory (rules 1-6); bytes."""

    process_baseline_bytes: int = 0
    build_peak_bytes: int = 0
    window_start_bytes: int = 0
    state_bytes: int = 0
    training_peak_bytes: int = 0
    window_reset: bool = False
    armed: bool = False  # only a measured run (train --bench, an MPI rank) resets the process's peak

    def start_steps(self, state_bytes: int) -> None:
        """Rules 2-3, called once the runners are built (``state_bytes``: what they hold)."""
        if not self.armed:
            return
        self.build_peak_bytes = max(self.build_peak_bytes, peak_bytes())
        release()
        self.window_reset = reset_peak()
        self.window_start_bytes, self.state_bytes = rss_bytes(), int(state_bytes)

    def end_steps(self) -> None:
        """Rule 4, after an epoch's last step (before its checkpoint)."""
        if not self.armed:
            return
        self.training_peak_bytes = max(self.training_peak_bytes, peak_bytes())

    def after_checkpoint(self) -> None:
        if not self.armed:
            return
        release()
        reset_peak()

    @property
    def training_bytes(self) -> int:
        """Rule 3."""
        return self.training_peak_bytes - (self.window_start_bytes - self.state_bytes)

    def to_json(self, rank: int) -> dict[str, Any]:
        doc = asdict(self)
        doc.update(rank=rank, training_bytes=self.training_bytes,
                   process_bytes=self.training_peak_bytes - self.process_baseline_bytes,
                   build_bytes=self.build_peak_bytes - self.process_baseline_bytes)
        return doc


#: the window of this process's run (``train --bench`` and the MPI worker arm it and read it)
CURRENT = MemoryWindow()
