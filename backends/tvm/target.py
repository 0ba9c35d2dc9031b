"""Compilation targets for the TVM backend: host detection, presets and user specs.

Rules:
1. A target is a plain JSON dict (``{"kind": "llvm", "mcpu": "znver4"}``); TVM 0.27 builds a
   ``tvm.target.Target`` from it and refuses the old string form.
2. LLVM 22 rejects ``mcpu=native``, so the host CPU is named explicitly: LLVM's own host name
   (``sys::getHostCPUName``) when LLVM knows it, else a name derived from ``/proc/cpuinfo``
   flags (AVX-512 / AVX2 / baseline; aarch64 -> neoverse-n1 or generic). The name is always
   checked against LLVM's CPU list for the target triple.
3. GPU targets cross-compile: no GPU is needed to build for one (see
   :mod:`backends.tvm.cuda_toolchain`). ``--target h100|h200|a100|l4`` names a GPU preset whose
   ``arch`` comes from the cluster presets' table (:func:`partitioner.cluster.gpu_spec`, the one
   table for device numbers); its dict is ``{"kind": "cuda", "arch": "sm_90", "model": "h200",
   ...limits, "host": {...}}``. A JSON cuda target must name its ``arch``; plain ``cuda`` takes the
   arch of the first visible GPU and, on a machine without one, asks for a preset. The host part
   defaults to the build machine's baseline CPU (``x86-64`` / ``generic``), not the build machine's
   own CPU, because the artifact runs on the GPU machine's host.
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


GPU_PRESETS = ("h100", "h200", "a100", "l4")

# Launch limits TVM's own CUDA tags give these GPUs (``tvm.target.Target("nvidia/nvidia-h100")``):
# dlight's GPU rules read them to size thread blocks and shared memory.
_CUDA_LIMITS = {"max_threads_per_block": 1024, "max_num_threads": 1024, "thread_warp_size": 32,
                "max_shared_memory_per_block": 49152, "registers_per_block": 65536}


def gpu_host_target() -> dict[str, Any]:
    """The host half of a GPU target: the build machine architecture's baseline CPU (rule 3)."""
    machine = platform.machine().lower()
    if machine in ("aarch64", "arm64"):
        return {"kind": "llvm", "mcpu": "generic", "mtriple": "aarch64-linux-gnu"}
    return {"kind": "llvm", "mcpu": "x86-64"}


def gpu_preset(name: str) -> dict[str, Any]:
    """The TVM target dict of a GPU preset (``h100``, ``h200``, ``a100``, ``l4``)."""
    from partitioner.cluster import gpu_spec

    return {"kind": "cuda", "arch": gpu_spec(name)["arch"], "model": name, **_CUDA_LIMITS, "host": gpu_host_target()}


def gpu_facts(tdict: dict[str, Any]) -> dict[str, Any] | None:
    """What the manifest records of a GPU target: arch, and the preset's device numbers (memory,
    peak FLOP/s, bandwidth) when the target names a preset ``model``. None for a CPU target."""
    if tdict.get("kind") != "cuda":
        return None
    facts: dict[str, Any] = {"arch": tdict.get("arch")}
    model = tdict.get("model")
    if model in GPU_PRESETS:
        from partitioner.cluster import gpu_spec

        s = gpu_spec(model)
        facts.update(device=model, memory_bytes=s["mem"], memory_bandwidth=s["bw"], peak_flops=dict(s["peak"]))
    return facts


GPUS_PER_NODE = 8  # an HGX/DGX node; the presets' inter-node link joins nodes of this size


def gpu_cluster_spec(spec: str | dict[str, Any] | None, devices: int) -> str | None:
    """The cluster preset the planner uses for a GPU target when no ``--cluster`` is given:
    ``h200`` on 2 devices -> ``"h200x2"``, on 16 -> ``"h200:2x8"`` (NVLink inside a node,
    InfiniBand between; the α-β numbers of :func:`partitioner.cluster.gpu_spec`). A JSON cuda
    target names its preset with ``"model"``, or is matched by ``arch`` (sm_80 -> a100,
    sm_89 -> l4, sm_90 -> h100). None for a CPU target (the planner keeps ``cpu:N``)."""
    if isinstance(spec, str) and spec in GPU_PRESETS:
        name = spec
    else:
        if isinstance(spec, str) and spec.lstrip().startswith("{"):
            try:
                spec = json.loads(spec)
            except json.JSONDecodeError:
                return None
        if not isinstance(spec, dict) or spec.get("kind") != "cuda":
            return None
        from partitioner.cluster import gpu_spec

        name = spec.get("model") if spec.get("model") in GPU_PRESETS else None
        name = name or next((g for g in GPU_PRESETS if gpu_spec(g)["arch"] == spec.get("arch")), None)
        if name is None:
            return None
    n = max(1, int(devices))
    if n > GPUS_PER_NODE and n % GPUS_PER_NODE == 0:
        return f"{name}:{n // GPUS_PER_NODE}x{GPUS_PER_NODE}"
    return f"{name}x{n}"


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
    elif spec in GPU_PRESETS:
        d = gpu_preset(spec)
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
            f"unknown target {spec!r}; use llvm, host, cuda, a GPU ({', '.join(GPU_PRESETS)}), one of "
            f"{', '.join(PRESETS)}, or a JSON dict like "
            "'{\"kind\": \"llvm\", \"mcpu\": \"znver4\"}'"
        )
    if "kind" not in d:
        raise BackendError(f"target {d} has no 'kind'; add \"kind\": \"llvm\" or \"cuda\"")
    if d["kind"] == "cuda":
        d = _complete_cuda(d)
    if d["kind"] == "llvm" and d.get("mcpu") == "native":
        raise BackendError("target mcpu 'native' is rejected by LLVM 22; omit the target (host CPU is detected) or name a CPU")
    return d


def _complete_cuda(d: dict[str, Any]) -> dict[str, Any]:
    """Rule 3: a cuda dict gets an arch (from the visible GPU when absent), launch limits and a
    host; the NVRTC toolchain must be installed (one line naming the extra when it is not)."""
    from .cuda_toolchain import require_cuda_toolchain

    require_cuda_toolchain()
    if not d.get("arch"):
        from backends.cuda_devices import visible_gpus

        gpus = visible_gpus()
        if not gpus:
            raise BackendError(f"target {json.dumps(d)}: no arch given and no GPU visible to take it from; "
                               f"use --target {'|'.join(GPU_PRESETS)} or a JSON dict with \"arch\": \"sm_90\"")
        d["arch"] = gpus[0].arch
    from backends.cuda_devices import parse_arch

    if parse_arch(str(d["arch"])) is None:
        raise BackendError(f"target arch {d['arch']!r} is not a CUDA architecture; write e.g. sm_80 or sm_90")
    for k, v in _CUDA_LIMITS.items():
        d.setdefault(k, v)
    d.setdefault("host", gpu_host_target())
    return d


def resolve_target(spec: str | dict[str, Any] | None) -> Any:
    """A ``tvm.target.Target`` for ``spec`` (see :func:`target_dict`)."""
    import tvm

    d = target_dict(spec)
    try:
        return tvm.target.Target(d)
    except Exception as e:
        raise BackendError(f"target {json.dumps(d)} is not accepted by TVM: {str(e).splitlines()[0] if str(e) else e}") from None
