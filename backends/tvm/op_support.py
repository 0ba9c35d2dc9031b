"""The TVM backend's op and dtype support table: node forms refused before anything is built.

TVM's ONNX importer has a converter for most ops, but some *forms* of an op (an attribute value,
an input dtype, an optional output) fail in the importer or in ``tvm.compile``, or compile to a
program whose outputs differ from ONNX's definition. Each such form is listed here as a
:class:`Rule`, so that the backend refuses it by name before building, instead of failing deep in
TVM or, worse, returning wrong numbers.

Rules:
1. A rule names an op type (``"*"``: every op), says in words which form is unsupported and why,
   and has a predicate over the node and its program's :class:`Context` (value types, constant
   values, which values are read). Each rule comes from a case of the ONNX node suite that failed
   or mismatched on apache-tvm 0.27 (``tests/conformance``); the conformance run is how a rule
   is retired once TVM or a rewrite handles the form.
2. :func:`refusals` lists every refused top-level node of a program, :func:`check` raises one
   :class:`UnsupportedByBackendError` naming them all (called by
   :func:`backends.tvm.lower.check_supported`), and the per-segment ONNX Runtime fallback treats
   the refused nodes like ops TVM lacks (:func:`refused_outputs`), so ``--fallback onnxruntime``
   runs just those nodes under ONNX Runtime.
3. Predicates look only at the program (types, attributes, constants), never at run-time
   values: the decision is the same for the builder and the artifact writer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import TensorProto, numpy_helper

from backends.tvm.form_rewrites import conv_transpose_pads
from partitioner.core.comm_ops import is_comm
from partitioner.core.errors import UnsupportedByBackendError


def _dtypes(*names: str) -> frozenset[int]:
    return frozenset(getattr(TensorProto, n) for n in names if hasattr(TensorProto, n))


# Element types TVM 0.27's CPU build cannot compute with (no float8 arithmetic or casts, no
# strings, no sub-byte tensors).
UNSUPPORTED_DTYPES = _dtypes("STRING", "FLOAT8E4M3FN", "FLOAT8E4M3FNUZ", "FLOAT8E5M2", "FLOAT8E5M2FNUZ",
                             "FLOAT8E8M0", "INT4", "UINT4", "INT2", "UINT2", "FLOAT4E2M1")
_FLOAT32 = TensorProto.FLOAT


@dataclass
class Context:
    """What a rule may read about a program: value types, constant values and the values read."""

    types: dict[str, onnx.TypeProto] = field(default_factory=dict)
    consts: dict[str, np.ndarray] = field(default_factory=dict)
    read: set[str] = field(default_factory=set)

    def elem(self, name: str) -> int | None:
        t = self.types.get(name)
        if t is None or not t.HasField("tensor_type"):
            return None
        return t.tensor_type.elem_type or None

    def dims(self, name: str) -> list[int] | None:
        t = self.types.get(name)
        if t is None or not t.HasField("tensor_type") or not t.tensor_type.HasField("shape"):
            return None
        dims = t.tensor_type.shape.dim
        return [int(d.dim_value) for d in dims] if all(d.HasField("dim_value") for d in dims) else None

    def const(self, name: str) -> np.ndarray | None:
        return self.consts.get(name) if name else None

    def used(self, node: onnx.NodeProto, k: int) -> bool:
        """Whether output ``k`` of ``node`` exists and is read (by a node or as a graph output)."""
        return len(node.output) > k and bool(node.output[k]) and node.output[k] in self.read


def context(program: onnx.ModelProto) -> Context:
    """The :class:`Context` of ``program`` (types from ONNX shape inference when it succeeds)."""
    try:
        inferred = onnx.shape_inference.infer_shapes(program)
    except Exception:  # noqa: BLE001 - inference is a help here, not a requirement
        inferred = program
    g = inferred.graph
    ctx = Context()
    for v in [*g.input, *g.value_info, *g.output]:
        ctx.types[v.name] = v.type
    for t in g.initializer:
        ctx.types.setdefault(t.name, onnx.helper.make_tensor_type_proto(t.data_type, list(t.dims)))
        if t.data_location != TensorProto.EXTERNAL and int(np.prod(t.dims, dtype=np.int64)) <= 4096:
            ctx.consts[t.name] = numpy_helper.to_array(t)
    for n in g.node:
        ctx.read.update(i for i in n.input if i)
        for a in n.attribute:
            for sub in [*a.graphs, *([a.g] if a.HasField("g") else [])]:
                ctx.read.update(i for sn in sub.node for i in sn.input if i)
        if n.op_type == "Constant" and n.domain in ("", "ai.onnx") and n.output:
            value = next((a for a in n.attribute if a.name == "value"), None)
            if value is not None and value.HasField("t"):
                ctx.consts[n.output[0]] = numpy_helper.to_array(value.t)
    ctx.read.update(o.name for o in g.output)
    return ctx


def _attr(node: onnx.NodeProto, name: str, default=None):
    for a in node.attribute:
        if a.name == name:
            return onnx.helper.get_attribute_value(a)
    return default


def _in(node: onnx.NodeProto, k: int) -> str:
    return node.input[k] if len(node.input) > k else ""


@dataclass(frozen=True)
class Rule:
    """One unsupported form of an op (rule 1). ``what`` is shown to the user."""

    op: str
    what: str
    applies: Callable[[onnx.NodeProto, Context], bool]


def _bad_dtype(node: onnx.NodeProto, ctx: Context) -> bool:
    for name in [*node.input, *node.output]:
        if not name or name not in ctx.types:
            continue
        t = ctx.types[name]
        if not t.HasField("tensor_type") or t.tensor_type.elem_type in UNSUPPORTED_DTYPES:
            return True
    return False


def _resize_downsamples(node: onnx.NodeProto, ctx: Context) -> bool:
    if _attr(node, "mode", b"nearest") in (b"nearest", "nearest"):
        return False
    scales, sizes = ctx.const(_in(node, 2)), ctx.const(_in(node, 3))
    if scales is not None and scales.size and bool(np.any(scales < 1)):
        return True
    dims = ctx.dims(node.input[0])
    return sizes is not None and sizes.size > 0 and dims is not None and len(dims) == sizes.size and bool(
        np.any(np.asarray(sizes) < np.asarray(dims)))


def _s(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value or "")


def _norm_over_all_axes(node: onnx.NodeProto, ctx: Context) -> bool:
    dims = ctx.dims(node.input[0])
    axis = int(_attr(node, "axis", -1))
    return dims is not None and (axis == 0 or axis == -len(dims))


def _split_has_empty_part(node: onnx.NodeProto, ctx: Context) -> bool:
    split = ctx.const(_in(node, 1))
    if split is None:
        split = _attr(node, "split")
    return split is not None and len(split) > 0 and bool(np.any(np.asarray(split) == 0))


def _not_const(*slots: int) -> Callable[[onnx.NodeProto, Context], bool]:
    return lambda node, ctx: any(_in(node, k) and ctx.const(_in(node, k)) is None for k in slots)


def _dropout_training(node: onnx.NodeProto, ctx: Context) -> bool:
    mode = _in(node, 2)
    if not mode:
        return False
    value = ctx.const(mode)
    return value is None or bool(np.asarray(value).reshape(-1)[0])


def _pow_not_float(node: onnx.NodeProto, ctx: Context) -> bool:
    a, b = ctx.elem(node.input[0]), ctx.elem(node.input[1])
    floats = (TensorProto.FLOAT, TensorProto.DOUBLE, TensorProto.FLOAT16, TensorProto.BFLOAT16)
    return a is not None and b is not None and (a != b or a not in floats)


def _zero_element_const(node: onnx.NodeProto, ctx: Context) -> bool:
    # rank >= 2: a data tensor (an empty 1-D list of axes, pads or roi is read by the importer, never stored)
    return any(x and ctx.const(x) is not None and ctx.const(x).size == 0 and ctx.const(x).ndim >= 2
               for x in node.input)


RULES: tuple[Rule, ...] = (
    Rule("*", "a string, float8, sub-byte, sequence, optional or map value (TVM computes none of these)", _bad_dtype),
    Rule("LayerNormalization", "its Mean/InvStdDev outputs read (TVM's converter computes only Y)",
         lambda n, c: c.used(n, 1) or c.used(n, 2)),
    Rule("BatchNormalization", "training_mode=1 (TVM's converter computes inference-mode statistics only)",
         lambda n, c: int(_attr(n, "training_mode", 0)) == 1),
    Rule("Dropout", "training mode (the mask is random; TVM's dropout does not match ONNX's)", _dropout_training),
    Rule("Resize", "antialias=1 (TVM's resize has no antialiasing filter)", lambda n, c: int(_attr(n, "antialias", 0)) == 1),
    Rule("Resize", "coordinate_transformation_mode half_pixel_symmetric or tf_crop_and_resize",
         lambda n, c: _s(_attr(n, "coordinate_transformation_mode")) in ("half_pixel_symmetric", "tf_crop_and_resize")),
    Rule("Resize", "the axes attribute or keep_aspect_ratio_policy other than stretch",
         lambda n, c: _attr(n, "axes") is not None or _s(_attr(n, "keep_aspect_ratio_policy", "stretch")) != "stretch"),
    Rule("Resize", "linear or cubic downsampling (TVM samples the input differently from ONNX when a scale is < 1)",
         _resize_downsamples),
    Rule("ConvTranspose", "an output_shape whose pads cannot be derived (TVM's converter ignores output_shape; "
         "backends.tvm.form_rewrites writes the pads it implies when shapes are known)",
         lambda n, c: _attr(n, "output_shape") is not None
         and conv_transpose_pads(n, c.dims(n.input[0]), c.dims(n.input[1])) is None),
    Rule("RMSNormalization", "normalising over every axis (axis 0: TVM's build fails)", _norm_over_all_axes),
    Rule("Elu", "a non-float32 input (TVM's converter mixes float32 constants in; Celu expands to Elu)",
         lambda n, c: c.elem(n.input[0]) not in (None, _FLOAT32)),
    Rule("Pow", "integer or mixed-dtype operands (TVM's power is float-only and same-dtype)", _pow_not_float),
    Rule("ReduceMax", "a bool input (TVM has no min value for bool)", lambda n, c: c.elem(n.input[0]) == TensorProto.BOOL),
    Rule("ReduceMin", "a bool input (TVM has no max value for bool)", lambda n, c: c.elem(n.input[0]) == TensorProto.BOOL),
    Rule("Split", "a zero-sized part (TVM's build fails)", _split_has_empty_part),
    Rule("TopK", "a uint64 input (TVM's runtime sort has no uint64)", lambda n, c: c.elem(n.input[0]) == TensorProto.UINT64),
    Rule("MaxPool", "its Indices output read (TVM's converter computes only Y)", lambda n, c: c.used(n, 1)),
    Rule("MaxUnpool", "the output_shape input (TVM's converter needs it as a constant list)", _not_const(2)),
    Rule("OneHot", "a depth or values input that is not a constant (TVM's converter needs both as constants)",
         _not_const(1, 2)),
    Rule("Compress", "a condition that is not a constant (the output shape depends on its values)", _not_const(1)),
    Rule("QuantizeLinear", "blocked quantization (block_size > 0)", lambda n, c: int(_attr(n, "block_size", 0)) > 0),
    Rule("DequantizeLinear", "blocked quantization (block_size > 0)", lambda n, c: int(_attr(n, "block_size", 0)) > 0),
    Rule("DequantizeLinear", "a non-float32 scale (TVM's converter computes in float32)",
         lambda n, c: c.elem(_in(n, 1)) not in (None, _FLOAT32)),
    Rule("EyeLike", "a dtype attribute different from the input's dtype (TVM's converter fails)",
         lambda n, c: _attr(n, "dtype") is not None and int(_attr(n, "dtype")) != c.elem(n.input[0])),
    Rule("Upsample", "a scales input (opset 9; TVM's converter reads only the opset 7 attribute)",
         lambda n, c: bool(_in(n, 1))),
    Rule("ScatterElements", "a rank >= 2 input (TVM 0.27's build fails: 'There should be a compute block if there "
         "is only one subtree under the root')", lambda n, c: len(c.dims(n.input[0]) or []) >= 2),
    Rule("Dropout", "its mask output read (TVM's dropout returns a tuple its layout pass rejects)",
         lambda n, c: c.used(n, 1)),
    Rule("MaxUnpool", "any input (TVM 0.27's build fails: 'There should be a compute block')", lambda n, c: True),
    Rule("OptionalHasElement", "an absent input (TVM's converter expects one)", lambda n, c: not _in(n, 0)),
    Rule("Unique", "a bfloat16 input (TVM's layout pass fails)", lambda n, c: c.elem(n.input[0]) == TensorProto.BFLOAT16),
    Rule("*", "a zero-element constant data input (TVM 0.27 writes it into the library in a form its loader rejects: "
         "'Invalid DLTensor file format')", _zero_element_const),
    Rule("RoiAlign", "mode=max (TVM's max pooling differs from ONNX's)", lambda n, c: _s(_attr(n, "mode", "avg")) == "max"),
    Rule("SpaceToDepth", "mode=CRD (TVM's converter ignores mode)", lambda n, c: _s(_attr(n, "mode", "DCR")) == "CRD"),
)


def refusals(program: onnx.ModelProto, ctx: Context | None = None) -> list[tuple[onnx.NodeProto, str]]:
    """Every refused top-level node of ``program`` with the first rule that refuses it."""
    found = []
    nodes = [n for n in program.graph.node if not is_comm(n) and n.domain in ("", "ai.onnx")]
    if not nodes:
        return found
    ctx = ctx or context(program)
    for node in nodes:
        for rule in RULES:
            if rule.op in ("*", node.op_type) and rule.applies(node, ctx):
                found.append((node, f"{node.op_type} with {rule.what}"))
                break
    return found


def refused_outputs(program: onnx.ModelProto) -> frozenset[str]:
    """First output names of the refused nodes (how the ORT fallback recognises them)."""
    return frozenset(n.output[0] for n, _ in refusals(program) if n.output)


def check(program: onnx.ModelProto) -> None:
    """Raise one :class:`UnsupportedByBackendError` listing every refused node (rule 2)."""
    found = refusals(program)
    if not found:
        return
    listing = "; ".join(f"{n.name or '<unnamed>'}: {why}" for n, why in found[:8])
    more = f" (and {len(found) - 8} more)" if len(found) > 8 else ""
    kinds = sorted({n.op_type for n, _ in found})
    raise UnsupportedByBackendError(
        f"graph {program.graph.name!r}: the TVM backend does not support {len(found)} node(s) of op type(s) "
        f"{', '.join(kinds)}: {listing}{more}; use --fallback onnxruntime (runs just these nodes under ONNX Runtime "
        "inside the rank) or --backend onnxruntime")
