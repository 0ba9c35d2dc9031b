"""Cluster descriptions: devices, which devices share a node, and the link levels between them.

A :class:`Cluster` is plain data. Rank ``i`` of a plan runs on ``devices[i]``. ``nodes`` groups
device indices that share a machine; ``levels[0]`` is the link inside a node and ``levels[1]``
(when present) the network between nodes. The file format is described in
``docs/cluster_format.md``; :meth:`Cluster.resolve` accepts a preset name or a file path.

Invariants (checked on construction): at least one device and one level; every device index
appears in exactly one node; all numbers are finite and non-negative, peaks and bandwidths > 0.

Published numbers used by the presets (dense, no sparsity):

- NVIDIA H100 SXM5 80GB (H100 datasheet, 2023): 989 TFLOP/s BF16/FP16 tensor, 67 TFLOP/s FP32,
  1979 TOPS INT8, 80 GB HBM3 at 3.35 TB/s.
- NVIDIA H200 SXM 141GB (H200 datasheet, 2024): same compute as H100 SXM, 141 GB HBM3e at
  4.8 TB/s.
- NVIDIA A100 SXM4 80GB (A100 datasheet, 2021): 312 TFLOP/s BF16/FP16 tensor, 19.5 TFLOP/s
  FP32, 624 TOPS INT8, 80 GB HBM2e at 2.039 TB/s.
- NVLink 4 (H100/H200 HGX): 900 GB/s bidirectional per GPU = 450 GB/s each way; NVLink 3
  (A100 HGX): 600 GB/s bidirectional = 300 GB/s each way.
- Networks: one 400 Gb/s NDR InfiniBand NIC per GPU (H200 DGX) = 50 GB/s; one 200 Gb/s HDR
  NIC per GPU (DGX A100) = 25 GB/s.
- NVIDIA L4 (L4 datasheet, 2023): 30.3 TFLOP/s FP32, 121 TFLOP/s FP16/BF16 tensor, 242 TOPS
  INT8 (dense), 24 GB GDDR6 at 300 GB/s; no NVLink: PCIe Gen4 x16 (~25 GB/s achieved each way),
  100 Gb/s Ethernet between nodes (12.5 GB/s).
- ``arch``: the CUDA compute capability the TVM target compiles for (``backends/tvm/target.py``
  reads this table: sm_90 Hopper, sm_80 Ampere A100, sm_89 Ada L4).
- Edge: a Cortex-A78-class CPU cluster (~50 GFLOP/s FP32) and a Jetson-Orin-class GPU
  (~5 TFLOP/s FP32, ~10 FP16) on 1 Gb/s Ethernet.

GPU presets use an efficiency of 0.7 (a typical achieved fraction of peak for large GEMMs); CPU
presets use 1.0 with the nominal peak, and ``partitioner calibrate`` replaces both with measured
numbers.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, Iterable, Sequence

from partitioner.core.errors import ClusterError
from partitioner.cost import hardware

FORMAT = "partitioner.cluster/1"
DTYPES = ("float32", "float16", "bfloat16", "int8")
SELF_LINK_NAME = "self"


OP_CLASSES = ("gemm", "conv", "depthwise_conv", "elementwise", "norm", "reduction", "pool", "data_movement")
#: the training probes' classes (calibrate.backward_kernels): the backward's contractions run at
#: these efficiencies in the training cost model (cost/training.py rule 1), never in inference
BACKWARD_CLASSES = ("gemm_backward", "conv_backward")
#: the out-of-cache GEMM probe's class (calibrate.micro_kernels), read by the roofline's
#: working-set rule for ``gemm`` ops (cost/roofline.py rule 5), never an op's class
GEMM_SIZE_CLASSES = ("gemm_large",)
#: the out-of-cache elementwise and data-movement probes' classes (calibrate.micro_kernels),
#: read by the roofline's working-set rule for a training step's nodes (cost/roofline.py rule 7)
MEMORY_SIZE_CLASSES = ("elementwise_large", "data_movement_large")
#: the small-map conv probes' classes (calibrate.backward_kernels), read by the roofline's
#: output-pixels rule for ``conv_backward`` and ``conv_train`` ops (cost/roofline.py rule 6)
CONV_SIZE_CLASSES = ("conv_backward_px16", "conv_backward_px4", "conv_train_px16", "conv_train_px4")
#: the training probes' forward conv and GEMM pair with their weights as an input, as a training
#: step runs them (calibrate.backward_kernels; cost/training.py rule 1)
TRAIN_FORWARD_CLASSES = ("conv_train", "gemm_train", "gemm_large_train")
#: kernels a training step runs whose backend's rate is their own: the ReLU gradient's Where and
#: a batched weight gradient's sum over its batch (calibrate.backward_kernels; cost/training.py rule 1)
TRAIN_OP_CLASSES = ("where", "reduce_batch")
CALIBRATED_CLASSES = (OP_CLASSES + BACKWARD_CLASSES + GEMM_SIZE_CLASSES + CONV_SIZE_CLASSES + TRAIN_FORWARD_CLASSES
                      + TRAIN_OP_CLASSES + MEMORY_SIZE_CLASSES)
MAX_CLASS_EFFICIENCY = hardware.MAX_CLASS_EFFICIENCY  # a class may beat the DRAM roof from cache


@dataclass(frozen=True)
class Device:
    """One device. ``peak_flops`` maps a dtype name to FLOP/s; ``memory_bandwidth`` is in B/s.

    ``efficiency_by_class`` maps an op class (:data:`OP_CLASSES`, see
    :func:`partitioner.cost.ops.op_class`) to the achieved fraction of the roofline for that
    class's kernels; classes not listed use ``efficiency``. Class values are measured by
    ``partitioner calibrate`` on micro-kernels and may exceed 1 (up to
    :data:`MAX_CLASS_EFFICIENCY`) when small kernels run from cache faster than the measured
    DRAM bandwidth."""

    name: str
    kind: str
    peak_flops: dict[str, float] = field(hash=False)
    memory_bytes: float
    memory_bandwidth: float
    efficiency: float = 1.0
    launch_overhead_s: float = 0.0
    efficiency_by_class: dict[str, float] = field(default_factory=dict, hash=False)
    #: seconds per run of a compiled program (one call per micro-batch: argument and result
    #: handling, VM entry), beside the per-kernel launch overhead; measured by calibration
    call_overhead_s: float = 0.0
    #: the backend whose runtime runs the rank ("tvm", "onnxruntime"; "" nominal): which rule of
    #: :data:`partitioner.cost.memory.RUNTIME_MEMORY` predicts its peak memory
    runtime: str = ""
    #: seconds per communication op the rank runs, beside the transfer (the compiled program's
    #: call out to the runtime's comm handler); measured by calibration (probe 3c)
    comm_op_overhead_s: float = 0.0
    #: per op class, the share of each extra thread of a rank that its kernels turn into speed
    #: (calibration probe 6; classes not listed use cost.threads.THREAD_EFFICIENCY)
    thread_efficiency_by_class: dict[str, float] = field(default_factory=dict, hash=False)
    #: the share of ``memory_bandwidth`` each core keeps while every core of its node copies at
    #: once (calibration probe 7; 1.0: nominal, not measured): ranks of one node that run at the
    #: same time share the memory system (cost.training rule 11)
    co_run_bandwidth: float = 1.0
    #: the same share for a copy whose working set stays in the node's caches (probe 7's second
    #: copy, :data:`partitioner.calibrate.CO_RUN_CACHED_BYTES` moved; 0: not measured, every
    #: working set at ``co_run_bandwidth``): the roofline's rule 8 interpolates by working set
    co_run_cached_bandwidth: float = 0.0
    #: set by :func:`partitioner.cost.training.co_located` on the device of a rank that runs beside
    #: others on its node (with ``memory_bandwidth`` already at the ``co_run_bandwidth`` share);
    #: never written to a cluster file
    co_running: bool = False

    def class_efficiency(self, op_class: str | None) -> float:
        """The efficiency for ``op_class``; ``efficiency`` when the class is None or not listed."""
        if op_class is None:
            return self.efficiency
        return self.efficiency_by_class.get(op_class, self.efficiency)

    def peak(self, dtype: str = "float32") -> float:
        """Peak FLOP/s for ``dtype``; dtypes not listed fall back to float32."""
        p = self.peak_flops.get(dtype)
        if p is None:
            p = self.peak_flops.get("float32") or max(self.peak_flops.values())
        return p

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "kind": self.kind, "peak_flops": dict(self.peak_flops),
                "memory_bytes": self.memory_bytes, "memory_bandwidth": self.memory_bandwidth,
                "efficiency": self.efficiency, "launch_overhead_s": self.launch_overhead_s,
                **({"efficiency_by_class": dict(self.efficiency_by_class)} if self.efficiency_by_class else {}),
                **({"call_overhead_s": self.call_overhead_s} if self.call_overhead_s else {}),
                **({"runtime": self.runtime} if self.runtime else {}),
                **({"comm_op_overhead_s": self.comm_op_overhead_s} if self.comm_op_overhead_s else {}),
                **({"thread_efficiency_by_class": dict(self.thread_efficiency_by_class)}
                   if self.thread_efficiency_by_class else {}),
                **({"co_run_bandwidth": self.co_run_bandwidth} if self.co_run_bandwidth != 1.0 else {}),
                **({"co_run_cached_bandwidth": self.co_run_cached_bandwidth}
                   if self.co_run_cached_bandwidth else {})}


@dataclass(frozen=True)
class LinkLevel:
    """A link class: a message of n bytes takes ``alpha_s + n * beta_s_per_byte`` seconds."""

    name: str
    alpha_s: float
    beta_s_per_byte: float

    @property
    def bandwidth(self) -> float:
        return 1.0 / self.beta_s_per_byte if self.beta_s_per_byte > 0 else math.inf

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "alpha_s": self.alpha_s, "beta_s_per_byte": self.beta_s_per_byte}


SELF_LINK = LinkLevel(SELF_LINK_NAME, 0.0, 0.0)


@dataclass(frozen=True)
class Cluster:
    """Devices, their grouping into nodes, and link levels (0 = intra-node, 1 = inter-node)."""

    name: str
    devices: tuple[Device, ...]
    nodes: tuple[tuple[int, ...], ...]
    levels: tuple[LinkLevel, ...]
    notes: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        where = f"cluster {self.name!r}"
        if not self.devices:
            raise ClusterError(f"{where}: no devices")
        if not self.levels:
            raise ClusterError(f"{where}: no link levels")
        seen = sorted(i for node in self.nodes for i in node)
        if seen != list(range(len(self.devices))):
            raise ClusterError(f"{where}: 'nodes' must list every device index 0..{len(self.devices) - 1} "
                               f"exactly once (got {seen[:16]}{'...' if len(seen) > 16 else ''})")
        if len(self.nodes) > 1 and len(self.levels) < 2:
            raise ClusterError(f"{where}: {len(self.nodes)} nodes need two link levels (intra, inter)")
        for d in self.devices:
            if not d.peak_flops or any(not (v > 0 and math.isfinite(v)) for v in d.peak_flops.values()):
                raise ClusterError(f"{where}: device {d.name!r}: peak_flops must be positive numbers")
            for fname in ("memory_bytes", "memory_bandwidth"):
                v = getattr(d, fname)
                if not (v > 0 and math.isfinite(v)):
                    raise ClusterError(f"{where}: device {d.name!r}: {fname} must be a positive number")
            if not (0 < d.efficiency <= 1):
                raise ClusterError(f"{where}: device {d.name!r}: efficiency must be in (0, 1]")
            if not (0 < d.co_run_bandwidth <= 1):
                raise ClusterError(f"{where}: device {d.name!r}: co_run_bandwidth must be in (0, 1]")
            if not (0 <= d.co_run_cached_bandwidth <= 1):
                raise ClusterError(f"{where}: device {d.name!r}: co_run_cached_bandwidth must be in [0, 1] "
                                   "(0: not measured)")
            for fname in ("launch_overhead_s", "call_overhead_s", "comm_op_overhead_s"):
                if not (getattr(d, fname) >= 0 and math.isfinite(getattr(d, fname))):
                    raise ClusterError(f"{where}: device {d.name!r}: {fname} must be >= 0")
            for cls_name, v in d.efficiency_by_class.items():
                if cls_name not in CALIBRATED_CLASSES:
                    raise ClusterError(f"{where}: device {d.name!r}: efficiency_by_class has unknown class "
                                       f"{cls_name!r}; use {', '.join(CALIBRATED_CLASSES)}")
                if not (isinstance(v, (int, float)) and 0 < v <= MAX_CLASS_EFFICIENCY):
                    raise ClusterError(f"{where}: device {d.name!r}: efficiency_by_class[{cls_name!r}] must be "
                                       f"in (0, {MAX_CLASS_EFFICIENCY:g}]")
        for lv in self.levels:
            if not (lv.alpha_s >= 0 and lv.beta_s_per_byte >= 0 and math.isfinite(lv.alpha_s)
                    and math.isfinite(lv.beta_s_per_byte)):
                raise ClusterError(f"{where}: link level {lv.name!r}: alpha_s and beta_s_per_byte must be >= 0")

    # ---- topology ----------------------------------------------------------------------------

    @property
    def size(self) -> int:
        return len(self.devices)

    @cached_property
    def node_of(self) -> tuple[int, ...]:
        """node_of[rank] = index of the node holding that device."""
        out = [0] * len(self.devices)
        for k, node in enumerate(self.nodes):
            for i in node:
                out[i] = k
        return tuple(out)

    @property
    def intra(self) -> LinkLevel:
        return self.levels[0]

    @property
    def inter(self) -> LinkLevel:
        return self.levels[-1]

    def _check_rank(self, r: int) -> None:
        if not 0 <= r < len(self.devices):
            raise ClusterError(f"cluster {self.name!r} has {len(self.devices)} devices: no rank {r}")

    def link(self, a: int, b: int) -> LinkLevel:
        """The link a message from device ``a`` to device ``b`` uses (zero cost when a == b)."""
        self._check_rank(a)
        self._check_rank(b)
        if a == b:
            return SELF_LINK
        return self.levels[0] if self.node_of[a] == self.node_of[b] else self.levels[1]

    def group_level(self, ranks: Iterable[int]) -> LinkLevel:
        """The slowest link level a group spans: self (one rank), intra-node, or inter-node."""
        rs = sorted(set(ranks))
        for r in rs:
            self._check_rank(r)
        if len(rs) <= 1:
            return SELF_LINK
        nodes = {self.node_of[r] for r in rs}
        return self.levels[0] if len(nodes) == 1 else self.levels[1]

    def ranks_by_node(self, ranks: Iterable[int]) -> list[list[int]]:
        """The group's ranks split by node, in node order."""
        by: dict[int, list[int]] = {}
        for r in sorted(set(ranks)):
            by.setdefault(self.node_of[r], []).append(r)
        return [by[k] for k in sorted(by)]

    def subset(self, ranks: Sequence[int], name: str | None = None) -> Cluster:
        """A cluster of the given devices (renumbered 0..len-1), keeping their node grouping."""
        for r in ranks:
            self._check_rank(r)
        pos = {r: i for i, r in enumerate(ranks)}
        nodes = tuple(tuple(pos[r] for r in node if r in pos) for node in self.nodes)
        nodes = tuple(n for n in nodes if n)
        levels = self.levels if len(nodes) > 1 else self.levels[:1]
        return Cluster(name or f"{self.name}[{len(ranks)}]", tuple(self.devices[r] for r in ranks),
                       nodes, levels, self.notes)

    # ---- JSON --------------------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "format": FORMAT,
            "name": self.name,
            "devices": [d.to_json() for d in self.devices],
            "nodes": [list(n) for n in self.nodes],
            "levels": [lv.to_json() for lv in self.levels],
        }
        if self.notes:
            out["notes"] = self.notes
        return out

    @classmethod
    def from_json(cls, data: Any, source: str = "<json>") -> Cluster:
        """Build from the JSON format of docs/cluster_format.md; errors name ``source`` and the field."""
        return _parse(data, source)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Cluster:
        p = Path(path)
        try:
            text = p.read_text(encoding="utf-8")
        except OSError as exc:
            raise ClusterError(f"cannot read cluster file {str(p)!r}: {exc.strerror or exc}") from None
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ClusterError(f"cluster file {str(p)!r} is not valid JSON: {exc.msg} at line {exc.lineno}") from None
        return _parse(data, str(p))

    def save(self, path: str | os.PathLike[str]) -> None:
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps(self.to_json(), indent=2) + "\n", encoding="utf-8")

    @classmethod
    def resolve(cls, spec: str, backend: str | None = None) -> Cluster:
        """A preset name (``cpu:N``, ``local``, ``h100x8``, ``h200x8``, ``h200:4x8``, ``a100:16x8``,
        ``edge``, or ``h100|h200|a100`` as ``NAMExG`` / ``NAME:NxG``) or a cluster JSON file path."""
        spec = str(spec).strip()
        if spec.endswith(".json") or os.sep in spec:
            return cls.load(spec)
        try:
            return preset(spec, backend)
        except ClusterError:
            if os.path.isfile(spec):
                return cls.load(spec)
            raise


# ---- parsing ---------------------------------------------------------------------------------

def _num(obj: dict[str, Any], key: str, where: str, default: float | None = None) -> float:
    if key not in obj:
        if default is None:
            raise ClusterError(f"{where}: missing field {key!r}")
        return default
    v = obj[key]
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ClusterError(f"{where}: field {key!r} must be a number, got {v!r}")
    return float(v)


def _parse(data: Any, source: str) -> Cluster:
    if not isinstance(data, dict):
        raise ClusterError(f"cluster file {source!r}: the top level must be a JSON object")
    fmt = data.get("format", FORMAT)
    if fmt != FORMAT:
        raise ClusterError(f"cluster file {source!r}: field 'format' is {fmt!r}, expected {FORMAT!r}")
    devs = data.get("devices")
    if not isinstance(devs, list) or not devs:
        raise ClusterError(f"cluster file {source!r}: field 'devices' must be a non-empty list")
    devices: list[Device] = []
    for i, d in enumerate(devs):
        where = f"cluster file {source!r}: devices[{i}]"
        if not isinstance(d, dict):
            raise ClusterError(f"{where} must be an object")
        pf = d.get("peak_flops")
        if isinstance(pf, (int, float)) and not isinstance(pf, bool):
            pf = {"float32": float(pf)}
        if not isinstance(pf, dict) or not pf:
            raise ClusterError(f"{where}: field 'peak_flops' must be an object such as {{\"float32\": 1e11}}")
        peak = {str(k): _num(pf, k, f"{where}.peak_flops") for k in pf}
        ebc = d.get("efficiency_by_class", {})
        if not isinstance(ebc, dict):
            raise ClusterError(f"{where}: field 'efficiency_by_class' must be an object such as {{\"conv\": 0.5}}")
        by_class = {str(k): _num(ebc, k, f"{where}.efficiency_by_class") for k in ebc}
        count = d.get("count", 1)
        if not isinstance(count, int) or isinstance(count, bool) or count < 1:
            raise ClusterError(f"{where}: field 'count' must be a positive integer")
        name = d.get("name", d.get("kind", f"dev{i}"))
        if not isinstance(name, str):
            raise ClusterError(f"{where}: field 'name' must be a string")
        for c in range(count):
            devices.append(Device(
                name=name if count == 1 else f"{name}{c}",
                kind=str(d.get("kind", "cpu")),
                peak_flops=peak,
                memory_bytes=_num(d, "memory_bytes", where),
                memory_bandwidth=_num(d, "memory_bandwidth", where),
                efficiency=_num(d, "efficiency", where, 1.0),
                launch_overhead_s=_num(d, "launch_overhead_s", where, 0.0),
                efficiency_by_class=dict(by_class),
                call_overhead_s=_num(d, "call_overhead_s", where, 0.0),
                runtime=str(d.get("runtime", "")),
                comm_op_overhead_s=_num(d, "comm_op_overhead_s", where, 0.0),
                thread_efficiency_by_class=_thread_eff(d, where),
                co_run_bandwidth=_num(d, "co_run_bandwidth", where, 1.0),
                co_run_cached_bandwidth=_num(d, "co_run_cached_bandwidth", where, 0.0),
            ))
    nodes_raw = data.get("nodes")
    if nodes_raw is None:
        nodes = (tuple(range(len(devices))),)
    else:
        if not isinstance(nodes_raw, list) or not all(
                isinstance(n, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in n)
                for n in nodes_raw):
            raise ClusterError(f"cluster file {source!r}: field 'nodes' must be a list of lists of device indices")
        nodes = tuple(tuple(n) for n in nodes_raw)
    lv_raw = data.get("levels")
    if not isinstance(lv_raw, list) or not lv_raw:
        raise ClusterError(f"cluster file {source!r}: field 'levels' must be a non-empty list")
    levels = []
    for i, lv in enumerate(lv_raw):
        where = f"cluster file {source!r}: levels[{i}]"
        if not isinstance(lv, dict):
            raise ClusterError(f"{where} must be an object")
        levels.append(LinkLevel(str(lv.get("name", f"level{i}")), _num(lv, "alpha_s", where),
                                _num(lv, "beta_s_per_byte", where)))
    name = data.get("name", Path(source).stem)
    try:
        return Cluster(str(name), tuple(devices), nodes, tuple(levels), str(data.get("notes", "")))
    except ClusterError as exc:
        raise ClusterError(f"cluster file {source!r}: {exc}") from None


# ---- presets ---------------------------------------------------------------------------------

PRESETS = ("cpu:N", "local", "h100x8", "h200x8", "h200:4x8", "a100:16x8", "l4x4", "edge")

_GPU_SPECS: dict[str, dict[str, Any]] = {
    kind: {**spec, "intra": LinkLevel(*spec["intra"]), "inter": LinkLevel(*spec["inter"])}
    for kind, spec in hardware.GPU_SPECS.items()}


def gpu_spec(kind: str) -> dict[str, Any]:
    """The preset numbers of one GPU model (``h100``, ``h200``, ``a100``, ``l4``): ``peak``
    (FLOP/s per dtype), ``mem`` and ``bw`` (bytes, B/s), ``intra``/``inter`` links and ``arch``.
    The one table both the cluster presets and the GPU compile targets read."""
    try:
        return _GPU_SPECS[kind]
    except KeyError:
        raise ClusterError(f"unknown GPU {kind!r}: use one of {', '.join(_GPU_SPECS)}") from None


GPU_EFFICIENCY = hardware.GPU_EFFICIENCY
GPU_LAUNCH_OVERHEAD_S = hardware.GPU_LAUNCH_OVERHEAD_S


def gpu_cluster(kind: str, nodes: int, per_node: int) -> Cluster:
    s = _GPU_SPECS[kind]
    dev = [Device(f"{kind}-{n}-{g}", "gpu", dict(s["peak"]), s["mem"], s["bw"], GPU_EFFICIENCY,
                  GPU_LAUNCH_OVERHEAD_S) for n in range(nodes) for g in range(per_node)]
    node_groups = tuple(tuple(range(n * per_node, (n + 1) * per_node)) for n in range(nodes))
    levels = (s["intra"], s["inter"]) if nodes > 1 else (s["intra"],)
    name = f"{kind}x{per_node}" if nodes == 1 else f"{kind}:{nodes}x{per_node}"
    return Cluster(name, tuple(dev), node_groups, levels)


def _cpu_info() -> tuple[float, set[str]]:
    """(clock in Hz, CPU flags) from /proc/cpuinfo; 2.2 GHz and no flags when unreadable."""
    ghz, flags = 2.2, set()
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ghz * 1e9, flags
    m = re.search(r"^cpu MHz\s*:\s*([0-9.]+)", text, re.M)
    if m:
        ghz = float(m.group(1)) / 1000.0
    m = re.search(r"^flags\s*:\s*(.*)$", text, re.M)
    if m:
        flags = set(m.group(1).split())
    return ghz * 1e9, flags


def total_memory_bytes() -> float:
    try:
        import psutil

        return float(psutil.virtual_memory().total)
    except Exception:  # psutil missing: fall back to /proc/meminfo
        try:
            m = re.search(r"MemTotal:\s*(\d+)\s*kB", Path("/proc/meminfo").read_text())
            return float(m.group(1)) * 1024 if m else 16e9
        except OSError:
            return 16e9


CPU_LINK = LinkLevel(*hardware.CPU_LINK)
CPU_CORE_BANDWIDTH = hardware.CPU_CORE_BANDWIDTH
CPU_LAUNCH_OVERHEAD_S = hardware.CPU_LAUNCH_OVERHEAD_S


def cpu_cluster(n: int, backend: str | None = None) -> Cluster:
    """``cpu:N``: N cores of this machine, each a device, sharing memory in one node.

    The figures are this machine's calibration for ``backend`` (default tvm) when the
    per-machine cache holds one (:mod:`partitioner.calibrate_cache`; ``partitioner calibrate``
    fills it), so the planner predicts with measured figures by default. Otherwise nominal: peak
    per core = clock × FLOPs/cycle, where FLOPs/cycle is 2 FMA units × vector lanes × 2 (64 with
    AVX-512, 32 with AVX2, 8 otherwise), and the nominal bandwidth, launch overhead and link."""
    if n < 1:
        raise ClusterError(f"cpu:{n}: the device count must be at least 1")
    calibrated = _calibrated_cpu_cluster(n, backend)
    if calibrated is not None:
        return calibrated
    hz, flags = _cpu_info()
    per_cycle = 64 if "avx512f" in flags else 32 if "avx2" in flags else 8
    fp32 = hz * per_cycle
    peak = {"float32": fp32, "float16": fp32,
            "bfloat16": 2 * fp32 if "avx512_bf16" in flags else fp32,
            "int8": 4 * fp32 if ("avx512_vnni" in flags or "avx_vnni" in flags) else 2 * fp32}
    mem = total_memory_bytes() / n
    devs = tuple(Device(f"cpu{i}", "cpu", dict(peak), mem, CPU_CORE_BANDWIDTH, 1.0, CPU_LAUNCH_OVERHEAD_S,
                        runtime=backend or "")  # the named backend's memory rule (cost/memory.py)
                 for i in range(n))
    return Cluster(f"cpu:{n}", devs, (tuple(range(n)),), (CPU_LINK,),
                   f"nominal: {hz / 1e9:.2f} GHz x {per_cycle} FLOP/cycle per core")


def _calibrated_cpu_cluster(n: int, backend: str | None) -> Cluster | None:
    """``cpu:N`` from the calibration cache, or None when this machine has none for ``backend``."""
    from partitioner.calibrate_cache import DEFAULT_BACKEND, cache_path, load_cached

    doc = load_cached(backend or DEFAULT_BACKEND)
    if doc is None:
        return None
    try:
        one = Cluster.from_json(doc["cluster"], str(cache_path(backend or DEFAULT_BACKEND)))
    except ClusterError as exc:
        sys.stderr.write(f"partitioner: ignoring the calibration cache: {exc}\n")
        return None
    c = replicate(one, n)
    if not c.devices[0].runtime:  # a cache written before devices named their runtime
        from dataclasses import replace

        c = Cluster(c.name, tuple(replace(d, runtime=backend or DEFAULT_BACKEND) for d in c.devices), c.nodes,
                    c.levels, c.notes)
    return Cluster(f"cpu:{n}", c.devices, c.nodes, c.levels, f"calibrated ({cache_path(backend or DEFAULT_BACKEND)}): "
                   f"{one.notes}")


def edge_cluster() -> Cluster:
    devs = (
        Device("cortex-a78", "cpu", {"float32": 50e9, "float16": 100e9, "int8": 200e9}, 4e9, 15e9, 1.0, 10e-6),
        Device("jetson-orin", "gpu", {"float32": 5e12, "float16": 10e12, "int8": 20e12}, 8e9, 100e9, 0.7, 20e-6),
    )
    return Cluster("edge", devs, ((0,), (1,)),
                   (LinkLevel("shm", 1e-6, 1 / 5e9), LinkLevel("ethernet-1g", 100e-6, 1 / 125e6)))


def calibration_path() -> Path:
    """Where ``partitioner calibrate`` writes, and where the ``local`` preset reads."""
    env = os.environ.get("PARTITIONER_CALIBRATION")
    if env:
        return Path(env)
    return Path(os.path.expanduser("~")) / ".cache" / "partitioner" / "local.json"


def local_cluster(n: int | None = None, quiet: bool = False) -> Cluster:
    """The last calibration, or ``cpu:<nproc>`` (saying so on stderr) when there is none."""
    path = calibration_path()
    if path.is_file():
        cluster = Cluster.load(path)
        if n is not None and n != cluster.size:
            return replicate(cluster, n)
        return cluster
    n = n or os.cpu_count() or 1
    if not quiet:
        sys.stderr.write(f"partitioner: no calibration at {path}; using nominal cpu:{n} "
                         f"(run `partitioner calibrate`)\n")
    return cpu_cluster(n)


def _thread_eff(d: dict[str, Any], where: str) -> dict[str, float]:
    """A device's ``thread_efficiency_by_class``: op class -> a number in [0, 1]."""
    raw = d.get("thread_efficiency_by_class") or {}
    if not isinstance(raw, dict) or any(k not in CALIBRATED_CLASSES or not isinstance(v, (int, float))
                                        or not 0 <= v <= 1 for k, v in raw.items()):
        raise ClusterError(f"{where}: thread_efficiency_by_class must map op classes ({', '.join(CALIBRATED_CLASSES)}) "
                           "to numbers in [0, 1]")
    return {k: float(v) for k, v in raw.items()}


def replicate(cluster: Cluster, n: int) -> Cluster:
    """n copies of the first device, one node, the first link level (for ``local:N``)."""
    d0 = cluster.devices[0]
    devs = tuple(Device(f"{d0.kind}{i}", d0.kind, dict(d0.peak_flops), d0.memory_bytes, d0.memory_bandwidth,
                        d0.efficiency, d0.launch_overhead_s, dict(d0.efficiency_by_class), d0.call_overhead_s,
                        d0.runtime, d0.comm_op_overhead_s, dict(d0.thread_efficiency_by_class),
                        d0.co_run_bandwidth, d0.co_run_cached_bandwidth)
                 for i in range(n))
    return Cluster(f"{cluster.name}:{n}", devs, (tuple(range(n)),), cluster.levels[:1], cluster.notes)


def preset(spec: str, backend: str | None = None) -> Cluster:
    """Build a preset cluster by name (see :data:`PRESETS`); ``backend`` picks whose calibration
    ``cpu:N`` reads (:func:`cpu_cluster`)."""
    s = spec.strip().lower()
    m = re.fullmatch(r"cpu:(\d+)", s)
    if m:
        return cpu_cluster(int(m.group(1)), backend)
    if s == "cpu":
        return cpu_cluster(1, backend)
    m = re.fullmatch(r"local(?::(\d+))?", s)
    if m:
        return local_cluster(int(m.group(1)) if m.group(1) else None)
    if s == "edge":
        return edge_cluster()
    m = re.fullmatch(r"(h100|h200|a100|l4)(?:x(\d+)|:(\d+)x(\d+))", s)
    if m:
        kind = m.group(1)
        nodes, per = (1, int(m.group(2))) if m.group(2) else (int(m.group(3)), int(m.group(4)))
        if nodes < 1 or per < 1:
            raise ClusterError(f"cluster preset {spec!r}: node and GPU counts must be at least 1")
        return gpu_cluster(kind, nodes, per)
    raise ClusterError(f"unknown cluster preset {spec!r}: use one of {', '.join(PRESETS)} "
                       f"(or h100/h200/a100/l4 as NAMExG or NAME:NxG), or a cluster .json file")


def resolve_cluster(cluster: Cluster | str | int | None, backend: str | None = None) -> Cluster:
    """The one cluster resolver of the API, the CLI and the compile driver: a :class:`Cluster` as
    is, ``None`` as ``cpu:1``, an int N as ``cpu:N``, a string as :meth:`Cluster.resolve` reads it
    (``backend``: whose calibration ``cpu:N`` uses, default tvm)."""
    if cluster is None:
        return Cluster.resolve("cpu:1", backend)
    if isinstance(cluster, int):
        return Cluster.resolve(f"cpu:{cluster}", backend)
    if isinstance(cluster, str):
        return Cluster.resolve(cluster, backend)
    return cluster
