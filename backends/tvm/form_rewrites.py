"""Rewrites of op forms that TVM's importer or build gets wrong into equivalent standard ONNX.

Each rewrite replaces one node form by nodes that compute ONNX's definition exactly and that TVM
converts correctly (checked on apache-tvm 0.27 with the ONNX node suite):

- ``Sinh``/``Cosh``: LLVM has no ``sinh``/``cosh`` intrinsic (the build fails with "unknown
  intrinsic tirx.sinh"): ``(exp(x) - exp(-x)) / 2`` and ``(exp(x) + exp(-x)) / 2``.
- ``IsInf`` with ``detect_positive=0`` or ``detect_negative=0``: TVM's converter ignores both
  attributes (it flags every infinity): ``And(IsInf(x), x > 0)`` (or ``x < 0``, or all false).
- ``Squeeze`` with negative constant axes: TVM's build runs out of memory (``std::bad_alloc``);
  the axes are normalised to ``axis + rank``.
- ``ReduceMax`` on float32/float64/float16 inputs of known non-empty shape: TVM starts the reduction from the lowest *finite* value, so a slice
  that is all ``-inf`` (a fully masked attention row) gives -3.4e38 instead of ``-inf``, and
  the ``Equal(max, -inf)`` test of ONNX's Attention body misses it (NaN rows instead of 0):
  ``Where(ReduceMax(Cast(x > -inf)) == 0, -inf, ReduceMax(x))`` (same axes and keepdims).
- ``BitShift`` by a negative amount or by >= the bit width: undefined in C, and LLVM's result
  differs from ONNX's (0; for a right shift of a negative signed value, -1): the shift amount is
  clamped to a valid one and ``Where`` writes ONNX's value for the out-of-range lanes.
- ``Mod`` with ``fmod=0`` on floats: TVM's floor-mod formula ``x - floor(x/y)*y`` gives NaN for an
  infinite divisor: ``r = fmod(x, y)`` plus ``y`` where ``r`` is non-zero and its sign differs
  from ``y``'s (numpy's ``mod``, which ONNX's reference uses).
- ``ConvTranspose`` with ``output_shape``: TVM's converter ignores the attribute; the pads it
  implies (ONNX's formula, :func:`conv_transpose_pads`) are written instead. A form whose pads
  cannot be derived (unknown shapes, negative total padding) is refused by
  :mod:`backends.tvm.op_support`.

Rule: a rewrite keeps every value name the rest of the program reads (the last new node writes
the original output); new intermediates are ``<output>__<tag>``. Programs without such forms are
returned unchanged (the same object).
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

_FLOATS = frozenset({onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE, onnx.TensorProto.FLOAT16,
                     onnx.TensorProto.BFLOAT16})


def _attr(node: onnx.NodeProto, name: str, default=None):
    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default


def conv_transpose_pads(node: onnx.NodeProto, x_dims: list[int] | None,
                        w_dims: list[int] | None) -> tuple[list[int], list[int]] | None:
    """The explicit ``(pads, output_padding)`` a ConvTranspose with ``output_shape`` implies, or
    None when they cannot be derived. ONNX's operator definition: total = stride*(in-1) +
    output_padding + (k-1)*dilation + 1 - out; SAME_UPPER puts the odd unit at the end, otherwise
    at the start. A negative end pad (the output is longer than the full transposed convolution)
    becomes extra ``output_padding``: both append the same zeros (plus bias) at the end."""
    out = _attr(node, "output_shape")
    if out is None or x_dims is None or w_dims is None or len(x_dims) < 3:
        return None
    spatial = x_dims[2:]
    n = len(spatial)
    out = list(out)[-n:]
    strides = list(_attr(node, "strides", [1] * n))
    out_pad = list(_attr(node, "output_padding", [0] * n))
    dil = list(_attr(node, "dilations", [1] * n))
    kernel = list(_attr(node, "kernel_shape", w_dims[2:]))
    if len(out) != n or min(len(strides), len(out_pad), len(dil), len(kernel)) < n:
        return None
    auto_pad = _attr(node, "auto_pad", b"NOTSET")
    auto_pad = auto_pad.decode() if isinstance(auto_pad, bytes) else str(auto_pad)
    begins, ends = [], []
    for i in range(n):
        total = strides[i] * (spatial[i] - 1) + out_pad[i] + (kernel[i] - 1) * dil[i] + 1 - out[i]
        half = total // 2
        begin, end = (half, total - half) if auto_pad == "SAME_UPPER" else (total - half, half)
        if end < 0:
            out_pad[i] += -end
            end = 0
        if begin < 0 or out_pad[i] >= max(strides[i], dil[i]):
            return None
        begins.append(begin)
        ends.append(end)
    return begins + ends, out_pad[:n]


def _types(g: onnx.GraphProto) -> dict[str, onnx.TypeProto]:
    types = {v.name: v.type for v in [*g.input, *g.value_info, *g.output]}
    for t in g.initializer:
        types.setdefault(t.name, helper.make_tensor_type_proto(t.data_type, list(t.dims)))
    return types


def _dims(types: dict[str, onnx.TypeProto], name: str) -> list[int] | None:
    t = types.get(name)
    if t is None or not t.HasField("tensor_type") or not t.tensor_type.HasField("shape"):
        return None
    dims = t.tensor_type.shape.dim
    return [int(d.dim_value) for d in dims] if all(d.HasField("dim_value") for d in dims) else None


def _elem(types: dict[str, onnx.TypeProto], name: str) -> int | None:
    t = types.get(name)
    return t.tensor_type.elem_type if t is not None and t.HasField("tensor_type") else None


class _Rewriter:
    """Collects replacement nodes and new initializers for one program."""

    def __init__(self, program: onnx.ModelProto) -> None:
        self.g = program.graph
        self.types = _types(self.g)
        self.consts = {t.name: t for t in self.g.initializer}
        self.inits: list[onnx.TensorProto] = []

    def const(self, name: str, value: np.ndarray) -> str:
        self.inits.append(numpy_helper.from_array(value, name))
        return name

    def sinh_cosh(self, node: onnx.NodeProto) -> list[onnx.NodeProto] | None:
        x, y = node.input[0], node.output[0]
        elem = _elem(self.types, x)
        if elem not in _FLOATS:
            return None
        two = self.const(f"{y}__two", np.array(2, dtype=helper.tensor_dtype_to_np_dtype(elem)))
        combine = "Sub" if node.op_type == "Sinh" else "Add"
        return [helper.make_node("Exp", [x], [f"{y}__ep"], name=f"{node.name}__ep"),
                helper.make_node("Neg", [x], [f"{y}__neg"], name=f"{node.name}__neg"),
                helper.make_node("Exp", [f"{y}__neg"], [f"{y}__en"], name=f"{node.name}__en"),
                helper.make_node(combine, [f"{y}__ep", f"{y}__en"], [f"{y}__num"], name=f"{node.name}__num"),
                helper.make_node("Div", [f"{y}__num", two], [y], name=node.name)]

    def is_inf(self, node: onnx.NodeProto) -> list[onnx.NodeProto] | None:
        pos, neg = int(_attr(node, "detect_positive", 1)), int(_attr(node, "detect_negative", 1))
        x, y = node.input[0], node.output[0]
        elem = _elem(self.types, x)
        if (pos and neg) or elem is None:
            return None
        zero = self.const(f"{y}__zero", np.array(0, dtype=helper.tensor_dtype_to_np_dtype(elem)))
        inf = helper.make_node("IsInf", [x], [f"{y}__inf"], name=f"{node.name}__inf")
        sign = "Greater" if pos else "Less"
        nodes = [inf, helper.make_node(sign, [x, zero], [f"{y}__sign"], name=f"{node.name}__sign")]
        if not pos and not neg:  # nothing to detect: inf and not inf
            nodes = [inf, helper.make_node("Not", [f"{y}__inf"], [f"{y}__sign"], name=f"{node.name}__sign")]
        return nodes + [helper.make_node("And", [f"{y}__inf", f"{y}__sign"], [y], name=node.name)]

    def squeeze(self, node: onnx.NodeProto) -> list[onnx.NodeProto] | None:
        axes_name = node.input[1] if len(node.input) > 1 else ""
        rank = len(_dims(self.types, node.input[0]) or [])
        if not axes_name or axes_name not in self.consts or not rank:
            return None
        axes = numpy_helper.to_array(self.consts[axes_name]).astype(np.int64)
        if not np.any(axes < 0):
            return None
        fixed = self.const(f"{node.output[0]}__axes", np.where(axes < 0, axes + rank, axes).astype(np.int64))
        new = onnx.NodeProto()
        new.CopyFrom(node)
        new.input[1] = fixed
        return [new]

    def conv_transpose(self, node: onnx.NodeProto) -> list[onnx.NodeProto] | None:
        derived = conv_transpose_pads(node, _dims(self.types, node.input[0]), _dims(self.types, node.input[1]))
        if derived is None:
            return None
        new = onnx.NodeProto()
        new.CopyFrom(node)
        keep = [a for a in new.attribute if a.name not in ("output_shape", "pads", "auto_pad", "output_padding")]
        del new.attribute[:]
        new.attribute.extend(keep)
        new.attribute.extend([helper.make_attribute("pads", derived[0]),
                              helper.make_attribute("output_padding", derived[1])])
        return [new]


    def reduce_max(self, node: onnx.NodeProto) -> list[onnx.NodeProto] | None:
        x, y = node.input[0], node.output[0]
        elem = _elem(self.types, x)
        dims = _dims(self.types, x)
        # bfloat16: TVM's build fails on the bool cast ("int8x6 vs boolx6"); an empty input: left as it was
        if elem not in _FLOATS or elem == onnx.TensorProto.BFLOAT16 or dims is None or 0 in dims:
            return None
        np_dtype = helper.tensor_dtype_to_np_dtype(elem)
        ninf = self.const(f"{y}__ninf", np.array(-np.inf, dtype=np_dtype))
        zero = self.const(f"{y}__zero", np.array(0, dtype=np_dtype))
        raw, live = onnx.NodeProto(), onnx.NodeProto()
        raw.CopyFrom(node)
        raw.output[0], raw.name = f"{y}__raw", f"{node.name}__raw"
        live.CopyFrom(node)
        live.input[0], live.output[0], live.name = f"{y}__gt", f"{y}__live", f"{node.name}__live"
        return [raw,
                helper.make_node("Greater", [x, ninf], [f"{y}__gtb"], name=f"{node.name}__gtb"),
                helper.make_node("Cast", [f"{y}__gtb"], [f"{y}__gt"], to=elem, name=f"{node.name}__gt"),
                live,
                helper.make_node("Equal", [f"{y}__live", zero], [f"{y}__none"], name=f"{node.name}__none"),
                helper.make_node("Where", [f"{y}__none", ninf, f"{y}__raw"], [y], name=node.name)]

    def bit_shift(self, node: onnx.NodeProto) -> list[onnx.NodeProto] | None:
        a, b, y = node.input[0], node.input[1], node.output[0]
        elem = _elem(self.types, a)
        if elem is None or elem in _FLOATS or elem == onnx.TensorProto.BOOL:
            return None
        np_dtype = np.dtype(helper.tensor_dtype_to_np_dtype(elem))
        width = self.const(f"{y}__width", np.array(np_dtype.itemsize * 8, dtype=np_dtype))
        zero = self.const(f"{y}__zero", np.array(0, dtype=np_dtype))
        n = node.name
        nodes = [helper.make_node("Less", [b, zero], [f"{y}__neg"], name=f"{n}__neg"),
                 helper.make_node("Not", [f"{y}__neg"], [f"{y}__nonneg"], name=f"{n}__nonneg"),
                 helper.make_node("Less", [b, width], [f"{y}__narrow"], name=f"{n}__narrow"),
                 helper.make_node("And", [f"{y}__nonneg", f"{y}__narrow"], [f"{y}__valid"], name=f"{n}__valid"),
                 helper.make_node("Where", [f"{y}__valid", b, zero], [f"{y}__b"], name=f"{n}__b")]
        shift = onnx.NodeProto()
        shift.CopyFrom(node)
        shift.input[1], shift.output[0], shift.name = f"{y}__b", f"{y}__shifted", f"{n}__shifted"
        nodes.append(shift)
        fill = zero
        if _s(_attr(node, "direction")) == "RIGHT" and np_dtype.kind == "i":  # arithmetic shift: the sign
            minus = self.const(f"{y}__minus", np.array(-1, dtype=np_dtype))
            nodes += [helper.make_node("Less", [a, zero], [f"{y}__aneg"], name=f"{n}__aneg"),
                      helper.make_node("Where", [f"{y}__aneg", minus, zero], [f"{y}__fill"], name=f"{n}__fill")]
            fill = f"{y}__fill"
        return nodes + [helper.make_node("Where", [f"{y}__valid", f"{y}__shifted", fill], [y], name=n)]

    def float_mod(self, node: onnx.NodeProto) -> list[onnx.NodeProto] | None:
        a, b, y = node.input[0], node.input[1], node.output[0]
        elem = _elem(self.types, a)
        if elem not in _FLOATS or int(_attr(node, "fmod", 0)) == 1:
            return None
        zero = self.const(f"{y}__zero", np.array(0, dtype=helper.tensor_dtype_to_np_dtype(elem)))
        n = node.name
        return [helper.make_node("Mod", [a, b], [f"{y}__r"], fmod=1, name=f"{n}__r"),
                helper.make_node("Equal", [f"{y}__r", zero], [f"{y}__r0"], name=f"{n}__r0"),
                helper.make_node("Not", [f"{y}__r0"], [f"{y}__rnz"], name=f"{n}__rnz"),
                helper.make_node("Less", [f"{y}__r", zero], [f"{y}__rneg"], name=f"{n}__rneg"),
                helper.make_node("Less", [b, zero], [f"{y}__bneg"], name=f"{n}__bneg"),
                helper.make_node("Xor", [f"{y}__rneg", f"{y}__bneg"], [f"{y}__sign"], name=f"{n}__sign"),
                helper.make_node("And", [f"{y}__rnz", f"{y}__sign"], [f"{y}__fix"], name=f"{n}__fix"),
                helper.make_node("Add", [f"{y}__r", b], [f"{y}__rb"], name=f"{n}__rb"),
                helper.make_node("Where", [f"{y}__fix", f"{y}__rb", f"{y}__r"], [y], name=n)]


def _s(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value or "")


_HANDLERS = {"Sinh": "sinh_cosh", "Cosh": "sinh_cosh", "IsInf": "is_inf", "Squeeze": "squeeze",
             "ConvTranspose": "conv_transpose", "ReduceMax": "reduce_max",
             "BitShift": "bit_shift", "Mod": "float_mod"}


def rewrite_forms(program: onnx.ModelProto) -> onnx.ModelProto:
    """``program`` with the forms listed in the module docstring rewritten (needs inferred shapes)."""
    g = program.graph
    if not any(n.op_type in _HANDLERS and n.domain in ("", "ai.onnx") for n in g.node):
        return program
    rw = _Rewriter(program)
    nodes, changed = [], False
    for node in g.node:
        handler = _HANDLERS.get(node.op_type) if node.domain in ("", "ai.onnx") else None
        new = getattr(rw, handler)(node) if handler else None
        if new is None:
            nodes.append(node)
            continue
        nodes.extend(new)
        changed = True
    if not changed:
        return program
    out = onnx.ModelProto()
    out.CopyFrom(program)
    del out.graph.node[:]
    out.graph.node.extend(nodes)
    out.graph.initializer.extend(rw.inits)
    return out
