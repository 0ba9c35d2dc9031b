"""Expand ONNX ops that TVM's importer cannot convert into their ONNX function bodies: an onnx-ir pass.

Many ONNX operators are defined by a *function body* in their schema (``schema.has_function``
or ``schema.has_context_dependent_function``): Celu, HardSwish, Gelu, Mish, LayerNormalization,
RMSNormalization, Attention, SoftmaxCrossEntropyLoss, ... The body is made of simpler ops that
TVM usually does convert, so a node TVM lacks can be replaced by its body before the import.
:class:`ExpandForImport` is the first pass of the TVM backend's import pipeline
(:func:`backends.tvm.import_pipeline.prepare_for_import`, run by the pass manager).

Rules:
1. Only nodes that need it are expanded: a default-domain node whose op is missing from TVM's
   convert map (:func:`tvm_known_ops`), or whose op is named in ``force`` (ops whose converter
   exists but fails, e.g. Attention's ``num_heads``). Nodes TVM imports stay as they are.
2. The body is the schema's function for the largest function opset version ``<=`` the model's
   default opset (plain bodies first, else the context-dependent one, built from the node and its
   inferred input types). Schema attribute defaults the node omits are added to the node, so the
   body's attribute references resolve the way the operator's definition says.
3. Substitution goes through onnx-ir's ``InlinePass``: the node becomes a call of a model-local
   function (domain :data:`LOCAL_DOMAIN`), which the inliner replaces by the body with fresh
   internal names. Types are re-inferred before each round (``passes.shape_inference``, lenient),
   and expansion repeats (a body may itself hold ops TVM lacks) up to :data:`MAX_ROUNDS` times.
4. After an expansion (only then: programs with nothing to expand are left untouched), the
   model is re-inferred with data propagation and the values the bodies compute from static
   shapes and constants are folded (:func:`fold_expanded`: the project's one constant folder,
   ``passes.constant_folding``, with a small size limit, then ``passes.dead_code_elimination``),
   so that TVM's importer sees constant shapes instead of ``ShapeExpr`` chains it refuses.
5. Expansion never raises: a node whose body cannot be built, or could not be inlined (a graph
   attribute, a body importing another version of a domain the model imports), is left as it is
   (the import then refuses it the usual way, naming it).
6. ``LSTM``/``GRU``/``RNN`` have no function body; when TVM lacks them they are unrolled first by
   :class:`passes.expand_recurrent.ExpandRecurrent` (one input GEMM per direction, then the static
   time steps), after a lenient shape inference (it needs the static shape of ``X``).

The only protobuf in this module is the schema's own: ONNX hands function bodies out as
serialised ``FunctionProto`` (and takes the node and its input types serialised to build a
context-dependent one); the model itself stays onnx-ir.
"""

from __future__ import annotations

from collections.abc import Iterable

import onnx
import onnx_ir as ir

LOCAL_DOMAIN = "partitioner.expand"
MAX_ROUNDS = 4
# Ops TVM's converter map has but whose converter fails on valid ONNX (checked on apache-tvm 0.27).
FORCE_EXPAND: frozenset[str] = frozenset({"Attention"})
#: Folded values are kept small: a body's masks and shapes, not a materialised weight.
FOLD_MAX_ELEMENTS = 1 << 16
_ONNX = ("", "ai.onnx")


def tvm_known_ops() -> frozenset[str]:
    """Op types TVM's ONNX importer has a converter for, plus Constant and If (the importer
    handles these itself): the one table the expansion, the support check and the fallback read."""
    from tvm.relax.frontend.onnx.onnx_frontend import _get_convert_map

    return frozenset(_get_convert_map()) | {"Constant", "If"}


def _default_opset(model: ir.Model) -> int | None:
    for domain in _ONNX:
        if domain in model.opset_imports:
            return int(model.opset_imports[domain])
    return None


def _input_types(node: ir.Node) -> list[onnx.TypeProto]:
    """The node's input types as ONNX's context-dependent function builders take them (an
    omitted optional input, or one of unknown type: an empty ``TypeProto``)."""
    out = []
    for v in node.inputs:
        out.append(ir.serde.serialize_value(v, name=v.name or "").type if v is not None and v.type is not None
                   else onnx.TypeProto())
    return out


def _function_body(node: ir.Node, opset: int) -> onnx.FunctionProto | None:
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
            types = _input_types(node)
            present = [t for v, t in zip(node.inputs, types) if v is not None]
            if any(not t.HasField("tensor_type") or t.tensor_type.elem_type == 0 for t in present):
                return None
            data = schema.get_context_dependent_function_with_opset_version(
                max(ctx), ir.serde.serialize_node(node).SerializeToString(), [t.SerializeToString() for t in types])
        else:
            return None
    except Exception:  # noqa: BLE001 - the builder refused this node's context (rule 5)
        return None
    fn = onnx.FunctionProto()
    fn.ParseFromString(data)
    return fn if len(fn.node) else None


def _with_defaults(node: ir.Node, opset: int) -> list[ir.Attr]:
    schema = onnx.defs.get_schema(node.op_type, opset, "")
    attrs = list(node.attributes.values())
    for name, spec in schema.attributes.items():
        if name not in node.attributes and spec.default_value and spec.default_value.name:
            attrs.append(ir.serde.deserialize_attribute(spec.default_value))
    return attrs


def _local_call(node: ir.Node, opset: int, model_opsets: dict[str, int],
                suffix: str) -> tuple[ir.Node, ir.Function] | None:
    """``node``'s function body as a local function and the node that calls it (None: no body,
    or one the inliner could not substitute: rule 5)."""
    if any(a.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS) for a in node.attributes.values()):
        return None
    body = _function_body(node, opset)
    if body is None or len(node.inputs) > len(body.input) or len(node.outputs) > len(body.output):
        return None
    # a context-dependent body may declare outputs the node omits and the body never computes
    # (Attention's present_key/value beside a requested qk_matmul_output): an omitted output
    # (no name, no use) gets a placeholder constant, which nothing reads
    made = {o for n in body.node for o in n.output} | set(body.input)
    keep = list(body.output)[:len(node.outputs)]
    for i, (o, v) in enumerate(zip(keep, node.outputs)):
        if o in made:
            continue
        if v.name or v.uses() or v.is_graph_output():
            return None
        keep[i] = f"{o}__omitted"
        body.node.append(onnx.helper.make_node("Constant", [], [keep[i]], value_float=0.0))
    del body.output[:]
    body.output.extend(keep)
    name = f"{node.op_type}{suffix}"
    body.name, body.domain = name, LOCAL_DOMAIN
    attrs = _with_defaults(node, opset)
    # ref_attr_name in the body resolves against the call's attributes
    del body.attribute[:]
    body.attribute.extend(a.name for a in attrs)
    del body.attribute_proto[:]
    for o in body.opset_import:
        if o.domain in _ONNX and o.version != opset:
            o.version = opset  # the body runs in the model's opset (bodies are written to stay valid)
        elif o.domain not in _ONNX and model_opsets.get(o.domain, o.version) != o.version:
            return None
    call = ir.Node(LOCAL_DOMAIN, name, list(node.inputs), attrs, num_outputs=len(node.outputs),
                   name=node.name or name)
    return call, ir.serde.deserialize_function(body)


def _expand_recurrent(model: ir.Model, ops: frozenset[str]) -> list[str]:
    """Rule 6: the recurrent op types unrolled (lenient inference first: ``X`` needs a static shape)."""
    from passes.expand_recurrent import ExpandRecurrent, can_expand
    from passes.shape_inference import ShapeInference

    if not any(n.op_type in ops and n.domain in _ONNX for n in model.graph):
        return []
    ShapeInference(strict=False)(model)
    kinds = [n.op_type for n in model.graph if n.op_type in ops and n.domain in _ONNX and can_expand(n) is None]
    if not kinds or not ExpandRecurrent(ops)(model).modified:
        return []
    ShapeInference(strict=False)(model)
    return kinds


def _expand_bodies(model: ir.Model, known: frozenset[str], force: frozenset[str], opset: int,
                   done: int) -> list[str]:
    """Rules 1-3: the op types replaced by their function bodies, in order."""
    from onnx_ir.passes.common import InlinePass

    from passes.shape_inference import ShapeInference

    expanded: list[str] = []
    for _ in range(MAX_ROUNDS):
        todo = [n for n in model.graph if n.domain in _ONNX and (n.op_type not in known or n.op_type in force)]
        if not todo:
            break
        ShapeInference(strict=False)(model)  # types only help context-dependent bodies
        calls = 0
        for node in todo:
            made = _local_call(node, opset, dict(model.opset_imports), f"__{calls}_{done + len(expanded)}")
            if made is None:
                continue
            call, function = made
            expanded.append(node.op_type)
            ir.convenience.replace_nodes_and_values(model.graph, node, [node], [call], node.outputs, call.outputs)
            model.functions[function.identifier()] = function
            calls += 1
        if not calls:
            break
        model.opset_imports[LOCAL_DOMAIN] = 1
        InlinePass()(model)
        del model.opset_imports[LOCAL_DOMAIN]
    return expanded


def fold_expanded(model: ir.Model) -> bool:
    """Fold what expanded bodies compute from static shapes and constants (rule 4): function
    bodies compute shapes at run time (Shape -> Gather -> Concat -> Reshape) and build masks from
    constants (Concat -> ConstantOfShape -> Expand); TVM's importer turns a Shape into a ShapeExpr
    that many converters refuse, whereas constants fold. Rounds of lenient inference with data
    propagation, the one constant folder (``passes.constant_folding``, outputs of at most
    :data:`FOLD_MAX_ELEMENTS` elements) and dead-code elimination; True when anything folded."""
    from passes.constant_folding import ConstantFolding
    from passes.dead_code_elimination import DeadCodeElimination
    from passes.shape_inference import ShapeInference

    folded = False
    for _ in range(MAX_ROUNDS):  # shapes computed by the body (Shape -> Concat -> Reshape) settle in rounds
        ShapeInference(strict=False)(model)
        if not ConstantFolding(size_limit=FOLD_MAX_ELEMENTS)(model).modified:
            break
        DeadCodeElimination()(model)
        folded = True
    return folded


class ExpandForImport(ir.passes.InPlacePass):
    """Expand, in place, every top-level node TVM cannot import that has a function body or is a
    recurrent op (module rules); :attr:`expanded` lists the expanded op types, in order.

    Args:
        known: op types the importer converts (default: :func:`tvm_known_ops`).
        force: op types expanded even though the importer knows them (:data:`FORCE_EXPAND`).
    """

    def __init__(self, known: Iterable[str] | None = None, force: frozenset[str] = FORCE_EXPAND) -> None:
        super().__init__()
        self.known = None if known is None else frozenset(known)
        self.force = force
        self.expanded: tuple[str, ...] = ()

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        from passes.expand_recurrent import RECURRENT_OPS

        known = tvm_known_ops() if self.known is None else self.known
        opset = _default_opset(model)
        expanded: list[str] = []
        if opset is not None:
            expanded = _expand_recurrent(model, RECURRENT_OPS - known)
            expanded += _expand_bodies(model, known, self.force, opset, len(expanded))
        if expanded:
            fold_expanded(model)
        self.expanded = tuple(expanded)
        return ir.passes.PassResult(model, bool(expanded))
