"""Default CPU schedules for the TVM backend (no tuning), written as dlight schedule rules.

A rule takes one PrimFunc and returns a scheduled ``tvm.s_tir.Schedule`` or ``None`` (not
mine); :func:`default_rules` lists them in priority order and :func:`apply_default_schedules`
runs ``dlight.ApplyDefaultSchedule`` with them over every PrimFunc of a module:

0. :class:`GemmPacked` - matrix products (MatMul, Gemm, batched MatMul; N padded to the vector
   width when needed): packed B (constant weights packed at build time), register-blocked
   micro-kernel sized to the target's vector registers.
1. :class:`Depthwise` - NHWC depthwise convolutions (groups = channels) and NHWC max/average
   pooling: output rows in parallel, channels in vectors, padding inlined into the loads,
   BN/clamp fused.
2. :class:`Contraction` - one reduction block (conv2d incl. depthwise/grouped, matmul, batch
   matmul, pooling, global pooling) with injective producers/consumers: register tiling,
   vectorised over the output's innermost axis, parallel over outer tiles, fused epilogue.
3. :class:`Rowwise` - LayerNorm / softmax: reductions over a row's last axis with vector
   accumulators, then the row's elementwise write, one row at a time.
4. dlight's CPU ``Reduction`` - reduction functions that Rowwise does not match.
5. :class:`Injective` - elementwise chains, transposes, padding: parallel + vectorised.

Invariant: schedules only reorder/split/annotate loops (TVM checks each primitive), so a
scheduled function computes the same values as the unscheduled one up to float rounding
order; a rule that cannot apply returns ``None`` and leaves the function to the next rule.
One step is not a TVM primitive: the depthwise rule's border split
(``depthwise._split_border_columns``) rewrites one loop as three loops over consecutive ranges
with the same body, which runs the same iterations in the same order.
"""

from __future__ import annotations

import importlib
from typing import Any

# name -> submodule, imported on first use (PEP 562): ``threads`` (read when an artifact loads)
# must not pull in dlight, which needs the compiler side of TVM
_LAZY = {"Contraction": "contraction", "Depthwise": "depthwise", "GemmPacked": "gemm_packed",
         "Injective": "injective", "Rowwise": "rowwise", "vector_lanes": "vector"}

__all__ = ["Contraction", "Depthwise", "GemmPacked", "Injective", "Rowwise", "apply_default_schedules", "default_rules", "vector_lanes"]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{module}", __name__), name)


def default_rules(target: Any) -> list[Any]:
    """The CPU rules, most specific first."""
    from tvm.s_tir import dlight as dl

    from .contraction import Contraction
    from .depthwise import Depthwise
    from .gemm_packed import GemmPacked
    from .injective import Injective
    from .rowwise import Rowwise

    return [GemmPacked(), Depthwise(), Contraction(), Rowwise(), dl.cpu.Reduction(), Injective()]


def apply_default_schedules(mod: Any, target: Any) -> Any:
    """Schedule every not-yet-scheduled PrimFunc of ``mod`` for the llvm ``target``."""
    from tvm.s_tir import dlight as dl

    with target:
        return dl.ApplyDefaultSchedule(*default_rules(target))(mod)
