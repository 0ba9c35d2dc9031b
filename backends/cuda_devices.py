"""Which CUDA GPUs this machine has, asked of the driver alone (no TVM, no CUDA toolkit).

Rules:
1. The probe loads the driver library ``libcuda.so.1`` with ctypes and calls ``cuInit``,
   ``cuDeviceGetCount``, ``cuDeviceGetName`` and ``cuDeviceGetAttribute`` (compute capability).
   No driver, a failing ``cuInit`` (no device, or ``CUDA_VISIBLE_DEVICES=""``) or zero devices all
   mean "no GPU". Nothing is loaded from an artifact to answer, so ``run`` can refuse before it
   loads any library.
2. A TVM CUDA build holds cubins (NVRTC, ``TVM_CUDA_COMPILE_MODE=nvrtc``) for one ``sm_XY``.
   CUDA's binary compatibility rule: a cubin for ``sm_XY`` runs on a GPU of compute capability
   ``X.Z`` with ``Z >= Y`` (same major version), never across major versions. So an ``sm_80`` build
   runs on an A100 (8.0), an A10 (8.6) and an L4 (8.9); an ``sm_90`` build only on 9.x GPUs.
3. A GPU's index for rank ``r`` is ``local_rank % device_count`` (ranks of one host share its GPUs
   round-robin; with ``CUDA_VISIBLE_DEVICES`` per rank, the index is 0).
"""

from __future__ import annotations

import ctypes
import re
from dataclasses import dataclass

_CU_ATTR_CC_MAJOR = 75  # CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR
_CU_ATTR_CC_MINOR = 76  # CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR


@dataclass(frozen=True)
class CudaDevice:
    """One visible GPU: its index, name and compute capability."""

    index: int
    name: str
    major: int
    minor: int

    @property
    def arch(self) -> str:
        return f"sm_{self.major}{self.minor}"

    def to_json(self) -> dict[str, object]:
        return {"index": self.index, "name": self.name, "arch": self.arch}


def _load_driver() -> ctypes.CDLL | None:
    for name in ("libcuda.so.1", "libcuda.so"):
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    return None


def visible_gpus() -> list[CudaDevice]:
    """Every GPU the CUDA driver reports, in index order; [] when there is no driver or GPU."""
    lib = _load_driver()
    if lib is None:
        return []
    try:
        if lib.cuInit(0) != 0:
            return []
        count = ctypes.c_int(0)
        if lib.cuDeviceGetCount(ctypes.byref(count)) != 0:
            return []
        found = []
        for i in range(count.value):
            dev = ctypes.c_int(0)
            if lib.cuDeviceGet(ctypes.byref(dev), i) != 0:
                continue
            name = ctypes.create_string_buffer(256)
            lib.cuDeviceGetName(name, 256, dev)
            major, minor = ctypes.c_int(0), ctypes.c_int(0)
            lib.cuDeviceGetAttribute(ctypes.byref(major), _CU_ATTR_CC_MAJOR, dev)
            lib.cuDeviceGetAttribute(ctypes.byref(minor), _CU_ATTR_CC_MINOR, dev)
            found.append(CudaDevice(i, name.value.decode(errors="replace"), major.value, minor.value))
        return found
    except AttributeError:  # a stub library without these symbols
        return []


def parse_arch(arch: str) -> tuple[int, int] | None:
    """``"sm_90"`` / ``"sm_90a"`` / ``"sm_89"`` -> (9, 0) / (9, 0) / (8, 9); None when unreadable."""
    m = re.fullmatch(r"(?:sm|compute)_(\d+?)(\d)a?", str(arch).strip())
    return (int(m.group(1)), int(m.group(2))) if m else None


def arch_runs_on(arch: str, device: CudaDevice) -> bool:
    """Rule 2: does a cubin built for ``arch`` run on ``device``?"""
    want = parse_arch(arch)
    if want is None:
        return False
    return device.major == want[0] and device.minor >= want[1]


def gpu_mismatch(arch: str | None, gpus: list[CudaDevice] | None = None) -> str | None:
    """Why an artifact built for ``arch`` cannot run on this machine (one phrase), or None."""
    gpus = visible_gpus() if gpus is None else gpus
    if not gpus:
        return f"it was built for a CUDA GPU ({arch or 'unknown arch'}) and this machine has none visible"
    if arch is None:
        return None
    if not any(arch_runs_on(arch, g) for g in gpus):
        have = ", ".join(f"{g.name} ({g.arch})" for g in gpus)
        return f"it was built for {arch} and this machine's GPUs are {have}; recompile with a matching --target"
    return None


def device_index(local_rank: int, gpus: int) -> int:
    """Rule 3."""
    return local_rank % gpus if gpus > 0 else 0


def artifact_gpu_arch(manifest: dict) -> tuple[bool, str | None]:
    """``(built for a GPU, its arch)`` from a manifest: the top-level target, else any rank's build
    target (a manifest written without ``--target`` records the target in the rank facts only)."""
    targets = [manifest.get("target")] + [(r.get("build") or {}).get("target") for r in manifest.get("ranks", [])]
    for t in targets:
        if isinstance(t, dict) and t.get("kind") == "cuda":
            return True, (str(t["arch"]) if t.get("arch") else None)
    return False, None


def require_matching_gpu(manifest: dict, where: str) -> None:
    """Refuse (one line, exit 2) to run a GPU artifact here when no visible GPU can run its
    cubins (rule 2); a CPU artifact passes. Called before any library is loaded."""
    from partitioner.core.errors import BackendError

    is_gpu, arch = artifact_gpu_arch(manifest)
    if not is_gpu:
        return
    problem = gpu_mismatch(arch)
    if problem is not None:
        raise BackendError(f"{where}: cannot run here: {problem}")
