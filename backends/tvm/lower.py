"""Lower a per-rank program (ONNX, possibly with ``partitioner.comm`` nodes) to a Relax IRModule.

Recipe (DESIGN.md, "Facts checked"): ``from_onnx`` has no hook for custom ops, so

1. ``split_program`` cuts the program at its comm nodes into pure ONNX segments;
2. each segment is imported with ``from_onnx(seg, opset=..., keep_params_in_input=False)``
   (weights become constants inside the module: a rank's library holds only its own weights)
   and added as the private Relax function ``seg<k>``; helper functions the importer creates
   (e.g. the ``maximum``/``minimum`` PrimFuncs of Clip) become ``seg<k>_<name>`` so segments
   never clash; a segment whose values nobody reads later is dropped;
3. ``main`` (no dataflow block, so bindings run in program order) calls the segments in order
   and each comm op in between:

   - ops with an output:  ``R.call_dps_packed("partitioner.comm.<Op>", (x, op_id), out_ty=...)``
     (Recv and a non-root Broadcast pass only ``op_id``);
   - ``Send``: the impure ``R.call_packed("partitioner.comm.Send", x, op_id)``. An impure call is
     never removed by dead-code elimination, whereas a pure ``call_dps_packed`` whose result is
     unused is (checked on 0.27);
   - a comm output nobody reads is passed to the impure ``partitioner.comm.keep`` so it survives.

Before the import, nodes TVM's importer lacks (or mis-converts, e.g. Attention) but whose ONNX
schema defines a function body are expanded into that body (:func:`expand_for_import`,
:mod:`backends.tvm.expand_functions`); :func:`check_supported` judges the expanded program.
Then :func:`rewrite_for_import` replaces ONNX ``Sum``/``Mean`` (any number of
inputs) with a left-to-right chain of binary ``Add`` (and a ``Div`` by n for ``Mean``), and
variadic ``Max``/``Min`` with a chain of two-input ``Max``/``Min`` (one input: ``Identity``): TVM's
importer turns them into ``stack`` + ``sum``, a rank+1 tensor that ``ConvertLayout`` (NHWC)
rejects ("Invalid SLayout: can't find S in source layout ABCDE") and that costs a copy of every
input. The chain is the same arithmetic ONNX Runtime does (left to right). An inference
``Dropout`` (no ``training_mode`` input, mask unread) becomes ``Identity``: the importer's
``R.nn.dropout`` returns a tuple that ``ConvertLayout`` rejects ("Expected nested to match tuple").
A reduction over an empty input (``ReduceSum`` of a ``[2, 0, 4]`` tensor) becomes a ``Constant`` of
its empty-set value: TVM's kernel returns uninitialised memory there.

Invariant: ``op_id`` of a comm node is its index among the program's comm nodes in node order
(:func:`comm_table`); the runtime uses the same table to find the op to run.
``main`` takes the program's graph inputs in order and always returns a tuple of its graph
outputs in order.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx

from partitioner.core.comm_ops import CommOp, is_comm
from partitioner.core.errors import BackendError, UnsupportedByBackendError
from partitioner.core.segments import CommStep, Segment, all_nodes, split_program, value_infos

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


def comm_table(program: onnx.ModelProto) -> tuple[CommOp, ...]:
    """The program's comm ops in node order; the index is the op_id baked into the library."""
    return tuple(CommOp.from_node(n) for n in program.graph.node if is_comm(n))


def onnx_opset(model: onnx.ModelProto) -> int:
    for o in model.opset_import:
        if o.domain in ("", "ai.onnx"):
            return int(o.version)
    raise BackendError(f"graph {model.graph.name!r}: no default-domain opset_import; add one (e.g. opset 17)")


def expand_for_import(program: onnx.ModelProto) -> onnx.ModelProto:
    """``program`` with the nodes TVM cannot import expanded into their ONNX function bodies
    (:mod:`backends.tvm.expand_functions`); the same object when nothing needs it."""
    from .expand_functions import expand_nodes

    return expand_nodes(program)[0]


def check_supported(program: onnx.ModelProto) -> None:
    """Raise one BackendError listing every op TVM's ONNX importer cannot convert, after the
    function-body expansion :func:`lower_program` applies (:func:`expand_for_import`)."""
    from tvm.relax.frontend.onnx.onnx_frontend import _get_convert_map

    program = expand_for_import(program)
    known = set(_get_convert_map()) | {"Constant", "If"}
    bad = [(n.name or "<unnamed>", n.op_type if not n.domain else f"{n.domain}::{n.op_type}")
           for n in all_nodes(program.graph)
           if not is_comm(n) and (n.op_type not in known or n.domain not in ("", "ai.onnx"))]
    if bad:
        kinds = sorted({t for _, t in bad})
        listing = "; ".join(f"{name} ({t})" for name, t in bad)
        raise UnsupportedByBackendError(
            f"graph {program.graph.name!r}: TVM cannot import {len(bad)} node(s) of op type(s) {', '.join(kinds)}: "
            f"{listing}; use --fallback onnxruntime (runs just these nodes under ONNX Runtime inside the rank), "
            "--backend onnxruntime, or rewrite these ops"
        )


def rewrite_for_import(program: onnx.ModelProto) -> onnx.ModelProto:
    """Return a copy of ``program`` with every top-level ``Sum``/``Mean`` node rewritten to binary
    ``Add`` nodes and every inference ``Dropout`` to ``Identity`` (see the module docstring). Node names and outputs keep their meaning: the last
    node of a chain writes the original output; intermediates are ``<output>__sum<k>``."""
    from onnx import helper, numpy_helper

    from .import_fixes import rewrite_one_hot
    from .resize_inputs import drop_empty_resize_inputs

    program = _clip_as_selects(_fold_empty_reductions(rewrite_one_hot(drop_empty_resize_inputs(program))))
    g = program.graph
    if not any(n.op_type in ("Sum", "Mean", "Max", "Min", "Dropout") and n.domain in ("", "ai.onnx") for n in g.node):
        return program
    read = {i for n in all_nodes(g) for i in n.input} | {o.name for o in g.output}
    out = onnx.ModelProto()
    out.CopyFrom(program)
    nodes: list[onnx.NodeProto] = []
    elem = _elem_types(g)
    for node in g.node:
        ins = [i for i in node.input if i]
        if (node.op_type == "Dropout" and node.domain in ("", "ai.onnx") and len(node.input) < 3
                and not any(o and o in read for o in node.output[1:])):
            nodes.append(helper.make_node("Identity", [node.input[0]], [node.output[0]], name=node.name))
            continue
        if node.op_type not in ("Sum", "Mean", "Max", "Min") or node.domain not in ("", "ai.onnx") or not ins:
            nodes.append(node)
            continue
        result = node.output[0]
        mean = node.op_type == "Mean" and len(ins) > 1
        if len(ins) == 1:
            nodes.append(helper.make_node("Identity", ins, [result], name=node.name))
            continue
        acc = ins[0]
        for k, x in enumerate(ins[1:], start=1):
            last = k == len(ins) - 1 and not mean
            dst = result if last else f"{result}__sum{k}"
            step_name = f"{node.name}__add{k}" if not last else node.name
            if node.op_type in ("Sum", "Mean"):
                nodes.append(helper.make_node("Add", [acc, x], [dst], name=step_name))
            else:  # Max/Min: TVM's converter stacks even two inputs (see the module docstring)
                nodes.extend(_select_chain(node.op_type, acc, x, dst, step_name, elem.get(result, elem.get(ins[0]))))
            acc = dst
        if mean:
            import numpy as np

            dtype = helper.tensor_dtype_to_np_dtype(elem.get(result, elem.get(ins[0], onnx.TensorProto.FLOAT)))
            n_name = f"{result}__count"
            out.graph.initializer.append(numpy_helper.from_array(np.array(len(ins), dtype=dtype), n_name))
            nodes.append(helper.make_node("Div", [acc, n_name], [result], name=node.name))
    del out.graph.node[:]
    out.graph.node.extend(nodes)
    return out


# The value of a reduction over an empty set, per op (ONNX's definitions: the identity of the
# reduction; log of an empty sum is log 0; the mean of nothing is 0/0).
_EMPTY_REDUCTION = {"ReduceSum": 0.0, "ReduceL1": 0.0, "ReduceL2": 0.0, "ReduceSumSquare": 0.0,
                    "ReduceProd": 1.0, "ReduceMax": -np.inf, "ReduceMin": np.inf,
                    "ReduceLogSum": -np.inf, "ReduceLogSumExp": -np.inf, "ReduceMean": np.nan}


def _elem_types(g: onnx.GraphProto) -> dict[str, int]:
    """ONNX element type of every typed value of ``g`` (inputs, value_info, outputs, initializers)."""
    elem = {v.name: v.type.tensor_type.elem_type for v in [*g.input, *g.value_info, *g.output]}
    elem.update({t.name: t.data_type for t in g.initializer})
    return elem


_CLIP_TYPES = frozenset({onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE, onnx.TensorProto.FLOAT16})


def _clip_bound(node: onnx.NodeProto, i: int, attr: str, consts: dict[str, onnx.TensorProto]) -> tuple[bool, float | None]:
    """One bound of a Clip: (usable, value); value None = no bound on this side."""
    from onnx import numpy_helper

    if len(node.input) > 1 or not node.attribute:  # opset >= 11: inputs
        name = node.input[i] if len(node.input) > i else ""
        if not name:
            return True, None
        if name not in consts:
            return False, None
        arr = numpy_helper.to_array(consts[name])
        if arr.size != 1:
            return False, None
        v = float(arr.reshape(()))
    else:  # opset 6: attributes
        a = next((x for x in node.attribute if x.name == attr), None)
        if a is None:
            return True, None
        v = float(a.f)
    return True, (None if np.isnan(v) else v)


def _clip_as_selects(program: onnx.ModelProto) -> onnx.ModelProto:
    """``Clip(x, lo, hi)`` with constant scalar float bounds becomes
    ``Where(Greater(t, hi), hi, t)`` with ``t = Where(Less(x, lo), lo, x)``.

    TVM's importer turns Clip into ``emit_te(topi.maximum/minimum)`` calls, which
    ``ConvertLayout`` cannot see through: on an NHWC graph it wrapped every ReLU6 in two
    transposes (mobilenet: 24 of them), and the clip never fused into the convolution before it.
    Compares and selects are elementwise Relax ops: they keep the layout and fuse into the conv's
    epilogue. NaN inputs stay NaN (both compares are false), as in ONNX; a NaN bound means no
    bound, as in ONNX and ORT. Clips with bounds computed at run time are left as they are."""
    from onnx import helper, numpy_helper

    g = program.graph
    if not any(n.op_type == "Clip" and n.domain in ("", "ai.onnx") for n in g.node):
        return program
    consts = {t.name: t for t in g.initializer}
    for n in g.node:
        if n.op_type == "Constant" and n.domain in ("", "ai.onnx") and n.attribute and n.attribute[0].name == "value":
            consts[n.output[0]] = n.attribute[0].t
    elem = _elem_types(g)
    ranks = {v.name: len(v.type.tensor_type.shape.dim) for v in [*g.input, *g.value_info, *g.output]
             if v.type.tensor_type.HasField("shape")}

    out = onnx.ModelProto()
    out.CopyFrom(program)
    nodes: list[onnx.NodeProto] = []
    changed = False
    for node in g.node:
        dtype = elem.get(node.input[0]) if node.input else None
        if node.op_type != "Clip" or node.domain not in ("", "ai.onnx") or dtype not in _CLIP_TYPES:
            nodes.append(node)
            continue
        (ok_lo, lo), (ok_hi, hi) = _clip_bound(node, 1, "min", consts), _clip_bound(node, 2, "max", consts)
        if not (ok_lo and ok_hi):
            nodes.append(node)
            continue
        np_dtype = helper.tensor_dtype_to_np_dtype(dtype)
        cur, y = node.input[0], node.output[0]
        rank = ranks.get(cur)
        if rank is None:
            nodes.append(node)
            continue
        steps = [(s, v) for s, v in (("lo", lo), ("hi", hi)) if v is not None]
        if not steps:
            nodes.append(helper.make_node("Identity", [cur], [y], name=node.name))
            changed = True
            continue
        for k, (side, v) in enumerate(steps):
            c = f"{y}__clip_{side}"
            # shaped [1] * rank(x), not 0-d: ConvertLayout transposes a same-rank Where operand,
            # but wrapped the 0-d version in transposes again
            out.graph.initializer.append(numpy_helper.from_array(np.full([1] * rank, v, dtype=np_dtype), c))
            dst = y if k == len(steps) - 1 else f"{y}__clip_t"
            cmp = f"{y}__clip_{side}_cmp"
            nodes.append(helper.make_node("Less" if side == "lo" else "Greater", [cur, c], [cmp], name=f"{node.name}__{side}_cmp"))
            nodes.append(helper.make_node("Where", [cmp, c, cur], [dst], name=node.name if dst == y else f"{node.name}__{side}"))
            cur = dst
        changed = True
    if not changed:
        return program
    del out.graph.node[:]
    out.graph.node.extend(nodes)
    return out


def _fold_empty_reductions(program: onnx.ModelProto) -> onnx.ModelProto:
    """Replace every reduction whose input has no elements but whose output has some with a
    ``Constant`` of the reduction's empty-set value. TVM's kernels never run the init of a
    reduction loop of extent 0 and return uninitialised memory (checked on 0.27: the ONNX
    ``*_empty_set`` node cases gave garbage); the result does not depend on any data."""
    from onnx import helper, numpy_helper

    g = program.graph
    info = {v.name: v for v in [*g.input, *g.value_info, *g.output]}

    def static(name: str) -> tuple[int, list[int]] | None:
        v = info.get(name)
        if v is None or not v.type.HasField("tensor_type") or not v.type.tensor_type.HasField("shape"):
            return None
        dims = v.type.tensor_type.shape.dim
        if not all(d.HasField("dim_value") for d in dims):
            return None
        return v.type.tensor_type.elem_type, [int(d.dim_value) for d in dims]

    replaced: dict[int, onnx.NodeProto] = {}
    for k, node in enumerate(g.node):
        if node.op_type not in _EMPTY_REDUCTION or node.domain not in ("", "ai.onnx") or not node.input:
            continue
        src, dst = static(node.input[0]), static(node.output[0])
        if src is None or dst is None or int(np.prod(src[1])) != 0 or int(np.prod(dst[1])) == 0:
            continue
        dtype = np.dtype(helper.tensor_dtype_to_np_dtype(dst[0]))
        value = _EMPTY_REDUCTION[node.op_type]
        if dtype.kind == "b":  # bool Max/Min: max of nothing is False, min of nothing True
            if np.isnan(value):
                continue
            value = bool(value > 0)
        elif dtype.kind in "iu":  # integer reductions: the type's extremes stand for +-inf
            value = np.iinfo(dtype).min if value == -np.inf else np.iinfo(dtype).max if value == np.inf else value
            if np.isnan(value):
                continue  # integer mean of nothing is undefined: leave it to the kernel
        tensor = numpy_helper.from_array(np.full(dst[1], value, dtype=dtype), f"{node.output[0]}__empty")
        replaced[k] = helper.make_node("Constant", [], [node.output[0]], name=node.name, value=tensor)
    if not replaced:
        return program
    out = onnx.ModelProto()
    out.CopyFrom(program)
    for k, node in replaced.items():
        out.graph.node[k].CopyFrom(node)
    return out


_SUB_BYTE = frozenset(getattr(onnx.TensorProto, n) for n in ("INT4", "UINT4", "INT2", "UINT2", "FLOAT4E2M1")
                      if hasattr(onnx.TensorProto, n))


_FLOAT_TYPES = frozenset({onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE, onnx.TensorProto.FLOAT16,
                          onnx.TensorProto.BFLOAT16})


def _select_chain(op: str, a: str, b: str, dst: str, name: str, elem: int | None) -> list[onnx.NodeProto]:
    """``dst = Max(a, b)`` (or Min) as ``Where(a >= b or isnan(a), a, b)`` (``<=`` for Min), with
    broadcasting; a NaN in either input gives NaN, as ONNX Max/Min (numpy maximum) does."""
    from onnx import helper

    cmp = "GreaterOrEqual" if op == "Max" else "LessOrEqual"
    nodes = [helper.make_node(cmp, [a, b], [f"{dst}__pick{name}"], name=f"{name}__cmp")]
    pick = f"{dst}__pick{name}"
    if elem in _FLOAT_TYPES:
        nodes += [helper.make_node("IsNaN", [a], [f"{dst}__nan{name}"], name=f"{name}__isnan"),
                  helper.make_node("Or", [pick, f"{dst}__nan{name}"], [f"{dst}__pickn{name}"], name=f"{name}__or")]
        pick = f"{dst}__pickn{name}"
    nodes.append(helper.make_node("Where", [pick, a, b], [dst], name=name))
    return nodes


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


def _import_segment(seg: Segment, opset: int, where: str):
    from tvm.relax.frontend.onnx import from_onnx

    try:
        mod = from_onnx(seg.model, opset=opset, keep_params_in_input=False)
    except Exception as e:  # the importer raises many kinds; turn them into one actionable line
        first = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        raise BackendError(f"{where}: TVM's ONNX importer failed on segment {seg.index} ({type(e).__name__}: {first})") from None
    return mod


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
    use_fallback = fallback.wants_fallback(program)
    program = expand_for_import(program)
    if not use_fallback:
        check_supported(program)
    # Segments need typed boundaries; inference keeps existing value_info (comm outputs carry theirs).
    program = rewrite_for_import(onnx.shape_inference.infer_shapes(program))
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

    params = [relax.Var(_var_name(n, i), _tensor_type(infos[n], where)) for i, n in enumerate(graph_inputs)]
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
    return LoweredProgram(bb.get(), graph_inputs, graph_outputs, comm_ops, n_segments, tuple(ort_described))


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
