"""Compilation targets for the TVM backend: host detection, presets and user specs.

Rules:
1. A target is a plain JSON dict (``{"kind": "llvm", "mcpu": "znver4"}``); TVM 0.27 builds a
   ``tvm.target.Target`` from it and refuses the old string form.
2. LLVM 22 rejects ``mcpu=native``, so the host CPU is named explicitly: LLVM's own host name
   (``sys::getHostCPUName``) when LLVM knows it, else a name derived from ``/proc/cpuinfo``
   flags (AVX-512 / AVX2 / baseline; aarch64 -> neoverse-n1 or generic). The name is always
   checked against LLVM's CPU list for the target triple.
3. ``"cuda"`` is only accepted when a CUDA device is present; otherwise a BackendError says so.
"""

from __future__ import annotations

import json
import platform
from pathlib import Path
from typing import Any

from partitioner.core.errors import BackendError

CPUINFO = Path("/proc/cpuinfo")

# Named targets a user may pass as ``--target NAME``.
PRESETS: dict[str, dict[str, Any]] = {
    "x86-64": {"kind": "llvm", "mcpu": "x86-64"},
    "x86-64-v3": {"kind": "llvm", "mcpu": "x86-64-v3"},
    "haswell": {"kind": "llvm", "mcpu": "haswell"},
    "skylake-avx512": {"kind": "llvm", "mcpu": "skylake-avx512"},
    "icelake-server": {"kind": "llvm", "mcpu": "icelake-server"},
    "sapphirerapids": {"kind": "llvm", "mcpu": "sapphirerapids"},
    "znver2": {"kind": "llvm", "mcpu": "znver2"},
    "znver3": {"kind": "llvm", "mcpu": "znver3"},
    "znver4": {"kind": "llvm", "mcpu": "znver4"},
    "neoverse-n1": {"kind": "llvm", "mcpu": "neoverse-n1", "mtriple": "aarch64-linux-gnu"},
}


def _cpuinfo() -> tuple[str, set[str], str]:
    """(model name, flag set, vendor id) of the first CPU in /proc/cpuinfo ('' / empty if absent)."""
    try:
        text = CPUINFO.read_text()
    except OSError:
        return "", set(), ""
    model, flags, vendor = "", set(), ""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip().lower()
        if key == "model name" and not model:
            model = value.strip()
        elif key in ("flags", "features") and not flags:
            flags = set(value.split())
        elif key == "vendor_id" and not vendor:
            vendor = value.strip()
    return model, flags, vendor


def cpu_from_cpuinfo(model: str, flags: set[str], vendor: str, machine: str) -> str:
    """Map cpuinfo facts to an LLVM CPU name (a conservative choice that runs on that CPU)."""
    if machine in ("aarch64", "arm64"):
        return "neoverse-n1" if {"asimd", "atomics"} <= flags else "generic"
    amd = "amd" in vendor.lower() or "amd" in model.lower()
    if "avx512f" in flags:
        if amd:
            return "znver4"
        if "amx_tile" in flags or "avx512_fp16" in flags:
            return "sapphirerapids"
        if "avx512_vnni" in flags and "avx512vbmi" in flags:
            return "icelake-server"
        return "skylake-avx512"
    if "avx2" in flags:
        return "znver2" if amd else "haswell"
    return "x86-64"


def _llvm_accepts(cpu: str, triple: str) -> bool:
    from tvm.target import codegen

    try:
        return bool(codegen.llvm_is_valid_cpu(cpu, triple))
    except Exception:  # an LLVM without this query: trust the name
        return True


def detect_host_target() -> dict[str, Any]:
    """The host CPU as an LLVM target dict, e.g. ``{"kind": "llvm", "mcpu": "znver4"}``."""
    from tvm.target import codegen

    machine = platform.machine().lower()
    triple = str(codegen.llvm_get_system_triple())
    model, flags, vendor = _cpuinfo()
    candidates = []
    try:
        candidates.append(str(codegen.llvm_get_system_cpu()))
    except Exception:
        pass
    candidates.append(cpu_from_cpuinfo(model, flags, vendor, machine))
    for cpu in candidates:
        if cpu and cpu not in ("generic", "native") and _llvm_accepts(cpu, triple):
            return {"kind": "llvm", "mcpu": cpu}
    return {"kind": "llvm", "mcpu": "generic" if machine in ("aarch64", "arm64") else "x86-64"}


def cuda_available() -> bool:
    import tvm

    try:
        return bool(tvm.cuda(0).exist)
    except Exception:
        return False


def target_dict(spec: str | dict[str, Any] | None) -> dict[str, Any]:
    """Resolve a user spec to a target dict (None/'llvm'/'host', 'cuda', a preset, or JSON)."""
    if spec is None or spec in ("", "llvm", "host", "cpu"):
        return detect_host_target()
    if isinstance(spec, dict):
        d = dict(spec)
    elif spec == "cuda":
        d = {"kind": "cuda"}
    elif spec in PRESETS:
        d = dict(PRESETS[spec])
    elif spec.lstrip().startswith("{"):
        try:
            d = json.loads(spec)
        except json.JSONDecodeError as e:
            raise BackendError(f"target {spec!r} is not valid JSON ({e.msg}); write e.g. '{{\"kind\": \"llvm\", \"mcpu\": \"znver4\"}}'") from None
        if not isinstance(d, dict):
            raise BackendError(f"target {spec!r} must be a JSON object with a 'kind' key")
    else:
        raise BackendError(
            f"unknown target {spec!r}; use llvm, host, cuda, one of {', '.join(PRESETS)}, or a JSON dict like "
            "'{\"kind\": \"llvm\", \"mcpu\": \"znver4\"}'"
        )
    if "kind" not in d:
        raise BackendError(f"target {d} has no 'kind'; add \"kind\": \"llvm\" or \"cuda\"")
    if d["kind"] == "cuda" and not cuda_available():
        raise BackendError("target cuda: no CUDA GPU is visible on this machine; use --target llvm (the host CPU)")
    if d["kind"] == "llvm" and d.get("mcpu") == "native":
        raise BackendError("target mcpu 'native' is rejected by LLVM 22; omit the target (host CPU is detected) or name a CPU")
    return d


def resolve_target(spec: str | dict[str, Any] | None) -> Any:
    """A ``tvm.target.Target`` for ``spec`` (see :func:`target_dict`)."""
    import tvm

    d = target_dict(spec)
    try:
        return tvm.target.Target(d)
    except Exception as e:
        raise BackendError(f"target {json.dumps(d)} is not accepted by TVM: {str(e).splitlines()[0] if str(e) else e}") from None
