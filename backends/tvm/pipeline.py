"""The TVM backend's Relax pipeline, TVM-style: one function per phase, each returning a list
of passes (like ``tvm.relax.backend.cpu_generic.pipeline``).

Phases, in order (:func:`passes`):

1. ``simplify``: ``DecomposeOpsForInference`` (batch norm -> scale/shift, so it fuses into
   the conv epilogue), ``CanonicalizeBindings``.
2. ``layout`` (CPU only): ``ConvertLayout`` conv2d -> NHWC data / HWIO weights. Channels
   become the innermost axis, so conv, depthwise conv and pooling vectorise over channels and
   a 1x1 conv is a plain GEMM; weights are transposed once, at compile time, by FoldConstant.
3. ``legalize``: TVM's zero pipeline (LegalizeOps, AnnotateTIROpPattern, FoldConstant,
   FuseOps, FuseTIR), plus MetaScheduleApplyDatabase when a tuning database is current.
4. ``schedule`` (CPU only): the default rules of :mod:`backends.tvm.schedules` for every
   PrimFunc not already scheduled (a tuned function from the database is kept as tuned).

``tvm.compile`` then runs the target's dataflow-lowering and finalisation phases.
Pipelines by name: ``"zero"`` (TVM's zero pipeline alone, no schedules) and ``"scheduled"``
(all four phases; the default).
"""

from __future__ import annotations

from typing import Any

PIPELINES = ("scheduled", "zero")
DEFAULT_PIPELINE = "scheduled"

# conv2d goes NHWC (the schedules vectorise over output channels); TVM cannot compile a
# transposed convolution in NHWC, so it stays NCHW (ConvertLayout inserts the transposes).
CONV_LAYOUT = {"relax.nn.conv2d": ["NHWC", "HWIO"], "relax.nn.conv2d_transpose": ["NCHW", "IOHW"]}


def _is_cpu(target: Any) -> bool:
    return str(target.kind.name) == "llvm"


def simplify_passes(target: Any) -> list[Any]:
    from tvm import relax

    return [relax.transform.DecomposeOpsForInference(), relax.transform.CanonicalizeBindings()]


def layout_passes(target: Any) -> list[Any]:
    from tvm import relax

    if not _is_cpu(target):
        return []
    return [relax.transform.ConvertLayout(CONV_LAYOUT), relax.transform.Normalize()]


def legalize_passes(target: Any) -> list[Any]:
    from tvm import relax

    return [relax.get_pipeline("zero")]


def schedule_passes(target: Any) -> list[Any]:
    if not _is_cpu(target):
        return []
    from .schedules import default_rules
    from tvm.s_tir import dlight as dl

    return [dl.ApplyDefaultSchedule(*default_rules(target))]


def passes(name: str, target: Any) -> list[Any]:
    """The pass list of pipeline ``name`` for ``target`` (a ``tvm.target.Target``)."""
    from tvm import relax

    if name == "zero":
        return [relax.get_pipeline("zero")]
    if name == "scheduled":
        return simplify_passes(target) + layout_passes(target) + legalize_passes(target) + schedule_passes(target)
    from partitioner.errors import BackendError

    raise BackendError(f"unknown TVM pipeline {name!r}; use one of {', '.join(PIPELINES)}")


def run_pipeline(mod: Any, name: str, target: Any) -> Any:
    """Apply pipeline ``name`` to ``mod`` under ``target`` (dlight rules read the current target)."""
    import tvm

    with target:
        return tvm.transform.Sequential(passes(name, target))(mod)
