"""The bytes a TVM library allocates when it runs, read from its module before code generation.

Rules:

1. :func:`planned_bytes` lowers and schedules ``program`` as :func:`backends.tvm.build.build_one`
   does for a 1-thread library (:func:`~backends.tvm.lower.lower_program`, then the CPU
   pipeline), then runs the Relax passes ``tvm.compile`` runs before code generation up to
   ``StaticPlanBlockMemory`` (Relax's default build pipeline, TVM 0.27), and reads the
   allocations the VM will make per call:

   - ``storage``: every ``R.memory.alloc_storage`` (the planner's blocks; intermediates share
     them where their lifetimes do not overlap). The VM takes them from its pooled allocator,
     which keeps freed blocks for the next call of the same size, so the library holds them
     from its first call on;
   - ``outputs``: every ``R.builtin.alloc_tensor`` the planner left (the function's results: a
     fresh tensor per call, held by the caller after the call).

   Summed over the module's Relax functions (``main`` calls each segment function once).
2. Why not the ONNX graph's own peak (:func:`partitioner.cost.workdepth.peak_activation_bytes`):
   the lowered program holds more than the graph's values. Each GEMM of a weight input packs the
   weight per call into a tensor of its own (``*_weight_prepack``), and the planner reuses a
   block only for a value of a fitting size. Measured on the zoo's 1-rank TVM training steps
   (session 23): the graph's peak was 28 MiB for the mlp's forward and backward segment (batch
   1024, 4 x 1024), the planned storage 40 MiB plus 16 MiB of outputs; bert's 111 MiB against
   116 + 7.
3. None when the program does not lower on TVM alone (an op that falls back to ONNX Runtime
   segments, or an import error): the caller keeps its other rule.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx


@dataclass(frozen=True)
class PlannedBytes:
    """Rule 1's allocations of one library per call (bytes)."""

    storage: float
    outputs: float

    @property
    def total(self) -> float:
        return self.storage + self.outputs


def planned_bytes(program: onnx.ModelProto) -> PlannedBytes | None:
    """Rule 1 (cached per program in the process: the same segment priced twice is lowered once)."""
    key = hashlib.sha256(program.SerializeToString()).hexdigest()
    if key not in _CACHE:
        _CACHE[key] = _planned(program)
    return _CACHE[key]


_CACHE: dict[str, PlannedBytes | None] = {}


def _planned(program: onnx.ModelProto) -> PlannedBytes | None:
    import tvm
    from tvm import relax

    from partitioner.core.errors import PartitionerError

    from .build import DEFAULT_PIPELINE, _cpu_module
    from .lower import lower_program
    from .schedules.threads import building_for
    from .target import target_dict

    try:
        lowered = lower_program(program)
        if lowered.fallback_segments:
            return None
        target = tvm.target.Target(target_dict(None))
        with building_for(1):
            mod, _ = _cpu_module(lowered.mod, target, DEFAULT_PIPELINE, {"threads": 1})
        passes = tvm.transform.Sequential([
            relax.transform.LegalizeOps(), relax.transform.RewriteDataflowReshape(), relax.transform.ToNonDataflow(),
            relax.transform.RemovePurityChecking(), relax.transform.CallTIRRewrite(),
            relax.transform.StaticPlanBlockMemory()])
        with target:
            mod = passes(mod)
    except (PartitionerError, tvm.error.TVMError, ValueError, KeyError):  # rule 3
        return None
    storage = outputs = 0.0
    for _, func in mod.functions.items():
        if isinstance(func, relax.Function):
            s, o = _allocations(func)
            storage, outputs = storage + s, outputs + o
    return PlannedBytes(storage, outputs)


def _allocations(func: Any) -> tuple[float, float]:
    """Rule 1's two sums over one Relax function's bindings."""
    import tvm
    from tvm import relax

    storage = outputs = 0.0

    def visit(expr: Any) -> None:
        nonlocal storage, outputs
        if isinstance(expr, relax.SeqExpr):
            for block in expr.blocks:
                for binding in block.bindings:
                    visit(binding.value)
            visit(expr.body)
        elif isinstance(expr, relax.If):
            visit(expr.true_branch)
            visit(expr.false_branch)
        elif isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op):
            name = expr.op.name
            if name == "relax.memory.alloc_storage":
                storage += float(_shape_product(expr.args[0]))  # a byte count
            elif name == "relax.builtin.alloc_tensor":
                dtype = np.dtype(str(expr.args[1].value))
                outputs += float(_shape_product(expr.args[0])) * dtype.itemsize

    visit(func.body)
    return storage, outputs


def _shape_product(shape: Any) -> int:
    """The element count of a static ``R.shape([...])`` (a symbolic dim counts 0: not priced)."""
    total = 1
    for d in shape.values:
        if not hasattr(d, "value"):
            return 0
        total *= int(d.value)
    return total


__all__ = ["PlannedBytes", "planned_bytes"]
