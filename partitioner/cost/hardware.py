"""Nominal hardware numbers: the cost model's defaults before calibration (COST_MODEL.md).

:mod:`partitioner.cluster` builds its presets from these; ``partitioner calibrate`` replaces the
CPU figures with measured ones. Links are ``(name, alpha_s, beta_s_per_byte)``: a message of n
bytes takes alpha + n * beta seconds.
"""

from __future__ import annotations

from typing import Any

#: a device class may beat the DRAM roof (efficiency > 1) when its kernels run from cache.
MAX_CLASS_EFFICIENCY = 16.0

#: per GPU kind: CUDA arch, peak FLOP/s per dtype, memory, bandwidth, intra-node link, inter-node
#: link (per GPU). The one table both the cluster presets and the GPU compile targets read.
GPU_SPECS: dict[str, dict[str, Any]] = {
    "h100": {"arch": "sm_90", "peak": {"float32": 67e12, "float16": 989e12, "bfloat16": 989e12, "int8": 1979e12},
             "mem": 80e9, "bw": 3.35e12, "intra": ("nvlink4", 3e-6, 1 / 450e9),
             "inter": ("ib-ndr-400g", 5e-6, 1 / 50e9)},
    "h200": {"arch": "sm_90", "peak": {"float32": 67e12, "float16": 989e12, "bfloat16": 989e12, "int8": 1979e12},
             "mem": 141e9, "bw": 4.8e12, "intra": ("nvlink4", 3e-6, 1 / 450e9),
             "inter": ("ib-ndr-400g", 5e-6, 1 / 50e9)},
    "a100": {"arch": "sm_80", "peak": {"float32": 19.5e12, "float16": 312e12, "bfloat16": 312e12, "int8": 624e12},
             "mem": 80e9, "bw": 2.039e12, "intra": ("nvlink3", 3e-6, 1 / 300e9),
             "inter": ("ib-hdr-200g", 5e-6, 1 / 25e9)},
    "l4": {"arch": "sm_89", "peak": {"float32": 30.3e12, "float16": 121e12, "bfloat16": 121e12, "int8": 242e12},
           "mem": 24e9, "bw": 300e9, "intra": ("pcie4", 10e-6, 1 / 25e9),
           "inter": ("ethernet-100g", 20e-6, 1 / 12.5e9)},
}
GPU_EFFICIENCY = 0.7
GPU_LAUNCH_OVERHEAD_S = 5e-6

CPU_LINK = ("shm", 1e-6, 1 / 5e9)  # MPI over shared memory: ~1 µs, ~5 GB/s
CPU_CORE_BANDWIDTH = 20e9  # one core streaming from DRAM, B/s (nominal; calibrate measures it)
CPU_LAUNCH_OVERHEAD_S = 2e-6  # per-operator dispatch in ONNX Runtime / a TVM VM, nominal
