"""Measure this machine and write a cluster file (COST_MODEL.md: "Calibrate the device and link
constants on real runs").

What is measured, and how:

1. Per-core GEMM rate: float32 ``numpy.matmul`` of n×n matrices on one thread (a subprocess with
   OMP/OPENBLAS/MKL thread counts set to 1), best of several runs, 2n³ FLOPs. It becomes the
   device's float32 peak (efficiency 1.0): it is the rate a tuned kernel reaches on one core.
2. Per-core memory bandwidth: a large array copy (read + write bytes / time), one thread.
   Also the physical limits (:mod:`backends.tvm.peak`): the fp32 FMA peak of a TVM-built FMA
   loop and a TVM-built triad's bandwidth (reported; the cost model keeps the GEMM rate of 1.).
3. Launch overhead of the backend being calibrated (``backend``: ``tvm`` by default, or
   ``onnxruntime``), one thread: TVM runs a chain of 32 tiny MatMuls (each its own kernel);
   ONNX Runtime a chain of tiny Relu/Neg nodes with graph optimisations off; time per node.
   3b. Call overhead (:func:`call_overhead`): a one-kernel program's run time minus one launch,
   paid once per run (per micro-batch) by every rank.
   3c. Comm-op overhead (:func:`comm_op_overhead`): what one communication op costs its rank
   beside the transfer (the call out of the compiled program into the comm handler), from a
   chain of Relus with and without one-rank AllReduces between them.
4. Per-op-class efficiency (:func:`measure_backend`): the backend builds and runs, on one thread,
   micro-kernels (:func:`micro_kernels`: a dense GEMM and a batch-1 GEMV in cache, a GEMM out
   of cache (class ``gemm_large``, read by the roofline's working-set rule for ``gemm`` ops,
   :mod:`partitioner.cost.roofline` rule 5); a 3×3 and a 1×1 conv, a depthwise conv, an
   elementwise chain, softmax + layer norm, max + global average pool, transpose + concat; and
   the training probes, :func:`backward_kernels`: the GEMM's and the 3×3 convs' gradient forms,
   classes ``gemm_backward`` and ``conv_backward`` (and their small-map points), the 3×3
   convs with their weights as an input, ``conv_train``, the ReLU gradient's Where, ``where``,
   and a batched weight gradient's sum over the batch, ``reduce_batch``; and an Add and a
   Transpose of 16 MiB maps, ``elementwise_large`` / ``data_movement_large``, for the roofline's
   rule 7) at one to four representative sizes, median
   of N runs. efficiency(kernel) = roofline time at
   efficiency 1 (against the GEMM rate of 1. and the bandwidth of 2., fusion rules of
   :mod:`partitioner.cost.roofline` included) / (measured − launches × launch overhead);
   efficiency(class) = geometric mean over the class's kernels. It is
   never fitted on the zoo models that benchmarks/cost_accuracy.py checks against.
6. Threads (:func:`thread_efficiency`): the micro-kernels again on all usable cores (at most 8),
   in a subprocess whose thread pool has that many workers; per class, the share of each extra
   thread that became speed. Only classes whose kernels the backend parallelises gain from a
   rank's threads (:mod:`partitioner.cost.threads`). Skipped while other work holds the cores
   (:func:`_cores_free`): the classes then keep the nominal thread efficiency.
7. Co-run bandwidth (:func:`co_run_bandwidth`): probe 2's copy on one core alone, then on all
   usable cores at once (one thread pinned to each), in interleaved rounds; the share of the
   lone core's bandwidth each core keeps together (median of rounds, at most 1). Ranks of one
   node that run at the same time share the memory system: measured on the 2-core Zen 4
   development machine (session 22, ``benchmarks/co_run.py``, one pinned process per core, stored
   in ``benchmarks/results/session22_zen4/co_run.json``), each core kept 0.43-0.71 (median 0.54)
   of its 29-39 GB/s while both copied, where a 256x256 GEMM kept 0.97-1.00 of its rate (compute
   does not share). The same again with a copy that stays in the caches
   (:data:`CO_RUN_CACHED_BYTES` moved, ``co_run_cached_bandwidth``): on Zen 5 (session 27) it
   kept 0.93 where the out-of-cache copy kept 0.43. Skipped
   with probe 6 while other work holds the cores (1.0 and 0.0: nominal, not measured).
5. MPI α and β: ``mpiexec -n 2 python -m partitioner.calibrate_mpi`` ping-pong at several sizes,
   then a least-squares fit of one-way time = α + nβ weighted by 1/t (relative error), so both
   small and large messages count; α is clamped to [0, time of the smallest message]. The 2-rank allreduce times are kept for checking the model.

The result is a cluster of ``os.cpu_count()`` identical one-core devices in one node, named
``local``. Everything stays within a minute (``quick``: about 10–20 s; TVM micro-kernels
compile in a temporary folder, nothing is cached).
"""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from partitioner.cluster import CPU_LINK, MAX_CLASS_EFFICIENCY, Cluster, Device, LinkLevel, total_memory_bytes
from partitioner.core.env import env_number
from partitioner.core.errors import PartitionerError
from partitioner.core.machine import machine_info
from partitioner.cost.roofline import CO_RUN_CACHED_BYTES, GEMM_LARGE_PROBE, GEMM_PROBE, LARGE_MAP

_SINGLE_THREAD_ENV = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
                      "NUMEXPR_NUM_THREADS": "1", "VECLIB_MAXIMUM_THREADS": "1"}


DEFAULT_BACKEND = "tvm"
BACKENDS = ("tvm", "onnxruntime")


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
    backend: str = DEFAULT_BACKEND
    efficiency_by_class: dict[str, float] = field(default_factory=dict, hash=False)
    kernels: tuple[dict[str, Any], ...] = field(default=(), hash=False)
    mpi_error: str = ""  # why the MPI probe failed ("" when it ran)
    # the physical limits (backends/tvm/peak.py): FMA-loop peak and triad bandwidth, one core
    fma_peak_flops: float | None = None
    stream_bandwidth: float | None = None
    # the FLOPs a kernel needs before TVM's 2-thread pool pays (Peak.parallel_min_flops; builds
    # of this machine read it from the cache: backends/tvm/schedules/threads.py)
    parallel_min_flops: float | None = None
    call_overhead_s: float = 0.0  # per run of a compiled program (probe 3b)
    comm_op_overhead_s: float = 0.0  # per comm op, beside the transfer (probe 3c)
    thread_efficiency_by_class: dict[str, float] = field(default_factory=dict, hash=False)  # probe 6
    threads_probed: int = 1
    co_run_bandwidth: float = 1.0  # probe 7 (1.0: not measured)
    co_run_rounds: tuple[float, ...] = field(default=(), hash=False)  # probe 7's per-round shares
    co_run_cached_bandwidth: float = 0.0  # probe 7's in-cache copy (0.0: not measured)
    co_run_cached_rounds: tuple[float, ...] = field(default=(), hash=False)
    # probe 6's per-kernel best times, {"kernel", "class", "one_s", "many_s"} (the class figures' evidence)
    thread_kernels: tuple[dict[str, Any], ...] = field(default=(), hash=False)

    def to_json(self) -> dict[str, Any]:
        return {
            "backend": self.backend,
            "gemm_flops_per_core": self.gemm_flops, "gemm_n": self.gemm_n,
            "memory_bandwidth_per_core": self.memory_bandwidth, "launch_overhead_s": self.launch_overhead_s,
            "call_overhead_s": self.call_overhead_s, "comm_op_overhead_s": self.comm_op_overhead_s,
            "efficiency_by_class": dict(self.efficiency_by_class),
            "thread_efficiency_by_class": dict(self.thread_efficiency_by_class), "threads_probed": self.threads_probed,
            "co_run_bandwidth": self.co_run_bandwidth, "co_run_rounds": list(self.co_run_rounds),
            "co_run_cached_bandwidth": self.co_run_cached_bandwidth,
            "co_run_cached_rounds": list(self.co_run_cached_rounds),
            "thread_kernels": [dict(k) for k in self.thread_kernels],
            "kernels": [dict(k) for k in self.kernels],
            "fma_peak_flops_per_core": self.fma_peak_flops, "stream_bandwidth_per_core": self.stream_bandwidth,
            "parallel_min_flops": self.parallel_min_flops,
            "mpi": {"ok": self.mpi_ok, "alpha_s": self.alpha_s, "beta_s_per_byte": self.beta_s_per_byte,
                    "bandwidth": 1 / self.beta_s_per_byte if self.beta_s_per_byte > 0 else None,
                    "pingpong": [list(p) for p in self.pingpong],
                    "allreduce": [list(p) for p in self.allreduce],
                    **({"error": self.mpi_error} if not self.mpi_ok else {})},
            "seconds": self.seconds, "machine": dict(self.machine),
        }


# ---- per-class micro-kernels (built and run by the backend being calibrated) ------------------


@dataclass(frozen=True)
class MicroKernel:
    """A one-class ONNX micro-model: ``nodes`` over inputs ``inputs`` (name -> shape) and
    constant weights ``weights`` (name -> shape), all float32."""

    name: str
    op_class: str
    inputs: tuple[tuple[str, tuple[int, ...]], ...]
    weights: tuple[tuple[str, tuple[int, ...]], ...]
    nodes: tuple[tuple[str, tuple[str, ...], tuple[str, ...], tuple[tuple[str, Any], ...]], ...]
    outputs: tuple[str, ...]
    nhwc: bool = False  # timed on TVM in the layout a model runs it in (:func:`nhwc_model`)


def _k(name: str, cls: str, inputs: dict[str, tuple[int, ...]], weights: dict[str, tuple[int, ...]],
       nodes: list[tuple[str, list[str], list[str], dict[str, Any]]], outputs: list[str],
       nhwc: bool = False) -> MicroKernel:
    return MicroKernel(name, cls, tuple(inputs.items()), tuple(weights.items()),
                       tuple((op, tuple(i), tuple(o), tuple(a.items())) for op, i, o, a in nodes), tuple(outputs),
                       nhwc)


#: time the ``nhwc`` probes (the depthwise conv) on TVM in NHWC (:func:`nhwc_model`); off: in NCHW,
#: as before 2026-12-03 (session 23)
NHWC_PROBES = True


def nhwc_model(model: Any) -> Any:
    """``model`` (NCHW, a probe's) taking each 4-D input as NHWC and giving each 4-D output as NHWC,
    through a Transpose at each end. TVM's build converts convolutions to NHWC
    (``backends/tvm/pipeline.py``) and inserts a layout transform before and after a lone conv
    whose neighbours are NCHW; in a model the conv's neighbours are convs too, so those transforms
    are not there. With the Transposes the output's transforms fuse into the conv's epilogue; on
    the input side TVM keeps one kernel, the two transposes composed (an identity copy of the
    input, which a model does not have: the probe stays slightly pessimistic). Its roof
    (:func:`kernel_roof`) stays the NCHW model's, without the Transposes. Measured (session 23,
    Zen 4, one thread): the depthwise probe ``dwconv3x3_128c_28`` ran 0.14 ms in NCHW
    (``benchmarks/kernel_profile.py``, VM instrument: the depthwise kernel 0.019 ms, the two
    layout transforms 0.083 ms); wrapped, 0.033 ms a run against 0.159 for the NCHW build (median
    of 200). The class value had priced the zoo mobilenet's depthwise convs (batch 4, 64x64) at
    1.42 ms, where they ran 0.24 ms. (A pool has no such form: TVM keeps a pool whose input is not a conv's in
    NCHW, so the wrapped pool probe still pays both transforms.)"""
    import onnx
    from onnx import helper

    out = onnx.ModelProto()
    out.CopyFrom(model)
    g = out.graph
    def wrap(values: Any, into_nchw: bool) -> list[Any]:
        """A Transpose per 4-D value, which is renamed ``<name>.nhwc`` and given NHWC dims."""
        nodes = []
        for v in values:
            dims = v.type.tensor_type.shape.dim
            if len(dims) != 4:
                continue
            nhwc = v.name + ".nhwc"
            nodes.append(helper.make_node("Transpose", [nhwc], [v.name], perm=[0, 3, 1, 2]) if into_nchw
                         else helper.make_node("Transpose", [v.name], [nhwc], perm=[0, 2, 3, 1]))
            v.name = nhwc
            n, c, h, w = (d.dim_value for d in dims)
            for d, size in zip(dims, (n, h, w, c)):
                d.dim_value = size
        return nodes

    nodes = wrap(g.input, True) + list(g.node) + wrap(g.output, False)
    del g.node[:]
    g.node.extend(nodes)
    return out


def _nhwc_feeds(feeds: dict[str, Any], model: Any) -> dict[str, Any]:
    """``feeds`` for :func:`nhwc_model`'s inputs (each 4-D array transposed to NHWC, contiguous)."""
    import numpy as np

    names = {v.name for v in model.graph.input}
    return {(n + ".nhwc" if n + ".nhwc" in names else n):
            (np.ascontiguousarray(x.transpose(0, 2, 3, 1)) if n + ".nhwc" in names else x) for n, x in feeds.items()}


def _matmul_kernel(cls: str, mkn: tuple[int, int, int]) -> MicroKernel:
    """A ``MatMul`` of an ``M x K`` input by a ``K x N`` weight (name ``gemm_MxKxN``, or
    ``gemv_...`` when M is 1)."""
    m, k, n = mkn
    name = f"{'gemv' if m == 1 else 'gemm'}_{m}x{k}x{n}"
    return _k(name, cls, {"x": (m, k)}, {"w": (k, n)}, [("MatMul", ["x", "w"], ["y"], {})], ["y"])


def micro_kernels(quick: bool) -> list[MicroKernel]:
    """The calibration set: one to four representative sizes per class (never a zoo model).

    Sizes are those of the layers in small CNNs and transformers: a compute-bound GEMM and a
    batch-1 (weight-bound) one whose operands fit L2 (class ``gemm``: 128x256x256 and 1x256x512,
    512 KiB each), and a GEMM whose operands do not (``gemm_large``: 256x1024x1024, 6 MiB: the
    in-cache pair runs from cache, the GEMV at several times the DRAM roof, and alone it priced
    the training benchmark's 1024-wide layers 1.5x too fast; rule 5 of the roofline
    interpolates between the two by working set); an Add and a Transpose of 16 MiB maps
    (``elementwise_large``, ``data_movement_large``: the classes' own probes stay in cache, a
    training step's maps do not; rule 7 of the roofline, ``LARGE_MAP_PROBES``); a 3-channel 7×7/2 stem conv, 3×3 convs with 32–64 channels on
    16×16–28×28 maps, a 256-channel 3×3 on a 7×7 map and a 1×1 conv; 64–128 tokens × 128 features for the norms. ``quick``
    changes only how long each kernel is timed, not the set."""
    ks = [
        _matmul_kernel("gemm", GEMM_PROBE),
        _matmul_kernel("gemm_large", GEMM_LARGE_PROBE),
        _matmul_kernel("gemm", (1, 256, 512)),
        _k("conv7x7s2_3c_96", "conv", {"x": (1, 3, 96, 96)}, {"w": (32, 3, 7, 7), "b": (32,)},
           [("Conv", ["x", "w", "b"], ["y"], {"pads": [3, 3, 3, 3], "strides": [2, 2]})], ["y"]),
        _k("conv3x3_32c_16", "conv", {"x": (1, 32, 16, 16)}, {"w": (32, 32, 3, 3), "b": (32,)},
           [("Conv", ["x", "w", "b"], ["y"], {"pads": [1, 1, 1, 1]})], ["y"]),
        _k("conv3x3_64c_28", "conv", {"x": (1, 64, 28, 28)}, {"w": (64, 64, 3, 3), "b": (64,)},
           [("Conv", ["x", "w", "b"], ["y"], {"pads": [1, 1, 1, 1]})], ["y"]),
        _k("conv3x3_256c_7", "conv", {"x": (1, 256, 7, 7)}, {"w": (256, 256, 3, 3), "b": (256,)},
           [("Conv", ["x", "w", "b"], ["y"], {"pads": [1, 1, 1, 1]})], ["y"]),
        _k("conv1x1_128c_28", "conv", {"x": (1, 128, 28, 28)}, {"w": (128, 128, 1, 1), "b": (128,)},
           [("Conv", ["x", "w", "b"], ["y"], {})], ["y"]),
        _k("dwconv3x3_128c_28", "depthwise_conv", {"x": (1, 128, 28, 28)}, {"w": (128, 1, 3, 3), "b": (128,)},
           [("Conv", ["x", "w", "b"], ["y"], {"pads": [1, 1, 1, 1], "group": 128})], ["y"], nhwc=True),
        _k("eltwise_chain_64c_56", "elementwise", {"x": (1, 64, 56, 56), "r": (1, 64, 56, 56)},
           {"s": (1, 64, 1, 1), "c": (1, 64, 1, 1)},
           [("Add", ["x", "r"], ["a"], {}), ("Mul", ["a", "s"], ["m"], {}), ("Add", ["m", "c"], ["t"], {}),
            ("Relu", ["t"], ["y"], {})], ["y"]),
        *([_k("add_16x64c_64", "elementwise_large", {"x": LARGE_MAP, "r": LARGE_MAP}, {},
              [("Add", ["x", "r"], ["y"], {})], ["y"]),
           _k("transpose_16x64c_64", "data_movement_large", {"x": LARGE_MAP}, {},
              [("Transpose", ["x"], ["t"], {"perm": [0, 2, 3, 1]})], ["t"])] if LARGE_MAP_PROBES else []),
        _k("softmax_layernorm", "norm", {"s": (4, 64, 64), "h": (64, 128)}, {"g": (128,), "be": (128,)},
           [("Softmax", ["s"], ["p"], {"axis": -1}), ("LayerNormalization", ["h", "g", "be"], ["n"], {"axis": -1})],
           ["p", "n"]),
        _k("maxpool_avgpool_64c_56", "pool", {"x": (1, 64, 56, 56)}, {},
           [("MaxPool", ["x"], ["p"], {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]}),
            ("GlobalAveragePool", ["x"], ["g"], {})], ["p", "g"]),
        _k("transpose_concat_64c_28", "data_movement", {"x": (1, 64, 28, 28), "z": (1, 64, 28, 28)}, {},
           [("Transpose", ["x"], ["t"], {"perm": [0, 2, 3, 1]}), ("Concat", ["x", "z"], ["c"], {"axis": 1})],
           ["t", "c"]),
    ]
    return ks + backward_kernels()


def backward_kernels() -> list[MicroKernel]:
    """The training probes (classes ``gemm_backward`` and ``conv_backward``, read by the training
    cost model's rule 1 for the backward's contractions, :func:`partitioner.cost.training.backward_class`):
    the forward set's GEMM and 3x3 convs in the forms the gradient rules emit
    (:mod:`partitioner.training.rules.linear`): the weight gradient ``Gemm(x, dy, transA=1)`` and
    the input gradient ``Gemm(dy, W, transB=1)`` (``W`` a graph input, as the step's state:
    ``DGRAD_WEIGHT_INPUT``); the 3x3 convs' input gradient
    ``ConvTranspose(dy, W)`` (``conv_backward``) and their weight gradient, the GEMM rule's one
    MatMul ``dY [M, N*H*W] @ cols [N*H*W, C*9]`` (``gemm_backward``: a MatMul, as the cost model
    classes it; the im2col's slices and transposes are data movement, costed apart). A weight
    gradient sums over the batch, so these take a batch of 4 where the forward probes take 1.
    The Conv-form weight gradient the rules keep for grouped, 1-D/3-D and large kernels (7x7
    stem) has no probe: it runs at ``conv_backward``, the ConvTranspose's rate. The
    ConvTranspose again on a 4x4 and a 2x2 map (``conv_backward_px16``, ``conv_backward_px4``,
    batch 4: for the roofline's rule 6; the same convs forward with constant weights ran at the
    ``conv`` class value, 0.90-1.12 of the GEMM rate over four loaded calibrations on ONNX
    Runtime, so inference has no small-map probes). And the forward 3x3
    convs as a training step runs them (class ``conv_train``, read by the training cost model's
    rule 1 for its forward convs; ``conv_train_px16``, ``conv_train_px4`` on 4x4 and 2x2 maps):
    the weights are a graph input there (the step's state), which ONNX Runtime cannot prepack
    for its NCHWc kernels (measured: a 512-channel 3x3 conv on 2x2 maps at 101 GFLOP/s with
    constant weights, 11 with the weights as an input); the ConvTransposes take their weights as
    an input for the same reason (:func:`_conv_transpose_kernel`). And the ReLU gradient's
    ``Where(x > 0, dy, 0)`` (class ``where``, ``WHERE_PROBE``): ONNX Runtime's Where ran at about
    2 GB/s whatever the size (0.2 to 4 MiB maps, with a scalar or a full third operand, where an
    Add of the same maps ran at 40-75 GB/s), so the ``elementwise`` class priced the zoo resnet's
    17 ReLU-gradient Wheres at 0.4 ms where they took 11 ms of its batch-16 step. And the
    ``gemm`` and ``gemm_large`` probes' MatMuls with the weight as a graph input (classes
    ``gemm_train``, ``gemm_large_train``, ``GEMM_TRAIN_PROBES``): ONNX Runtime packs an input
    weight on every call (1.05-1.18x the constant weight's time, measured). And a
    batched MatMul's weight gradient summed over its batch (class ``reduce_batch``,
    ``REDUCE_BATCH_PROBE``): ONNX Runtime's ReduceSum over the leading axis of [B, 256, 1024]
    ran at 4-5 GB/s for B = 4 and 8, 1.4 GB/s for B = 16 and 6-34 GB/s for B = 32 (an algorithm
    chosen by shape; loaded machine), against about 11 GB/s at the ``reduction`` class value
    (the norm probes'): the zoo bert's batch-16 step (a data-parallel rank of the batch-32 one)
    spent 50-60 ms in four such sums priced 6.5 ms; the probe takes batch 4 as the other
    backward probes do."""
    return [
        _k("gemm_wgrad_128x256x256", "gemm_backward", {"x": (128, 256), "dy": (128, 256)}, {},
           [("Gemm", ["x", "dy"], ["dw"], {"transA": 1})], ["dw"]),
        _k("gemm_dgrad_128x256x256_win" if DGRAD_WEIGHT_INPUT else "gemm_dgrad_128x256x256", "gemm_backward",
           {"dy": (128, 256), **({"w": (256, 256)} if DGRAD_WEIGHT_INPUT else {})},
           {} if DGRAD_WEIGHT_INPUT else {"w": (256, 256)}, [("Gemm", ["dy", "w"], ["dx"], {"transB": 1})], ["dx"]),
        _conv_transpose_kernel(64, 28, "conv_backward"),
        _k("wgrad_im2col3x3_64c_28_b4", "gemm_backward", {"dy": (64, 4 * 28 * 28), "cols": (4 * 28 * 28, 64 * 9)},
           {}, [("MatMul", ["dy", "cols"], ["dw"], {})], ["dw"]),
        _conv_transpose_kernel(256, 7, "conv_backward"),
        _conv_transpose_kernel(256, 4, "conv_backward_px16"),
        _conv_transpose_kernel(512, 2, "conv_backward_px4"),
        *[_k(f"conv3x3_{c}c_{hw}_b4_win", cls, {"x": (4, c, hw, hw), "w": (c, c, 3, 3)}, {},
             [("Conv", ["x", "w"], ["y"], {"pads": [1, 1, 1, 1]})], ["y"])
          for c, hw, cls in ((64, 28, "conv_train"), (256, 7, "conv_train"), (256, 4, "conv_train_px16"),
                             (512, 2, "conv_train_px4"))],
        _k("wgrad_im2col3x3_256c_7_b4", "gemm_backward", {"dy": (256, 4 * 7 * 7), "cols": (4 * 7 * 7, 256 * 9)},
           {}, [("MatMul", ["dy", "cols"], ["dw"], {})], ["dw"]),
        *([_k("reducesum_batch_4x256x1024", "reduce_batch", {"x": (4, 256, 1024)}, {},
              [("Constant", [], ["axes"], {"value": _int64_tensor([0])}), ("ReduceSum", ["x", "axes"], ["y"], {})],
              ["y"])]
          if REDUCE_BATCH_PROBE else []),
        *([_k("relu_grad_where_64c_28_b4", "where", {"mask": (4, 64, 28, 28), "dy": (4, 64, 28, 28)}, {"zero": ()},
              [("Where", ["mask", "dy", "zero"], ["dx"], {})], ["dx"])] if WHERE_PROBE else []),
        *([_k(f"gemm_{m}x{k}x{n}_win", cls, {"x": (m, k), "w": (k, n)}, {}, [("MatMul", ["x", "w"], ["y"], {})], ["y"])
           for cls, (m, k, n) in (("gemm_train", GEMM_PROBE), ("gemm_large_train", GEMM_LARGE_PROBE))]
          if GEMM_TRAIN_PROBES else []),
    ]


#: the ConvTranspose probes take their weights as a graph input, as the training step does (its
#: weights are the step's state); off: as constant initializers (the probes before 2026-12-01 pm)
CONV_TRANSPOSE_WEIGHT_INPUT = True


#: the out-of-cache elementwise and data-movement probes (an Add and a Transpose of 16 MiB maps,
#: classes ``elementwise_large`` / ``data_movement_large``: roofline rule 7); off: none
LARGE_MAP_PROBES = True

#: the ``reduce_batch`` probe: a batched MatMul's weight gradient summed over its batch,
#: ``ReduceSum(axes=[0])`` of a [4, 256, 1024] product (training/rules: the MatMul rule's
#: ``reduce_to``), read by the training cost model for a step's ReduceSum over axis 0 of a 3-D
#: or higher tensor (cost/training.py rule 1); off: they run at the ``reduction`` class value
REDUCE_BATCH_PROBE = True

#: the ``gemm_train`` / ``gemm_large_train`` probes: the ``gemm`` / ``gemm_large`` probes' MatMuls
#: with the weight as a graph input, as a training step's forward products take it (its state;
#: ONNX Runtime prepacks only a constant weight), read by the training cost model's rule 1
#: (``cost.training.train_gemm_device``); off: those products run at the constant-weight values
GEMM_TRAIN_PROBES = True

#: the ``gemm_backward`` input-gradient probe ``Gemm(dy, W, transB=1)`` takes ``W`` as a graph
#: input, as the step does (its state; ONNX Runtime prepacks only a constant ``W``: measured
#: 1.07x faster with it constant, calibration timer, CPU clock, 9 interleaved reps); off: ``W``
#: constant (the probe before 2026-12-01 night)
DGRAD_WEIGHT_INPUT = True

#: the ``where`` probe: the ReLU gradient's ``Where(x > 0, dy, 0)`` (training/rules), class
#: ``where``, read by the training cost model for a step's Where nodes (cost/training.py rule 1);
#: off: they run at the ``elementwise`` class value
WHERE_PROBE = True


#: on TVM the training probes' weight input (``w``: the ``_win`` probes, a weight as a graph input
#: as the step's state) is fed read-only and not copied into the library's input buffer on every
#: run (:func:`_resident_weights`); off: copied every run, as before 2026-12-03
TVM_RESIDENT_WEIGHT_INPUTS = True


def _resident_weights(feeds: dict[str, Any], backend: str) -> dict[str, Any]:
    """``feeds`` with the weight input ``w`` made read-only on TVM (:data:`TVM_RESIDENT_WEIGHT_INPUTS`),
    so the executable (``reuse_readonly_inputs``) copies it into its input buffer once, not on every
    timed run. Why: a TVM training rank passes its state to the step as the arrays it holds (the
    previous step's outputs, ``overlap.vm_aligned``: no copy), so a probe that copies its weight
    each run times a copy the step does not make, and that copy dominates where the weight is
    large beside the work. Measured (one thread, Zen 4, VM instrument beside the run's median,
    ``conv3x3_512c_2_b4_win``, the ``conv_train_px4`` probe: a 9.4 MB weight on 2x2 maps):
    3.4-3.9 ms a run with the copy, 2.2-2.5 ms without, its kernels (the weight's per-call packing
    1.5-1.6 ms, the conv 1.0 ms) 2.6 ms; three calibrations of one morning timed it 3.20, 3.25
    and 4.91 ms (the copy competes with the other core for memory bandwidth). The activations stay
    copied (the probes' own inputs are small beside their work)."""
    if backend != "tvm" or not TVM_RESIDENT_WEIGHT_INPUTS or "w" not in feeds:
        return feeds
    w = feeds["w"].copy()
    w.setflags(write=False)
    return {**feeds, "w": w}


def _int64_tensor(values: list[int]) -> Any:
    """A 1-D int64 TensorProto (a Constant's ``value``: TVM's ONNX importer reads that form, not
    ``value_ints``)."""
    import numpy as np
    from onnx import numpy_helper

    return numpy_helper.from_array(np.array(values, np.int64))


def _conv_transpose_kernel(c: int, hw: int, cls: str) -> MicroKernel:
    """The input gradient of a 3x3 ``c``-channel conv on an ``hw`` x ``hw`` map at batch 4:
    ``ConvTranspose(dy, W)``, with ``W`` a graph input (``CONV_TRANSPOSE_WEIGHT_INPUT``): ONNX
    Runtime prepacks a constant ConvTranspose filter, not an input one, and on small maps the
    per-call repacking is most of the kernel (measured, one thread, loaded machine: 512 channels
    on 2x2 maps 3.1 ms with a constant filter, 8.2 ms with it as an input; 256 on 4x4 0.76 and
    1.59 ms; 64 on 28x28 2.8 and 3.0 ms; the zoo resnet's layer4 ConvTransposes in the step ran
    at about twice the constant-filter probes' price)."""
    x, w = {"dy": (4, c, hw, hw)}, {"w": (c, c, 3, 3)}
    inputs, weights = ({**x, **w}, {}) if CONV_TRANSPOSE_WEIGHT_INPUT else (x, w)
    name = f"convT3x3_{c}c_{hw}_b4" + ("_win" if CONV_TRANSPOSE_WEIGHT_INPUT else "")
    return _k(name, cls, inputs, weights, [("ConvTranspose", ["dy", "w"], ["dx"], {"pads": [1, 1, 1, 1]})], ["dx"])


def launch_chain(length: int) -> MicroKernel:
    """``length`` tiny MatMuls in a chain: each is its own kernel and does ~no work."""
    nodes = [("MatMul", [f"t{i}", f"w{i}"], [f"t{i + 1}"], {}) for i in range(length)]
    return _k(f"launch_chain_{length}", "other", {"t0": (1, 8)}, {f"w{i}": (8, 8) for i in range(length)},
              nodes, [f"t{length}"])


def kernel_model(k: MicroKernel) -> Any:
    """The ONNX ModelProto of a micro-kernel, shapes inferred, seeded weights."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    nodes = [helper.make_node(op, list(i), list(o), **dict(a)) for op, i, o, a in k.nodes]
    inits = [numpy_helper.from_array((rng.standard_normal(s) * 0.1).astype(np.float32), n) for n, s in k.weights]
    g = helper.make_graph(nodes, k.name, [helper.make_tensor_value_info(n, _input_type(n), list(s)) for n, s in k.inputs],
                          [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in k.outputs], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m = onnx.shape_inference.infer_shapes(m, strict_mode=True)
    # give the outputs their inferred shapes (the TVM importer wants typed outputs)
    vi = {v.name: v for v in m.graph.value_info}
    for out in m.graph.output:
        if out.name in vi:
            out.CopyFrom(vi[out.name])
    return m


def _input_type(name: str) -> int:
    """A micro-kernel input's ONNX element type: bool for a ``mask...`` input (a Where's
    condition), else float32."""
    from onnx import TensorProto

    return TensorProto.BOOL if name.startswith("mask") else TensorProto.FLOAT


def _feeds(k: MicroKernel) -> dict[str, Any]:
    """Seeded inputs: normal float32 values; a ``mask...`` input, their signs (half true)."""
    import numpy as np

    rng = np.random.default_rng(1)
    return {n: rng.standard_normal(s) > 0 if n.startswith("mask") else rng.standard_normal(s).astype(np.float32)
            for n, s in k.inputs}


#: ``PARTITIONER_CALIBRATE_CLOCK=cpu``: the one-thread probes (GEMM rate, bandwidth, kernels,
#: launch and call overheads) are timed in the process's CPU time instead of wall time.
#: For checking predictions on a shared, loaded machine against a step's CPU time (a process
#: that gets a quarter of a core measures four times its kernel's wall time, not its CPU time);
#: the default, wall time, is what a rank waits on a quiet machine.
CLOCK_ENV = "PARTITIONER_CALIBRATE_CLOCK"


def _clock() -> Any:
    """``time.process_time`` under ``PARTITIONER_CALIBRATE_CLOCK=cpu`` (all the probe process's
    threads: a backend may run a one-thread kernel on a pool thread), else ``time.perf_counter``."""
    return time.process_time if os.environ.get(CLOCK_ENV) == "cpu" else time.perf_counter


def _median_time(fn: Any, quick: bool, share: float = 1.0) -> float:
    """Median seconds of ``fn()`` over at least 5 and at most 200 runs within a time budget
    (wall time, ``share`` of 0.3 s quick or 1 s; :func:`_clock`'s clock per run)."""
    clock = _clock()
    fn()
    fn()
    times: list[float] = []
    deadline = time.perf_counter() + (0.3 if quick else 1.0) * share
    while len(times) < 5 or (time.perf_counter() < deadline and len(times) < 200):
        t0 = clock()
        fn()
        times.append(clock() - t0)
    return statistics.median(times)


def _runner(backend: str, model: Any, workdir: Path, threads: int = 1) -> Any:
    """A callable that runs ``model`` once on ``backend`` with its feeds, ``threads`` threads."""
    if backend == "onnxruntime":
        import onnxruntime as ort

        so = ort.SessionOptions()
        so.intra_op_num_threads = threads
        so.inter_op_num_threads = 1
        sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
        return lambda feeds: sess.run(None, feeds)
    from backends.tvm.build import build
    from backends.tvm.executable import load
    from partitioner.runtime.comm_local import LocalWorld

    path = workdir / f"{model.graph.name}.so"
    build(model, path)
    exe = load(model, path, threads=threads)
    # a read-only weight feed is copied once (_resident_weights); other runners keep the fast call path
    exe.reuse_readonly_inputs = TVM_RESIDENT_WEIGHT_INPUTS and "w" in exe.inputs
    comm = LocalWorld(1).communicator(0)
    return lambda feeds: exe.run(feeds, comm)


def _ort_launch_overhead(chain: int) -> float:
    """Seconds per tiny node in ONNX Runtime on one thread, graph optimisations off."""
    import numpy as np
    import onnxruntime as ort
    from onnx import TensorProto, helper

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
    return _median_time(lambda: sess.run(None, x), quick=False) / chain


def call_overhead(backend: str, work: Path, launch: float, quick: bool) -> float:
    """Probe 3b: seconds per run of a compiled program beyond its kernels: the median time of a
    one-kernel program (a Relu on 8 values) minus one launch. The runtime pays it once per
    micro-batch on every rank (argument and result handling, VM entry); a tiny model's pipeline
    step is mostly this."""
    k = _k("call_1relu", "other", {"x": (1, 8)}, {}, [("Relu", ["x"], ["y"], {})], ["y"])
    run = _runner(backend, kernel_model(k), work)
    feeds = _feeds(k)
    return max(_median_time(lambda: run(feeds), quick) - launch, 0.0)


class _NullCommunicator:
    """A one-rank communicator whose collectives hand their input back at once: the comm-op probe
    times the runtime's crossing into the comm op, not a transfer."""

    rank, world_size = 0, 1

    def allreduce(self, x: Any, group: Any, reduction: str, tag: int) -> Any:
        return x


def comm_chain(comm_ops: int, with_comm: bool = True) -> Any:
    """A program of ``comm_ops + 1`` Relus on 8 values; ``with_comm`` puts a one-rank
    ``AllReduce`` (``partitioner.comm``) between each pair, so the program calls out of the
    backend's compiled code ``comm_ops`` times per run."""
    import onnx
    from onnx import TensorProto, helper

    from partitioner.core import comm_ops as cops

    nodes, cur = [], "x"
    for i in range(comm_ops + 1):
        nodes.append(helper.make_node("Relu", [cur], [f"r{i}"]))
        cur = f"r{i}"
        if with_comm and i < comm_ops:
            nodes.append(cops.make_node("AllReduce", [cur], [f"a{i}"], name=f"ar{i}", group=[0], tag=i,
                                        reduction="sum"))
            cur = f"a{i}"
    g = helper.make_graph(nodes, f"comm_chain_{comm_ops}_{int(with_comm)}",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8])],
                          [helper.make_tensor_value_info(cur, TensorProto.FLOAT, [1, 8])],
                          value_info=[helper.make_tensor_value_info(n.output[0], TensorProto.FLOAT, [1, 8])
                                      for n in nodes[:-1]])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), cops.opset_import()])


def comm_op_overhead(backend: str, work: Path, launch: float, quick: bool, ops: int = 16) -> float:
    """Probe 3c: seconds a rank spends per comm op outside the transfer itself: the compiled
    program's call out to the runtime's comm handler (TVM: a packed call into Python, DLPack views
    of the tensors, the op table; ONNX Runtime: the end of one session run and the start of the
    next). The median run time of a chain of ``ops + 1`` Relus with a one-rank AllReduce (that
    returns at once) between each pair, minus the same chain without them and minus one launch
    per extra kernel, over ``ops``. The simulator charges it on every comm op of every rank."""
    import numpy as np

    mod = __import__(f"backends.{backend}", fromlist=["build", "load"])
    x = {"x": np.linspace(-1, 1, 8, dtype=np.float32).reshape(1, 8)}
    comm = _NullCommunicator()
    times = []
    for with_comm in (True, False):
        model = comm_chain(ops, with_comm)
        path = work / f"{model.graph.name}.{'so' if backend == 'tvm' else 'onnx'}"
        mod.build(model, path)
        exe = mod.load(model, path, threads=1)
        times.append(_median_time(lambda: exe.run(x, comm), quick))
    return max((times[0] - times[1]) / ops - launch, 0.0)


def kernel_roof(model: Any, device: Device) -> tuple[float, int]:
    """(Σ roofline seconds at efficiency 1 without launch overheads, kernels launched) of a
    micro-model under the roofline rules (fusion included), so that calibrating on it and
    predicting it use one formula."""
    import onnx_ir as ir

    from partitioner.cost.ops import op_class
    from partitioner.cost.roofline import fused_nodes, op_time
    from partitioner.cost.workdepth import constant_values, node_costs

    graph = ir.serde.deserialize_model(model).graph
    costs = node_costs(graph, constant_values(graph))
    fused = fused_nodes(graph)
    unit = Device(device.name, device.kind, dict(device.peak_flops), device.memory_bytes, device.memory_bandwidth,
                  1.0, 0.0)
    roof = sum(op_time(c, unit, "float32", None, n in fused) for n, c in zip(graph, costs))
    launches = sum(1 for n, c in zip(graph, costs) if n not in fused and (c.flops > 0 or c.bytes > 0))
    return roof, launches


#: the kernel probes are timed in this many interleaved rounds (:func:`_time_kernels`); 1: each
#: kernel's runs back to back, as before 2026-12-03. ``$PARTITIONER_CALIBRATE_ROUNDS`` overrides it
#: (for A/B runs; read by :func:`probe_rounds` when used, not at import)
PROBE_ROUNDS = 5
ROUNDS_ENV = "PARTITIONER_CALIBRATE_ROUNDS"


def probe_rounds() -> int:
    """``$PARTITIONER_CALIBRATE_ROUNDS`` (a whole number >= 1), else :data:`PROBE_ROUNDS`; a bad
    value is a :class:`UsageError` (one line, exit 2), raised by :func:`calibrate` before
    any probe starts."""
    return env_number(ROUNDS_ENV, PROBE_ROUNDS, int, lambda v: v >= 1, "a whole number of rounds (>= 1)")


def _probe_runner(k: MicroKernel, model: Any, backend: str, work: Path, threads: int = 1) -> tuple[Any, dict]:
    """``k``'s runner and feeds in the form it is timed in: NHWC on TVM for an ``nhwc`` probe
    (:func:`nhwc_model`; the roof stays the NCHW ``model``'s), else ``model`` itself. Probes 4
    and 6 both build through here, so a class's thread speed-up is measured on the kernel its
    one-thread efficiency was."""
    nhwc = k.nhwc and backend == "tvm" and NHWC_PROBES
    runs_model = nhwc_model(model) if nhwc else model
    run = _runner(backend, runs_model, work, threads)
    return run, (_nhwc_feeds(_feeds(k), runs_model) if nhwc else _feeds(k))


def _time_kernels(kernels: list[MicroKernel], backend: str, work: Path, quick: bool,
                  device: Device) -> list[dict[str, Any]]:
    """Build every micro-kernel, then time them in :func:`probe_rounds` interleaved rounds (each
    round every kernel in turn, the order rotated, each for its share of the time budget); a
    kernel's time is the median of its rounds' medians. Why: on a machine whose other core runs
    something else, a burst of that load (seconds long) slowed whichever probes ran then: three
    calibrations of one morning (Zen 4, 2 cores, load 1.2-1.7, each probe's runs back to back) timed
    the ``conv_train`` probe ``conv3x3_64c_28_b4_win`` 2.45, 2.58 and 3.61 ms and ``conv3x3_256c_7_b4_win``
    2.57-3.21 ms, which moved the zoo resnet's predicted 1-rank TVM step by 16%. Interleaved, a
    burst lands on a round of every kernel alike and the median of rounds drops it."""
    built = []
    for k in kernels:
        model = kernel_model(k)
        t0 = time.perf_counter()
        run, feeds = _probe_runner(k, model, backend, work)
        build_s = time.perf_counter() - t0
        built.append((k, model, run, _resident_weights(feeds, backend), build_s))
    rounds = probe_rounds()
    times: list[list[float]] = [[] for _ in built]
    for r in range(rounds):
        for i in [(j + r) % len(built) for j in range(len(built))]:
            _, _, run, feeds, _ = built[i]
            times[i].append(_median_time(lambda: run(feeds), quick, 1.0 / rounds))
    rows = []
    for (k, model, _, _, build_s), ts in zip(built, times):
        roof, launches = kernel_roof(model, device)
        rows.append({"kernel": k.name, "class": k.op_class, "measured_s": statistics.median(ts),
                     "roof_s": roof, "launches": launches, "build_s": round(build_s, 3), "rounds_s": ts})
    return rows


def measure_backend(backend: str, quick: bool, gemm_flops: float, bandwidth: float) -> dict[str, Any]:
    """Launch overhead and per-class efficiencies of ``backend``'s kernels on one thread.

    efficiency(kernel) = roof(kernel) / (median measured − launches · launch overhead), and
    efficiency(class) = the geometric mean over the class's micro-kernels (capped at
    :data:`~partitioner.cluster.MAX_CLASS_EFFICIENCY`), where roof is the roofline time at efficiency 1 against the measured
    GEMM rate and bandwidth (:func:`kernel_roof`). ``reduction`` has no micro-kernel of its own
    and takes the ``norm`` value (both are row reductions)."""
    import tempfile

    if backend not in BACKENDS:
        raise CalibrationError(f"unknown backend {backend!r}: use one of {', '.join(BACKENDS)}")
    device = Device("probe", "cpu", {"float32": gemm_flops}, 1e9, bandwidth)
    with tempfile.TemporaryDirectory(prefix="partitioner-calibrate-") as tmp:
        work = Path(tmp)
        if backend == "onnxruntime":
            launch = _ort_launch_overhead(200)
        else:
            chain = launch_chain(32)
            run = _runner(backend, kernel_model(chain), work)
            feeds = _feeds(chain)
            launch = _median_time(lambda: run(feeds), quick) / 32
        call = call_overhead(backend, work, launch, quick)
        comm_op = comm_op_overhead(backend, work, launch, quick)
        rows = _time_kernels(micro_kernels(quick), backend, work, quick, device)
    for r in rows:
        busy = max(r["measured_s"] - r["launches"] * launch, 0.25 * r["measured_s"])
        r["efficiency"] = r["roof_s"] / busy
    by_class: dict[str, float] = {}
    for cls in dict.fromkeys(r["class"] for r in rows):
        effs = [r["efficiency"] for r in rows if r["class"] == cls]
        by_class[cls] = min(math.exp(sum(math.log(e) for e in effs) / len(effs)), MAX_CLASS_EFFICIENCY)
    if "norm" in by_class:
        by_class["reduction"] = by_class["norm"]
    return {"launch_overhead_s": launch, "call_overhead_s": call, "comm_op_overhead_s": comm_op,
            "efficiency_by_class": by_class, "kernels": rows,
            "backend": backend}


def _best_time(fn: Any, runs: int) -> float:
    fn()
    best = float("inf")
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def measure_threads(backend: str, quick: bool, threads: int) -> dict[str, float]:
    """Probe 6: each micro-kernel's (:func:`micro_kernels`) best time on ``threads`` threads of
    ``backend`` (the best: the kernel's speed when it had its cores). Runs in a subprocess whose
    thread pool was created with that many workers (TVM sizes its pool once per process).

    Each kernel runs in the form probe 4 times it in (:func:`_probe_runner`: the depthwise probe
    in NHWC on TVM), and the rounds are interleaved: every round times every kernel in turn, so a
    kernel's rounds spread over the whole probe. Why: on the 2-core development machine (Zen 4
    under KVM, session 24) a kernel's best of 20 back-to-back 2-thread runs came in two states
    for seconds at a time, about 1x or 1.6-1.9x its 1-thread speed (``gemm_128x256x256``
    0.088-0.099 or 0.158-0.170 ms in six processes, ``conv3x3_256c_7`` 0.28 or 0.51 ms: the host's
    other tenants); with each kernel's rounds back to back, a kernel whose turn fell in the slow
    state was priced as if the second core did nothing for it (the ``conv`` class came out at 0.20
    in session 23, where convs inside a model ran about 2x faster on 2 threads). Interleaving
    makes that less likely, not impossible: when the slow state lasts the whole probe, five runs
    gave ``conv`` 0.67, 0.21, 0.67, 0.21, 0.07, and three later ones 0.67-0.69
    (``benchmarks/probe6_spread.py``, docs/calibration.md); the per-kernel times are kept in
    ``Calibration.thread_kernels``."""
    import tempfile

    rounds, runs = (3, 5) if quick else (8, 10)
    with tempfile.TemporaryDirectory(prefix="partitioner-calibrate-") as tmp:
        built = [(k.name, *_probe_runner(k, kernel_model(k), backend, Path(tmp), threads)) for k in micro_kernels(quick)]
        best = {name: float("inf") for name, _, _ in built}
        for r in range(rounds):
            for name, run, feeds in built[r % len(built):] + built[:r % len(built)]:
                best[name] = min(best[name], _best_time(lambda: run(feeds), runs))
    return best


def thread_efficiency(one: dict[str, float], many: dict[str, float], classes: dict[str, str],
                      threads: int) -> dict[str, float]:
    """Probe 6: per op class, the share of each extra thread a kernel turns into speed:
    speed-up(kernel) = best time on 1 thread (``one``) / best time on ``threads`` threads
    (``many``; both from :func:`measure_threads`); efficiency(class) = (geometric mean speed-up over the class's
    kernels − 1) / (threads − 1), clamped to [0, 1]. A backend that runs a class's kernels on one
    thread whatever the pool size (measured: TVM's elementwise kernels on this project's
    schedules) gets 0 there, and a rank's threads then speed up only the classes that use them
    (:mod:`partitioner.cost.threads`). ``classes``: kernel name -> op class."""
    if threads < 2:
        return {}
    by_class: dict[str, list[float]] = {}
    for name, t1 in one.items():
        tn = many.get(name, 0.0)
        if t1 > 0 and tn > 0 and name in classes:
            by_class.setdefault(classes[name], []).append(math.log(t1 / tn))
    eff = {c: min(max((math.exp(sum(v) / len(v)) - 1) / (threads - 1), 0.0), 1.0) for c, v in by_class.items()}
    if "norm" in eff:
        eff["reduction"] = eff["norm"]
    return eff


def run_thread_probe(quick: bool, backend: str,
                     threads: int) -> tuple[dict[str, float], tuple[dict[str, Any], ...]]:
    """Probe 6 as :func:`calibrate` runs it: the micro-kernels on 1 thread, then on ``threads``, each in
    a subprocess of its own; returns the per-class efficiencies (:func:`thread_efficiency`) and each
    kernel's two best times (``{"kernel", "class", "one_s", "many_s"}``, ``Calibration.thread_kernels``)."""
    timeout = 120 if quick else 300
    one, many = (_run_probe(quick, timeout=timeout, backend=backend, threads=t) for t in (1, threads))
    classes = {k.name: k.op_class for k in micro_kernels(quick)}
    kernels = tuple({"kernel": n, "class": classes.get(n, ""), "one_s": t1, "many_s": many.get(n)}
                    for n, t1 in one.items())
    return thread_efficiency(one, many, classes, threads), kernels


# ---- single-core probe (runs in a subprocess with one BLAS thread) ----------------------------

def _probe(quick: bool, backend: str = DEFAULT_BACKEND) -> dict[str, Any]:
    import numpy as np

    n = 512 if quick else 1024
    rng = np.random.default_rng(0)
    a = rng.standard_normal((n, n), dtype=np.float32)
    b = rng.standard_normal((n, n), dtype=np.float32)
    a @ b  # warm-up
    clock = _clock()
    best = float("inf")
    deadline = time.perf_counter() + (1.0 if quick else 3.0)
    reps = 0
    while reps < 3 or (time.perf_counter() < deadline and reps < 30):
        t0 = clock()
        a @ b
        best = min(best, clock() - t0)
        reps += 1
    gemm = 2.0 * n ** 3 / best

    size = (64 if quick else 256) * 2 ** 20
    src = np.ones(size // 4, np.float32)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    bw_best = float("inf")
    for _ in range(3 if quick else 5):
        t0 = clock()
        np.copyto(dst, src)
        bw_best = min(bw_best, clock() - t0)
    bandwidth = 2.0 * size / bw_best

    measured = measure_backend(backend, quick, gemm, bandwidth)
    try:  # the physical limit, through TVM (absent TVM: the fields stay None)
        from backends.tvm.peak import measure_peak

        peak = measure_peak(quick=quick)
        limits = {"fma_peak_flops": peak.fma_flops, "stream_bandwidth": peak.bandwidth,
                  "parallel_min_flops": peak.parallel_min_flops}
    except ImportError:
        limits = {}
    return {"gemm_flops": gemm, "gemm_n": n, "memory_bandwidth": bandwidth, **limits, **measured}


def _probe_main() -> None:
    backend = next((a.split("=", 1)[1] for a in sys.argv if a.startswith("--backend=")), DEFAULT_BACKEND)
    threads = int(next((a.split("=", 1)[1] for a in sys.argv if a.startswith("--threads=")), "0"))
    if threads > 0:  # probe 6 only
        print(json.dumps(measure_threads(backend, "--quick" in sys.argv, threads)))
        return
    print(json.dumps(_probe("--quick" in sys.argv, backend)))


def probe_threads() -> int:
    """Threads of probe 6: the cores this process may run on, at most 8 (a rank's share of a node)."""
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        usable = os.cpu_count() or 1
    return max(1, min(usable, 8))


def sustained_rate(fn: Any, units: float, seconds: float) -> float:
    """``units`` of work per second while ``fn`` (one call = ``units``) runs back to back for at
    least ``seconds`` and at least twice: a sustained rate, not the best single call's burst."""
    n, t0 = 0, time.perf_counter()
    while n < 2 or time.perf_counter() - t0 < seconds:
        fn()
        n += 1
    return units * n / (time.perf_counter() - t0)


def co_run_bandwidth(cores: int, quick: bool, moved: int | None = None) -> tuple[float, ...]:
    """Probe 7: per round, the mean bandwidth of ``cores`` threads copying at once (each pinned to
    one usable CPU, its own arrays of probe 2's kind) over the first thread's bandwidth copying
    alone just before. Each phase copies back to back for a fixed time (sustained bandwidth, as a
    step's memory-bound kernels draw it; the best single copy of probe 2 caught bursts: 0.86-1.14
    in one calibration against 0.64-0.81 sustained); ``numpy.copyto`` releases the GIL, so the
    threads' copies overlap. The timed loop is :func:`sustained_rate`, shared with
    ``benchmarks/co_run.py``. ``moved``: the bytes one copy moves (default: 32 or 64 MiB arrays,
    out of every cache; :data:`CO_RUN_CACHED_BYTES`, read + write of 1 MiB arrays: the in-cache
    copy, whose share the roofline's rule 8 reads at those bytes). Measured on Zen 5 (session 27,
    2 cores, 7 rounds each): a copy of 2-8 MiB moved kept 0.93-0.97 of its lone rate with both
    cores copying, 16 MiB 0.56, 32 MiB 0.42, 64 MiB 0.46, 128 MiB 0.53 (``benchmarks/co_run.py
    --sweep``, ``session27_zen5/co_run_sweep.json``): the memory system is shared beyond the
    caches, not within them."""
    import threading

    import numpy as np

    cpus = sorted(os.sched_getaffinity(0))[:cores] if hasattr(os, "sched_getaffinity") else []
    size, span = (32 if quick else 64) * 2 ** 20 if moved is None else moved // 2, 0.1 if quick else 0.25
    arrays = [(np.ones(size // 4, np.float32), np.empty(size // 4, np.float32)) for _ in range(cores)]
    barrier = threading.Barrier(cores + 1)
    plan: dict[str, Any] = {"who": 0, "stop": False}
    rate = [0.0] * cores

    def worker(i: int) -> None:
        if cpus:
            os.sched_setaffinity(0, {cpus[i]})  # this thread only (Linux)
        src, dst = arrays[i]
        np.copyto(dst, src)
        while True:
            barrier.wait()  # a phase starts (or the probe ends)
            if plan["stop"]:
                return
            if i < plan["who"]:
                rate[i] = sustained_rate(lambda: np.copyto(dst, src), 2.0 * size, span)
            barrier.wait()  # the phase's results are in

    pool = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(cores)]
    for t in pool:
        t.start()

    def phase(who: int) -> list[float]:
        plan["who"] = who
        barrier.wait()
        barrier.wait()
        return rate[:who]

    shares = []
    try:
        for _ in range(3 if quick else 7):
            alone = phase(1)[0]
            shares.append(round(statistics.fmean(phase(cores)) / alone, 4))
    finally:
        plan["stop"] = True
        barrier.wait()
        for t in pool:
            t.join(10)
    return tuple(shares)


def _cores_free(threads: int) -> bool:
    """Probe 6 needs its cores: a parallel speed-up measured while other work holds the cores
    measures that work (on the loaded 2-core development machine, load average 6, TVM's GEMM
    kernels showed no gain from a second thread, and 1.8-1.9x when the machine was quieter).
    So it runs only while the 1-minute load average is under ``threads`` − 0.5 (this calibration's
    own probe counts about 1); otherwise classes keep the nominal thread efficiency."""
    try:
        return os.getloadavg()[0] < threads - 0.5
    except OSError:  # no load average on this platform: measure anyway
        return True


def _run_probe(quick: bool, timeout: float, backend: str = DEFAULT_BACKEND, threads: int = 0) -> dict[str, Any]:
    """Run the single-core probe (``threads`` 0) or probe 6 on ``threads`` threads in a subprocess."""
    env = dict(os.environ, **_SINGLE_THREAD_ENV, TVM_NUM_THREADS=str(max(1, threads)))
    root = str(Path(__file__).resolve().parents[1])  # the backends package sits beside partitioner
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    code = "import sys; from partitioner.calibrate import _probe_main; _probe_main()"
    args = [sys.executable, "-c", code, f"--backend={backend}", f"--threads={threads}"] + (["--quick"] if quick else [])
    try:
        out = subprocess.run(args, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        raise CalibrationError(f"the single-core probe took longer than {timeout:.0f} s") from None
    if out.returncode != 0:
        last = (out.stderr.strip().splitlines() or ["no output"])[-1]
        raise CalibrationError(f"the single-core probe failed: {last}")
    return json.loads(out.stdout.strip().splitlines()[-1])


# ---- MPI probe -------------------------------------------------------------------------------

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


def _run_mpi(quick: bool, timeout: float) -> tuple[dict[str, Any] | None, str]:
    """Run :mod:`partitioner.calibrate_mpi` under ``mpiexec -n 2`` (the mpich wheel's, next to
    this interpreter, else PATH's). Returns ``(measurements, "")`` or ``(None, why)``: a failed
    probe is reported with its reason (``mpi.error`` in ``calibrate --json``), never silently."""
    from partitioner.runtime.launch import find_mpiexec

    mpiexec = find_mpiexec(required=False)
    if mpiexec is None:
        return None, "mpiexec not found: install the mpich wheel (pip install mpich) or put mpiexec on PATH"
    args = [mpiexec, "-n", "2", sys.executable, "-m", "partitioner.calibrate_mpi"] + (["--quick"] if quick else [])
    env = dict(os.environ, **_SINGLE_THREAD_ENV)
    try:
        out = subprocess.run(args, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return None, f"{mpiexec} -n 2 took longer than {timeout:.0f} s"
    except OSError as exc:
        return None, f"cannot start {mpiexec}: {exc.strerror}"
    last_err = (out.stderr.strip().splitlines() or ["no output on stderr"])[-1][:300]
    if out.returncode != 0 or not out.stdout.strip():
        return None, f"{mpiexec} -n 2 exited with {out.returncode}: {last_err}"
    try:
        data = json.loads(out.stdout.strip().splitlines()[-1])
    except json.JSONDecodeError:
        return None, f"the MPI probe printed no JSON: {out.stdout.strip().splitlines()[-1][:200]}"
    if "pingpong" not in data:
        return None, f"the MPI probe failed: {data.get('error', data)}"
    return data, ""


# ---- putting it together ---------------------------------------------------------------------

def calibrate(quick: bool = False, backend: str = DEFAULT_BACKEND, mpi: bool = True,
              thread_probe: bool | None = None) -> Calibration:
    """Run the probes (module docstring) and return the measurements; ``backend`` selects whose
    kernels the per-class efficiencies and launch overhead describe; ``mpi=False`` skips the
    MPI probe (the link keeps nominal numbers); ``thread_probe`` True runs probe 6 even while
    the cores are busy, False never, None when they are free."""
    if backend not in BACKENDS:
        raise CalibrationError(f"unknown backend {backend!r}: use one of {', '.join(BACKENDS)}")
    probe_rounds()  # a bad $PARTITIONER_CALIBRATE_ROUNDS is refused here, not in the probe subprocess
    t0 = time.perf_counter()
    single = _run_probe(quick, timeout=120 if quick else 300, backend=backend)
    threads = probe_threads()
    thread_eff: dict[str, float] = {}
    co_run: tuple[float, ...] = ()
    co_cached: tuple[float, ...] = ()
    thread_kernels: tuple[dict[str, Any], ...] = ()
    if threads > 1 and (thread_probe if thread_probe is not None else _cores_free(threads)):
        thread_eff, thread_kernels = run_thread_probe(quick, backend, threads)
        co_run = co_run_bandwidth(threads, quick)
        co_cached = co_run_bandwidth(threads, quick, CO_RUN_CACHED_BYTES)
    # generous timeouts: mpiexec start-up plus numpy/mpi4py imports take seconds on a busy machine
    mpi, mpi_error = _run_mpi(quick, timeout=60 if quick else 120) if mpi else (None, "skipped (mpi=False)")
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
        launch_overhead_s=float(single["launch_overhead_s"]), call_overhead_s=float(single.get("call_overhead_s", 0.0)),
        comm_op_overhead_s=float(single.get("comm_op_overhead_s", 0.0)),
        thread_efficiency_by_class=thread_eff, threads_probed=threads if thread_eff else 1,
        co_run_bandwidth=min(1.0, statistics.median(co_run)) if co_run else 1.0, co_run_rounds=co_run,
        co_run_cached_bandwidth=min(1.0, statistics.median(co_cached)) if co_cached else 0.0,
        co_run_cached_rounds=co_cached,
        thread_kernels=thread_kernels,
        alpha_s=alpha, beta_s_per_byte=beta, pingpong=tuple(pp), allreduce=tuple(ar),  # type: ignore[arg-type]
        mpi_ok=mpi is not None, mpi_error=mpi_error, seconds=time.perf_counter() - t0, machine=machine_info(),
        backend=backend, efficiency_by_class={k: float(v) for k, v in single.get("efficiency_by_class", {}).items()},
        kernels=tuple(single.get("kernels", ())),
        fma_peak_flops=single.get("fma_peak_flops"), stream_bandwidth=single.get("stream_bandwidth"),
        parallel_min_flops=single.get("parallel_min_flops"),
    )


def cluster_from_calibration(cal: Calibration, n: int | None = None) -> Cluster:
    """``n`` (default: all cores) identical one-core devices sharing one node and the MPI link."""
    n = n or os.cpu_count() or 1
    f32 = cal.gemm_flops
    peak = {"float32": f32, "float16": f32, "bfloat16": f32, "int8": 2 * f32}
    mem = total_memory_bytes() / n
    devs = tuple(Device(f"cpu{i}", "cpu", dict(peak), mem, cal.memory_bandwidth, 1.0, cal.launch_overhead_s,
                        dict(cal.efficiency_by_class), cal.call_overhead_s, cal.backend, cal.comm_op_overhead_s,
                        dict(cal.thread_efficiency_by_class), cal.co_run_bandwidth,
                        cal.co_run_cached_bandwidth)
                 for i in range(n))
    link = LinkLevel("shm-mpi" if cal.mpi_ok else "shm", cal.alpha_s, cal.beta_s_per_byte)
    notes = (f"calibrated {time.strftime('%Y-%m-%d %H:%M:%S')} on {cal.machine.get('cpu', '?')} "
             f"for the {cal.backend} backend"
             f"{'' if cal.mpi_ok else '; MPI probe failed, link is nominal'}")
    return Cluster("local", devs, (tuple(range(n)),), (link,), notes)


def calibrate_and_cache(backend: str = DEFAULT_BACKEND, quick: bool = True,
                        thread_probe: bool | None = None) -> tuple[Calibration, Cluster]:
    """Calibrate this machine for ``backend`` and store the result in the per-machine cache
    (:mod:`partitioner.calibrate_cache`), which the ``cpu:N`` preset reads from then on."""
    from partitioner.calibrate_cache import save_cached

    cal = calibrate(quick=quick, backend=backend, thread_probe=thread_probe)
    one = cluster_from_calibration(cal, 1)
    save_cached(one.to_json(), cal.to_json(), backend)
    return cal, one
