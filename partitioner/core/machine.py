"""What machine a measurement ran on: the one ``machine_info`` that calibration and benchmarks
record beside their figures (other work on the same cores disturbs every figure, so the load
average is recorded too)."""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Any


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), else what platform knows."""
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return model


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask; the CPU count where there is none)."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def machine_info() -> dict[str, Any]:
    """CPU model, cores (all and usable by this process), memory, OS, Python and load average."""
    usable = usable_cores()
    try:
        import psutil

        memory = int(psutil.virtual_memory().total)
    except ImportError:
        memory = None
    try:
        load = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        load = None
    return {"cpu": cpu_model(), "cores": os.cpu_count(), "usable_cores": usable, "memory_bytes": memory,
            "system": platform.system(), "machine": platform.machine(), "platform": platform.platform(),
            "python": platform.python_version(), "load_average_1_5_15min": load}


def peak_rss_bytes() -> int:
    """This process image's peak resident memory: ``VmHWM`` from ``/proc/self/status``.

    ``getrusage(RUSAGE_SELF).ru_maxrss`` is not that: it survives ``exec`` and starts at the
    forking parent's RSS, so a CLI started from a pytest or benchmark process that holds gigabytes
    reports the parent's figure. ``ru_maxrss`` is the fallback where ``/proc`` is missing."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def rss_bytes() -> int:
    """This process's resident memory now: ``VmRSS`` from ``/proc/self/status`` (0 where unreadable)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def reset_peak_rss() -> bool:
    """Reset ``VmHWM`` to the current RSS (``echo 5 > /proc/self/clear_refs``, Linux ≥ 4.0), so a
    later :func:`peak_rss_bytes` measures only what ran after this point. False where the kernel
    does not allow it (the peak then includes the earlier high-water mark)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False
