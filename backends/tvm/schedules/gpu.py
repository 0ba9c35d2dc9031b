"""Default GPU schedules for the TVM backend: dlight's GPU rules, in dlight's own order.

On a GPU an unscheduled PrimFunc does not even build (a loop nest with no thread binding is
rejected by ``VerifyMemory``: "did you forget to bind?"), so every kernel of a CUDA rank gets one
of these rules, most specific first (the order of TVM's own CUDA pipeline,
``tvm.relax.backend.cuda.pipeline.legalize_passes``):

1. ``Matmul``: matmul / batch matmul / dense (and the 1x1-conv-shaped ones), tiled through shared
   memory (tensor cores when the target's arch and dtypes allow);
2. ``GEMV``: matrix-vector products (a decode step, a batch-1 dense layer);
3. ``Reduction`` and ``GeneralReduction``: softmax, LayerNorm, sums, pooling as a reduction;
4. ``Fallback``: everything else (elementwise chains, transposes, direct convolutions), with the
   loop nest fused and bound to blocks and threads.

A kernel tuned into the MetaSchedule database (``--tuning-db``, :mod:`backends.tvm.tuning`) is
applied before these rules and kept as tuned: ``ApplyDefaultSchedule`` skips functions that are
already scheduled. Tuning itself times candidates on a GPU, so it runs only where one is visible;
applying the database does not need one.

Invariant (as for the CPU rules): schedules only reorder, split, bind and cache, so a scheduled
kernel computes what the unscheduled one does up to float rounding order.
"""

from __future__ import annotations

from typing import Any


def gpu_rules(target: Any) -> list[Any]:
    """dlight's GPU rules, most specific first; each but the last is guarded (see :func:`guarded`)."""
    from tvm.s_tir import dlight as dl

    specific = [dl.gpu.Matmul(), dl.gpu.GEMV(), dl.gpu.Reduction(), dl.gpu.GeneralReduction()]
    return [guarded(r) for r in specific] + [dl.gpu.Fallback()]


def guarded(rule: Any) -> Any:
    """``rule``, where an exception inside it means "not mine" (``None``), so the next rule runs.

    dlight's pattern analyses assert on shapes they were not written for instead of declining:
    ``GEMV``'s ``normalize`` raised a bare AssertionError on a MobileNetV2 kernel (zoo
    ``mobilenet``, image 32, width 0.5), which failed the whole build. A schedule that was
    returned is kept; a rule that raised has only worked on its own copy of the function, so
    declining leaves the function as it was for the next rule.
    """
    from tvm.s_tir.dlight.base import ScheduleRule

    class Guarded(ScheduleRule):
        def apply(self, func: Any, target: Any, tunable: bool) -> Any:
            try:
                return rule.apply(func, target, tunable)
            except Exception:  # noqa: BLE001 - dlight's analyses assert instead of declining
                return None

        def __repr__(self) -> str:
            return f"guarded({type(rule).__name__})"

    return Guarded()


def require_gpu_for_tuning(target: Any) -> None:
    """Tuning times candidates on the device: refuse (one line) when no GPU is visible here."""
    from partitioner.core.errors import BackendError
    from backends.cuda_devices import arch_runs_on, visible_gpus

    arch = str(target.attrs.get("arch", ""))
    gpus = visible_gpus()
    if not any(arch_runs_on(arch, g) for g in gpus):
        here = ", ".join(f"{g.name} ({g.arch})" for g in gpus) or "none"
        raise BackendError(f"--tune-trials for cuda {arch} times kernels on a GPU that runs {arch}; visible GPUs: "
                           f"{here}. Tune on the GPU machine and pass its --tuning-db here (applying needs no GPU)")


def cuda_kernel_count(executable_mod: Any) -> int:
    """How many ``__global__`` CUDA kernels a compiled module holds (its CUDA source, kept beside
    the cubins): the build's own evidence that every kernel was scheduled and compiled for the GPU."""
    stack, count = [executable_mod], 0
    while stack:
        m = stack.pop()
        if str(m.kind) == "cuda":
            count += m.inspect_source().count("__global__")
        stack.extend(m.imports)
    return count
