"""Expand ONNX ops that TVM's importer cannot convert into their ONNX function bodies.

Many ONNX operators are defined by a *function body* in their schema (``schema.has_function``
or ``schema.has_context_dependent_function``): Celu, HardSwish, Gelu, Mish, LayerNormalization,
RMSNormalization, Attention, SoftmaxCrossEntropyLoss, ... The body is made of simpler ops that
TVM usually does convert, so a node TVM lacks can be replaced by its body before the import.

Rules:
1. Only nodes that need it are expanded: a default-domain node whose op is missing from TVM's
   convert map (:func:`missing_ops`), or whose op is named in ``force`` (ops whose converter
   exists but fails, e.g. Attention's ``num_heads``). Nodes TVM imports stay as they are.
2. The body is the schema's function for the largest function opset version ``<=`` the model's
   default opset (plain bodies first, else the context-dependent one, built from the node and its
   inferred input types). Schema attribute defaults the node omits are added to the node, so the
   body's attribute references resolve the way the operator's definition says.
3. Substitution goes through ``onnx.inliner.inline_local_functions``: the node becomes a call of
   a model-local function (domain :data:`LOCAL_DOMAIN`), which the inliner replaces by the body
   with fresh internal names. The model is re-inferred afterwards, and expansion repeats (a body
   may itself hold ops TVM lacks) up to :data:`MAX_ROUNDS` times.
4. After an expansion (only then: programs with nothing to expand are returned untouched), the
   model is re-inferred with data propagation and the values the bodies compute from static
   shapes and constants are folded (:func:`fold_for_import`: the project's one constant folder,
   ``passes.constant_folding``, with a small size limit, then ``passes.dead_code_elimination``),
   so that TVM's importer sees constant shapes instead of ``ShapeExpr`` chains it refuses.
5. Expansion never raises: a node whose body cannot be built is left as it is (the import then
   refuses it the usual way, naming it).
6. ``LSTM``/``GRU``/``RNN`` have no function body; when TVM lacks them they are unrolled first by
   :mod:`passes.expand_recurrent` (one input GEMM per direction, then the static time steps).
"""

from __future__ import annotations

from collections.abc import Iterable

import onnx


LOCAL_DOMAIN = "partitioner.expand"
MAX_ROUNDS = 4
# Ops TVM's converter map has but whose converter fails on valid ONNX (checked on apache-tvm 0.27).
FORCE_EXPAND: frozenset[str] = frozenset({"Attention"})


def tvm_known_ops() -> frozenset[str]:
    """Op types TVM's ONNX importer has a converter for (plus Constant and If)."""
    from tvm.relax.frontend.onnx.onnx_frontend import _get_convert_map

    return frozenset(_get_convert_map()) | {"Constant", "If"}


def _default_opset(model: onnx.ModelProto) -> int | None:
    for o in model.opset_import:
        if o.domain in ("", "ai.onnx"):
            return int(o.version)
    return None


def _function_body(node: onnx.NodeProto, opset: int, input_types: list[onnx.TypeProto]) -> onnx.FunctionProto | None:
    """The schema's function body of ``node`` at ``opset`` (rule 2), or None."""
    try:
        schema = onnx.defs.get_schema(node.op_type, opset, "")
    except Exception:  # noqa: BLE001 - unknown op at this opset: nothing to expand
        return None
    plain = [v for v in schema.function_opset_versions if v <= opset]
    ctx = [v for v in schema.context_dependent_function_opset_versions if v <= opset]
    try:
        if plain:
            data = schema.get_function_with_opset_version(max(plain))
        elif ctx:
            present = [t for name, t in zip(node.input, input_types) if name]  # "" = an omitted optional input
            if any(not t.HasField("tensor_type") or t.tensor_type.elem_type == 0 for t in present):
                return None
            data = schema.get_context_dependent_function_with_opset_version(
                max(ctx), node.SerializeToString(), [t.SerializeToString() for t in input_types])
        else:
            return None
    except Exception:  # noqa: BLE001 - the builder refused this node's context (rule 4)
        return None
    fn = onnx.FunctionProto()
    fn.ParseFromString(data)
    return fn if len(fn.node) else None


def _with_defaults(node: onnx.NodeProto, opset: int) -> list[onnx.AttributeProto]:
    schema = onnx.defs.get_schema(node.op_type, opset, "")
    have = {a.name for a in node.attribute}
    attrs = list(node.attribute)
    for name, spec in schema.attributes.items():
        if name not in have and spec.default_value and spec.default_value.name:
            attrs.append(spec.default_value)
    return attrs


def expand_nodes(model: onnx.ModelProto, wanted: Iterable[str] | None = None, *,
                 force: frozenset[str] = FORCE_EXPAND) -> tuple[onnx.ModelProto, tuple[str, ...]]:
    """Return ``(model', expanded_op_types)``: ``model`` with every top-level default-domain node
    whose op is not in ``wanted`` (default: :func:`tvm_known_ops`) or is in ``force`` replaced by its
    function body (see the module rules). ``model`` itself is not modified; when nothing is
    expanded the same object comes back."""
    from onnx import inliner, shape_inference

    known = frozenset(wanted) if wanted is not None else tvm_known_ops()
    opset = _default_opset(model)
    if opset is None:
        return model, ()
    from passes.expand_recurrent import RECURRENT_OPS, expand_recurrent_proto

    source = model  # LSTM/GRU/RNN have no function body: they unroll (passes.expand_recurrent)
    model, recurrent = expand_recurrent_proto(model, RECURRENT_OPS - known)
    expanded: list[str] = list(recurrent)
    current = model
    for _ in range(MAX_ROUNDS):
        g = current.graph
        todo = [i for i, n in enumerate(g.node)
                if n.domain in ("", "ai.onnx") and (n.op_type not in known or n.op_type in force)]
        if not todo:
            break
        try:
            inferred = shape_inference.infer_shapes(current)
        except Exception:  # noqa: BLE001 - types only help context-dependent bodies
            inferred = current
        types = {v.name: v.type for v in [*inferred.graph.input, *inferred.graph.value_info, *inferred.graph.output]}
        for t in inferred.graph.initializer:
            types.setdefault(t.name, onnx.helper.make_tensor_type_proto(t.data_type, list(t.dims)))
        out = onnx.ModelProto()
        out.CopyFrom(current)
        functions: list[onnx.FunctionProto] = []
        for i in todo:
            made = _local_call(out.graph.node[i], opset, types, f"__{len(functions)}_{len(expanded)}")
            if made is None:
                continue
            call, body = made
            expanded.append(out.graph.node[i].op_type)
            out.graph.node[i].CopyFrom(call)
            functions.append(body)
        if not functions:
            break
        out.functions.extend(functions)
        if not any(o.domain == LOCAL_DOMAIN for o in out.opset_import):
            out.opset_import.append(onnx.helper.make_opsetid(LOCAL_DOMAIN, 1))
        try:
            out = inliner.inline_local_functions(out)
        except Exception:  # noqa: BLE001 - rule 4
            return current, tuple(expanded[: len(expanded) - len(functions)])
        del out.functions[:]
        keep = [o for o in out.opset_import if o.domain != LOCAL_DOMAIN]
        del out.opset_import[:]
        out.opset_import.extend(keep)
        current = out
    if current is source:
        return source, ()
    for _ in range(MAX_ROUNDS):  # shapes computed by the body (Shape -> Concat -> Reshape) settle in rounds
        try:
            current = onnx.shape_inference.infer_shapes(current, data_prop=True)
        except Exception:  # noqa: BLE001 - the caller's own inference reports it
            break
        folded = fold_for_import(current)
        if folded is current:
            break
        current = folded
    return current, tuple(expanded)


def _local_call(node: onnx.NodeProto, opset: int, types: dict[str, onnx.TypeProto],
                suffix: str) -> tuple[onnx.NodeProto, onnx.FunctionProto] | None:
    """``node``'s function body as a local function and the node that calls it (None: no body)."""
    in_types = [types.get(x, onnx.TypeProto()) for x in node.input]
    body = _function_body(node, opset, in_types)
    if body is None:
        return None
    name = f"{node.op_type}{suffix}"
    body.name, body.domain = name, LOCAL_DOMAIN
    attrs = _with_defaults(node, opset)
    # ref_attr_name in the body resolves against the call's attributes
    del body.attribute[:]
    body.attribute.extend(a.name for a in attrs)
    del body.attribute_proto[:]
    for o in body.opset_import:
        if o.domain in ("", "ai.onnx") and o.version != opset:
            o.version = opset  # the body runs in the model's opset (bodies are written to stay valid)
    call = onnx.helper.make_node(name, list(node.input), list(node.output), name=node.name or name,
                                 domain=LOCAL_DOMAIN)
    call.attribute.extend(attrs)
    return call, body


#: Folded values are kept small: a body's masks and shapes, not a materialised weight.
FOLD_MAX_ELEMENTS = 1 << 16


def fold_for_import(model: onnx.ModelProto) -> onnx.ModelProto:
    """Fold what an expanded body computes from static shapes and constants (rule 4): Function
    bodies compute shapes at run time (Shape -> Gather -> Concat -> Reshape) and build masks from
    constants (Concat -> ConstantOfShape -> Expand); TVM's importer turns a Shape into a ShapeExpr
    that many converters refuse, whereas constants fold. Runs the one constant folder
    (``passes.constant_folding``, outputs of at most :data:`FOLD_MAX_ELEMENTS` elements) and
    dead-code elimination on the onnx-ir form; ``model`` itself when nothing folds."""
    import onnx_ir as ir

    from passes.constant_folding import ConstantFolding
    from passes.dead_code_elimination import DeadCodeElimination

    program = ir.serde.deserialize_model(model)
    if not ConstantFolding(size_limit=FOLD_MAX_ELEMENTS)(program).modified:
        return model
    DeadCodeElimination()(program)
    return ir.serde.serialize_model(program)
