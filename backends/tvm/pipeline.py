"""The TVM backend's Relax pipeline, TVM-style: one function per phase, each returning a list
of passes (like ``tvm.relax.backend.cpu_generic.pipeline``).

Phases, in order (:func:`passes`):

1. ``simplify``: :mod:`backends.tvm.fold_small_constants` (small constant arithmetic in numpy),
   ``DecomposeOpsForInference`` (batch norm -> scale/shift, so it fuses into
   the conv epilogue), ``CanonicalizeBindings``.
2. ``layout`` (CPU only): ``ConvertLayout`` conv2d -> NHWC data / HWIO weights. Channels
   become the innermost axis, so conv, depthwise conv and pooling vectorise over channels and
   a 1x1 conv is a plain GEMM; weights are transposed once, at compile time, by FoldConstant.
   A long convolution-free tail of a block (an unrolled decoder) is kept out of ConvertLayout,
   whose time is quadratic in the block's length (:mod:`backends.tvm.layout_region`).
   Then, when the build asks for it (option ``conv_algorithm``), convolutions are rewritten to
   im2col+GEMM or Winograd (:mod:`backends.tvm.conv_algorithms`).
3. ``legalize``: on the CPU, inference batch norms become an add after the conv whose weights
   absorb their scale (:mod:`backends.tvm.fold_batchnorm`); float32 ``erf``/``tanh``/``sigmoid``/``softmax`` first become TOPI's fast
   polynomial versions (:func:`_fast_math_map`); then TVM's zero pipeline (LegalizeOps,
   AnnotateTIROpPattern, FoldConstant, FuseOps, FuseTIR), plus MetaScheduleApplyDatabase when a
   tuning database is current.
4. ``schedule``: on the CPU the default rules of :mod:`backends.tvm.schedules`, on CUDA dlight's
   GPU rules (:mod:`backends.tvm.schedules.gpu`), for every PrimFunc not already scheduled (a
   tuned function from the database is kept as tuned).

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

    from .fold_small_constants import fold_small_constants_pass

    # importer's constant index arithmetic folded in numpy: FoldConstant compiles each call (fold_small_constants.py)
    return [fold_small_constants_pass(), relax.transform.DecomposeOpsForInference(), relax.transform.CanonicalizeBindings()]


def layout_passes(target: Any) -> list[Any]:
    from tvm import relax

    from .normalize_axes import normalize_axes_pass

    if not _is_cpu(target):
        return []
    from .clip_as_max_min import clamp_passes
    from .layout_region import convert_layout_pass

    # negative squeeze axes crash ConvertLayout with std::bad_alloc (backends/tvm/normalize_axes.py);
    # Clip's selects become maximum/minimum around ConvertLayout, which sees through those
    return [normalize_axes_pass(), *clamp_passes([convert_layout_pass(CONV_LAYOUT), relax.transform.Normalize()])]


def _fast_math_map() -> dict[str, Any]:
    """float32 ``erf``, ``tanh`` and ``softmax`` legalized to TOPI's vectorisable polynomial
    versions (the approximations Eigen uses). TVM's default ``erf``/``tanh`` become scalar libm
    calls that LLVM cannot vectorise: measured on 512x512 float32, one thread, erf 4.08 ms ->
    0.078 ms, tanh 1.48 -> 0.076 ms, softmax over [8,4,64,64] 0.47 -> 0.16 ms, with max relative
    error 3.6e-7 against numpy/scipy (the default tanh's was 1.1e-4). Other dtypes keep TVM's
    legalization."""
    import tvm
    from tvm import topi

    def fast(op_name: str, make):
        default = tvm.ir.Op.get(op_name).get_attr("FLegalize")

        def legalize(bb, call):
            if str(call.args[0].ty.dtype) != "float32":
                return default(bb, call)
            return make(bb, call)

        return legalize

    return {
        "relax.erf": fast("relax.erf", lambda bb, call: bb.call_te(topi.fast_erf, call.args[0])),
        "relax.tanh": fast("relax.tanh", lambda bb, call: bb.call_te(topi.fast_tanh, call.args[0])),
        "relax.sigmoid": fast("relax.sigmoid", lambda bb, call: bb.call_te(_fast_sigmoid, call.args[0])),
        "relax.exp": fast("relax.exp", lambda bb, call: bb.call_te(_fast_exp, call.args[0])),
        "relax.nn.softmax": fast("relax.nn.softmax",
                                 lambda bb, call: bb.call_te(topi.nn.fast_softmax, call.args[0], int(call.attrs.axis))),
    }


#: inputs above this take ``fast_exp(x - 1) * e``: TOPI's ``fast_exp`` clamps its input at 88.376,
#: so ``exp`` of (88.376, 88.722], still finite in float32, would come out ``inf``
EXP_SHIFT_FROM = 88.0


def _fast_exp(x: Any) -> Any:
    """float32 ``exp`` with TOPI's vectorisable ``fast_exp`` (TVM's default is a scalar ``expf``
    call per element: ``exp(-x^2) * x`` over 2048 x 1024 took 10.68 ms against 1.75 on 1 thread,
    benchmarks/copy_kernels_micro.py; in bert's GELU-gradient GEMM epilogue it did not move the
    kernel measurably, 33.3 against 34.1 ms a step, the GEMM dominates). Relative error against
    float64 (measured, 1M uniform samples per range): 5.7e-7 for |x| < 10, 4.1e-6 up to the overflow
    bound (range reduction with a float32 ln 2); NaN, +inf and -inf give NaN, inf and 0; inputs
    below about -87.3 give 0 where ``expf`` gives a denormal (an absolute error under 1.2e-38)."""
    from tvm import te, tirx, topi

    big = tirx.const(EXP_SHIFT_FROM, x.dtype)
    one = tirx.const(1.0, x.dtype)
    shifted = te.compute(x.shape, lambda *i: tirx.Select(x(*i) > big, x(*i) - one, x(*i)), name="exp_shift")
    e = topi.fast_exp(shifted)
    euler = tirx.const(2.718281828459045, x.dtype)
    return te.compute(x.shape, lambda *i: tirx.Select(x(*i) > big, e(*i) * euler, e(*i)),
                      name="fast_exp_full", tag="elemwise")


def _fast_sigmoid(x: Any) -> Any:
    """``1 / (1 + exp(-x))`` with TOPI's vectorisable ``fast_exp`` (TVM's sigmoid is a scalar
    ``expf`` call per element: the LSTM/GRU gates of ``passes.expand_recurrent`` spend most of
    their elementwise time there)."""
    from tvm import te, tirx, topi

    e = topi.fast_exp(topi.negative(x))
    one = tirx.const(1.0, x.dtype)
    return te.compute(x.shape, lambda *i: one / (one + e(*i)), name="fast_sigmoid", tag="elemwise")


def legalize_passes(target: Any) -> list[Any]:
    from tvm import relax

    if not _is_cpu(target):
        return [relax.get_pipeline("zero")]
    from .clip_as_max_min import function_pass
    from .conv_algorithms import conv_transpose_as_matmul
    from .fold_batchnorm import fold_batchnorm_pass
    from .fold_small_constants import fold_small_constants_pass

    # conv weights' layout transposes (from ConvertLayout) folded in numpy, not compiled one by one;
    # non-overlapping ConvTranspose (constant weight) as one GEMM + pixel shuffle;
    # batch norm's (x - mean) / sd * gamma + beta: folded into the conv weights + one add
    return [fold_small_constants_pass(), relax.transform.FoldConstant(),
            function_pass("ConvTransposeAsMatmul", conv_transpose_as_matmul), fold_batchnorm_pass(),
            relax.transform.LegalizeOps(customize_legalize_map=_fast_math_map()), relax.get_pipeline("zero")]


def schedule_passes(target: Any) -> list[Any]:
    from tvm.s_tir import dlight as dl

    if not _is_cpu(target):  # CUDA: dlight's GPU rules (schedules/gpu.py); kernels must be bound to threads
        from .schedules.gpu import gpu_rules

        return [dl.ApplyDefaultSchedule(*gpu_rules(target))]
    from .schedules import default_rules
    from .schedules.gemm_packed import prepack_passes

    # prepack_passes: constant weights packed by a schedule (GemmPacked) are packed at build time
    return [dl.ApplyDefaultSchedule(*default_rules(target)), *prepack_passes()]


def passes(name: str, target: Any) -> list[Any]:
    """The pass list of pipeline ``name`` for ``target`` (a ``tvm.target.Target``)."""
    from tvm import relax

    if name == "zero":  # on CUDA the GPU rules still run: an unbound kernel does not build
        return [relax.get_pipeline("zero")] + ([] if _is_cpu(target) else schedule_passes(target))
    if name == "scheduled":
        return simplify_passes(target) + layout_passes(target) + legalize_passes(target) + schedule_passes(target)
    from partitioner.core.errors import BackendError

    raise BackendError(f"unknown TVM pipeline {name!r}; use one of {', '.join(PIPELINES)}")


def run_pipeline(mod: Any, name: str, target: Any, conv_algorithm: str = "direct", conv_cache: Any = None,
                 facts: dict[str, Any] | None = None) -> Any:
    """Apply pipeline ``name`` to ``mod`` under ``target`` (dlight rules read the current target).

    ``conv_algorithm`` (``"scheduled"`` pipeline on the CPU only; see
    :mod:`backends.tvm.conv_algorithms`): ``"direct"`` (default), ``"im2col"``, ``"winograd"`` or
    ``"auto"`` (by measurement, cached in ``conv_cache``). ``facts``, when given, receives
    ``{"conv_algorithms": {algorithm: count}}``.
    """
    import tvm

    if name == "scheduled" and conv_algorithm != "direct" and _is_cpu(target):
        mod = pre_legalize(mod, target, conv_algorithm, conv_cache, facts)
        with target:
            return tvm.transform.Sequential(legalize_passes(target) + schedule_passes(target))(mod)
    with target:
        return tvm.transform.Sequential(passes(name, target))(mod)


def pre_legalize(mod: Any, target: Any, conv_algorithm: str = "direct", conv_cache: Any = None,
                 facts: dict[str, Any] | None = None) -> Any:
    """Phases 1-2 (simplify, layout), then the convolution algorithm rewrite."""
    import tvm

    with target:
        mod = tvm.transform.Sequential(simplify_passes(target) + layout_passes(target))(mod)
    if conv_algorithm == "direct" or not _is_cpu(target):
        return mod
    from .conv_algorithms import rewrite_convolutions

    record: list[dict[str, Any]] = []
    mod, counts = rewrite_convolutions(mod, conv_algorithm, target, conv_cache, record)
    if facts is not None:
        if counts:
            facts["conv_algorithms"] = counts
        if record:  # conv_algorithm "auto": each distinct conv's choice and where it came from
            facts["conv_choices"] = record
    return mod
