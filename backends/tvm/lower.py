"""Lower a per-rank program (ONNX, possibly with ``partitioner.comm`` nodes) to a Relax IRModule.

Recipe (DESIGN.md, "Facts checked"): ``from_onnx`` has no hook for custom ops, so

1. ``split_program`` cuts the program at its comm nodes into pure ONNX segments;
2. each segment is imported with ``from_onnx(seg, opset=..., keep_params_in_input=False)``
   (weights become constants inside the module: a rank's library holds only its own weights;
   weights left in external data become parameters of ``main`` instead, after its inputs:
   :mod:`backends.tvm.weight_params`)
   and added as the private Relax function ``seg<k>``; helper functions the importer creates
   (e.g. the ``maximum``/``minimum`` PrimFuncs of Clip) become ``seg<k>_<name>`` so segments
   never clash; a segment whose values nobody reads later is dropped; a segment holding an
   ``If`` gets dataflow blocks around it (:func:`_dataflow_around_control_flow`); the
   importer's unchecked ``take`` (mode ``"fast"``) becomes ``"clip"`` (:func:`_bounded_takes`);
3. ``main`` (no dataflow block, so bindings run in program order) calls the segments in order
   and each comm op in between:

   - ops with an output:  ``R.call_dps_packed("partitioner.comm.<Op>", (x, op_id), out_ty=...)``
     (Recv and a non-root Broadcast pass only ``op_id``);
   - ``Send``: the impure ``R.call_packed("partitioner.comm.Send", x, op_id)``. An impure call is
     never removed by dead-code elimination, whereas a pure ``call_dps_packed`` whose result is
     unused is (checked on 0.27);
   - a comm output nobody reads is passed to the impure ``partitioner.comm.keep`` so it survives.

Before the import, :func:`backends.tvm.import_pipeline.prepare_for_import` (the backend's
onnx-ir passes, run by the pass manager between one deserialisation and one serialisation)
expands the nodes TVM's importer lacks (or mis-converts, e.g. Attention) into their ONNX function
bodies (:mod:`backends.tvm.expand_functions`; LSTM/GRU/RNN unrolled), infers types, and rewrites
what the importer mis-converts (:mod:`backends.tvm.import_fixes`: OneHot with a rank-1 depth,
reductions over empty inputs, Clip with constant bounds, variadic Sum/Mean/Max/Min, inference
Dropout, 1-D convs as im2col + MatMul, HardSwish/HardSigmoid as Clip;
:mod:`backends.tvm.resize_inputs`; :mod:`backends.tvm.form_rewrites`);
:func:`check_supported` judges that prepared program.

Invariant: ``op_id`` of a comm node is its index among the program's comm nodes in node order
(:func:`comm_table`); the runtime uses the same table to find the op to run.
``main`` takes the program's graph inputs in order and always returns a tuple of its graph
outputs in order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx

from partitioner.core.comm_ops import CommOp, is_comm
from partitioner.core.errors import BackendError, UnsupportedByBackendError
from partitioner.core.segments import CommStep, Segment, all_nodes, split_program, value_infos

from .import_pipeline import prepare_for_import, tvm_known_ops
from .weight_params import PREFIX, weights_as_inputs

PACKED_PREFIX = "partitioner.comm."
KEEP_FUNC = PACKED_PREFIX + "keep"


@dataclass(frozen=True)
class LoweredProgram:
    """A Relax module plus the facts the runtime needs to call it."""

    mod: object  # tvm.IRModule
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    comm_ops: tuple[CommOp, ...]
    segments: int
    fallback_segments: tuple[dict, ...] = ()  # ORT segments (backends.tvm.fallback), described
    weights: tuple[str, ...] = ()  # weights ``main`` takes as parameters (backends.tvm.weight_params)


def comm_table(program: onnx.ModelProto) -> tuple[CommOp, ...]:
    """The program's comm ops in node order; the index is the op_id baked into the library."""
    return tuple(CommOp.from_node(n) for n in program.graph.node if is_comm(n))


def onnx_opset(model: onnx.ModelProto) -> int:
    for o in model.opset_import:
        if o.domain in ("", "ai.onnx"):
            return int(o.version)
    raise BackendError(f"graph {model.graph.name!r}: no default-domain opset_import; add one (e.g. opset 17)")


def check_supported(program: onnx.ModelProto, *, prepared: bool = False) -> None:
    """Raise one BackendError listing every op TVM's ONNX importer cannot convert, judged on the
    program :func:`lower_program` imports (:func:`prepare_for_import`; ``prepared=True``: the
    caller already prepared ``program``)."""
    from . import op_support
    from .fallback import unimportable_op

    if not prepared:
        program = prepare_for_import(program)
    known = tvm_known_ops()
    bad = [(n.name or "<unnamed>", t) for n in all_nodes(program.graph) if (t := unimportable_op(n, known)) is not None]
    if bad:
        kinds = sorted({t for _, t in bad})
        listing = "; ".join(f"{name} ({t})" for name, t in bad)
        raise UnsupportedByBackendError(
            f"graph {program.graph.name!r}: TVM cannot import {len(bad)} node(s) of op type(s) {', '.join(kinds)}: "
            f"{listing}; use --fallback onnxruntime (runs just these nodes under ONNX Runtime inside the rank), "
            "--backend onnxruntime, or rewrite these ops"
        )
    op_support.check(program)  # forms of known ops TVM fails on or computes differently (the support table)


_SUB_BYTE = frozenset(getattr(onnx.TensorProto, n) for n in ("INT4", "UINT4", "INT2", "UINT2", "FLOAT4E2M1")
                      if hasattr(onnx.TensorProto, n))
_NO_RUNTIME_DTYPES = frozenset(getattr(onnx.TensorProto, n) for n in ("STRING", "FLOAT8E4M3FN", "FLOAT8E4M3FNUZ",
                                "FLOAT8E5M2", "FLOAT8E5M2FNUZ", "FLOAT8E8M0") if hasattr(onnx.TensorProto, n))


def _tensor_type(info: onnx.ValueInfoProto, where: str):
    from onnx import helper
    from tvm import relax

    if not info.type.HasField("tensor_type") or info.type.tensor_type.elem_type == 0:
        kind = info.type.WhichOneof("value") or "untyped"
        raise UnsupportedByBackendError(f"{where}: value {info.name!r} is {kind.replace('_type', '')}-typed, not a typed tensor; "
                           "the TVM backend takes tensors only (use --backend onnxruntime)")
    t = info.type.tensor_type
    if t.elem_type in _SUB_BYTE:
        raise UnsupportedByBackendError(f"{where}: value {info.name!r} has the sub-byte type "
                           f"{onnx.TensorProto.DataType.Name(t.elem_type)}; TVM's runtime cannot pass tensors of fewer "
                           "than 8 bits per element (use --backend onnxruntime)")
    if t.elem_type in _NO_RUNTIME_DTYPES:  # float8, strings (backends.tvm.op_support)
        raise UnsupportedByBackendError(f"{where}: value {info.name!r} has the element type "
                           f"{onnx.TensorProto.DataType.Name(t.elem_type)}, which TVM's runtime cannot pass (use --backend onnxruntime)")
    dims = []
    for d in t.shape.dim:
        if not d.HasField("dim_value"):
            raise BackendError(
                f"{where}: value {info.name!r} has a symbolic dimension {d.dim_param or '?'}; "
                "the TVM backend needs static shapes (fix the batch size)"
            )
        dims.append(int(d.dim_value))
    dtype = str(helper.tensor_dtype_to_np_dtype(t.elem_type))
    return relax.TensorType(dims, dtype)


#: segments with control flow get dataflow blocks around it (:func:`_dataflow_around_control_flow`); off: none
DATAFLOW_AROUND_CONTROL_FLOW = True


def _dataflow_around_control_flow(mod):
    """``mod`` with the runs of pure bindings of a segment that holds an ``If`` wrapped in
    dataflow blocks (TVM's ``ConvertToDataflow``). Shapes it is for: any segment with a
    data-dependent ``If`` kept as control flow (openwakeword's verifier heads, e.g. hey_jarvis:
    Gemm + LayerNorm + ReLU before an ``If``). Why: ``from_onnx`` then emits the whole function as
    one plain binding block, and ``FuseOps`` fuses only inside dataflow blocks, so every op
    became its own kernel (hey_jarvis: 191 kernel and builtin calls per run, 76 with the blocks).
    The If and the bindings after it keep their order; only purity-checked bindings move into
    blocks, which changes nothing but what may fuse."""
    from tvm import relax

    main = mod["main"]
    if not DATAFLOW_AROUND_CONTROL_FLOW or not isinstance(main.body, relax.SeqExpr) or any(
            isinstance(b, relax.DataflowBlock) for b in main.body.blocks):
        return mod
    return relax.transform.ConvertToDataflow()(mod)


BOUNDED_TAKES = True


def _bounded_takes(mod):
    """Every ``relax.take`` the importer made in mode ``"fast"`` (its default: an out-of-range
    index reads outside the tensor, and ``topi.take`` logs "Fast mode segfaults ..." once per
    take each time a program is legalised: 47 lines in one resnet stage-timing run) is made
    ``"clip"``. Same values for in-range indices (the importer already wraps negative ones, as
    ONNX defines); an out-of-range index reads the nearest row instead of past the buffer. One
    ``min``/``max`` per index, not per element gathered."""
    from tvm import ir, relax
    from tvm.relax.expr_functor import PyExprMutator, mutator

    if not BOUNDED_TAKES:
        return mod
    take = ir.Op.get("relax.take")

    @mutator
    class _Clip(PyExprMutator):
        def visit_call_(self, call):  # noqa: N802 - TVM's method name
            call = super().visit_call_(call)
            if call.op.same_as(take) and call.attrs.mode == "fast":
                axis = None if call.attrs.axis is None else int(call.attrs.axis)
                return relax.op.take(call.args[0], call.args[1], axis, mode="clip")
            return call

    for gv, func in list(mod.functions_items()):  # the importer's fresh module, updated in place
        if isinstance(func, relax.Function):
            mod.update_func(gv, _Clip().visit_expr(func))
    return mod


def _import_segment(seg: Segment, opset: int, where: str):
    from tvm.relax.frontend.onnx import from_onnx

    try:
        mod = from_onnx(seg.model, opset=opset, keep_params_in_input=False)
    except Exception as e:  # the importer raises many kinds; turn them into one actionable line
        first = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        raise BackendError(f"{where}: TVM's ONNX importer failed on segment {seg.index} ({type(e).__name__}: {first})") from None
    return _dataflow_around_control_flow(_bounded_takes(mod))


def _add_segment(bb, seg_mod, k: int):
    """Add segment ``k``'s module to ``bb``: ``main`` as ``seg<k>``, helper functions the importer
    made (e.g. ``maximum`` PrimFuncs from emit_te) as ``seg<k>_<name>``, references rewritten so
    segments never clash on helper names."""
    from tvm.relax.expr_functor import PyExprMutator, mutator

    mapping = {}
    for gv, func in seg_mod.functions_items():
        if gv.name_hint != "main":
            mapping[gv.name_hint] = bb.add_func(func, f"seg{k}_{gv.name_hint}")
    main = seg_mod["main"].without_attr("global_symbol")
    if mapping:

        @mutator
        class _RenameGlobals(PyExprMutator):
            def visit_global_var_(self, op):  # noqa: N802 - TVM's method name
                return mapping.get(op.name_hint, op)

        main = _RenameGlobals().visit_expr(main)
    return bb.add_func(main, f"seg{k}")


def _static_dims(ty) -> list[int] | None:
    from tvm import relax

    if not isinstance(ty, relax.TensorType) or not isinstance(ty.shape, relax.ShapeExpr):
        return None
    try:
        return [int(d) for d in ty.shape.values]
    except (TypeError, ValueError):  # a symbolic dimension
        return None


def _as_declared(bb, expr, info: onnx.ValueInfoProto | None, where: str):
    """``expr`` reshaped to the shape ONNX declares for it, when TVM's importer produced another
    shape with the same element count (it turns some scalars into ``(1,)`` tensors). A segment
    boundary must keep ONNX's shape: it is what a ``Send`` ships and the next segment expects."""
    from tvm import relax

    if info is None or not info.type.HasField("tensor_type") or not info.type.tensor_type.HasField("shape"):
        return expr
    dims = info.type.tensor_type.shape.dim
    if not all(d.HasField("dim_value") for d in dims):
        return expr
    want = [int(d.dim_value) for d in dims]
    have = _static_dims(expr.ty)
    if have is None or have == want or int(np.prod(have)) != int(np.prod(want)):
        return expr
    return bb.emit(relax.op.reshape(expr, want))


def lower_program(program: onnx.ModelProto) -> LoweredProgram:
    """Build the Relax module of ``program`` (see the module docstring for the layout)."""
    from tvm import relax

    from . import fallback

    where = f"graph {program.graph.name!r}"
    program, weights = weights_as_inputs(program)  # external-data weights: parameters, not constants
    use_fallback = fallback.wants_fallback(program)
    program = prepare_for_import(program)  # expanded, typed (segments need typed boundaries), rewritten
    if not use_fallback:
        check_supported(program, prepared=True)
    opset = onnx_opset(program)
    infos = value_infos(program)
    steps = fallback.split_with_fallback(program) if use_fallback else split_program(program)
    ort_described: list[dict] = []
    comm_ops = comm_table(program)
    op_ids = {id_key(op): k for k, op in enumerate(comm_ops)}

    init_names = {t.name for t in program.graph.initializer}
    graph_inputs = tuple(v.name for v in program.graph.input if v.name not in init_names)
    graph_outputs = tuple(v.name for v in program.graph.output)

    # Who reads each value later (to keep comm outputs nobody reads).
    read_later: set[str] = set(graph_outputs)
    for step in steps:
        read_later.update(step.inputs)

    bb = relax.BlockBuilder()
    seg_funcs = {}
    for step in steps:
        if isinstance(step, Segment) and step.outputs:
            seg_funcs[step.index] = _add_segment(bb, _import_segment(step, opset, where), step.index)

    params = [relax.Var(PREFIX + n if n in weights else _var_name(n, i), _tensor_type(infos[n], where))
              for i, n in enumerate(graph_inputs)]
    for n in graph_outputs:  # outputs TVM's runtime cannot hand back: refuse before building
        if n in infos:
            _tensor_type(infos[n], where)
    env: dict[str, object] = dict(zip(graph_inputs, params))
    n_segments = 0
    with bb.function("main", params):
        for step in steps:
            if isinstance(step, Segment):
                if not step.outputs:  # nothing it computes is read later: dead code
                    continue
                n_segments += 1
                args = [_lookup(env, n, where) for n in step.inputs]
                res = bb.emit(relax.Call(seg_funcs[step.index], args))
                if len(step.outputs) == 1 and not isinstance(res.ty, relax.TupleType):
                    env[step.outputs[0]] = _as_declared(bb, res, infos.get(step.outputs[0]), where)
                else:
                    for j, name in enumerate(step.outputs):
                        env[name] = _as_declared(bb, bb.emit(relax.TupleGetItem(res, j)), infos.get(name), where)
                continue
            if isinstance(step, fallback.OrtSegment):
                if not step.outputs:
                    continue
                ort_described.append(step.describe())
                args = [_lookup(env, n, where) for n in step.inputs]
                tys = [_tensor_type(infos[n], f"{where} fallback segment {step.key}") for n in step.outputs]
                res = bb.emit(relax.call_dps_packed(fallback.PACKED_NAME, [relax.prim_value(step.key), *args],
                                                    out_ty=tys if len(tys) > 1 else tys[0]))
                if len(tys) == 1:
                    env[step.outputs[0]] = res
                else:
                    for j, name in enumerate(step.outputs):
                        env[name] = bb.emit(relax.TupleGetItem(res, j))
                continue
            assert isinstance(step, CommStep)
            _emit_comm(bb, step, env, infos, op_ids, read_later, where)
        bb.emit_func_output(relax.Tuple([_lookup(env, n, where) for n in graph_outputs]))
    real_inputs = tuple(n for n in graph_inputs if n not in weights)
    return LoweredProgram(bb.get(), real_inputs, graph_outputs, comm_ops, n_segments, tuple(ort_described), weights)


def _emit_comm(bb: Any, step: CommStep, env: dict[str, object], infos: dict, op_ids: dict, read_later: set[str],
               where: str) -> None:
    """``R.call_dps_packed("partitioner.comm.<Op>", [inputs..., op_id])`` for one comm step; an
    output nobody reads later is kept alive by a call to the keep function."""
    from tvm import relax

    op = step.op
    op_id = relax.prim_value(op_ids[id_key(op)])
    args = [_lookup(env, n, where) for n in step.inputs]
    func = PACKED_PREFIX + op.op_type
    if not op.outputs:
        bb.emit(relax.Call(relax.ExternFunc(func), [*args, op_id], ty_args=[relax.ObjectType()]))
        return
    out_name = op.outputs[0]
    if out_name in infos:
        out_ty = _tensor_type(infos[out_name], f"{where} comm node {op.name!r}")
    elif "shape" in op.attrs and "dtype" in op.attrs:
        out_ty = relax.TensorType([int(d) for d in op.attrs["shape"]], str(op.np_dtype))
    else:
        raise BackendError(f"{where}: comm node {op.name!r} output {out_name!r} has no value_info; run shape inference on the per-rank program")
    y = bb.emit(relax.call_dps_packed(func, [*args, op_id], out_ty=out_ty))
    env[out_name] = y
    if out_name not in read_later:
        bb.emit(relax.Call(relax.ExternFunc(KEEP_FUNC), [y], ty_args=[relax.ObjectType()]))


def id_key(op: CommOp) -> tuple[str, tuple[str, ...], tuple[str, ...]]:
    return (op.name, op.inputs, op.outputs)


def _var_name(name: str, i: int) -> str:
    clean = "".join(c if c.isalnum() or c == "_" else "_" for c in name)
    return clean if clean and not clean[0].isdigit() else f"in{i}_{clean}"


def _lookup(env: dict[str, object], name: str, where: str):
    if name not in env:
        raise BackendError(f"{where}: value {name!r} is read before any segment or comm op produces it (is it an initializer-only output?)")
    return env[name]
