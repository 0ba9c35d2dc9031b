"""Layout pass: sink Transposes through layout-agnostic ops and cancel inverse pairs.

Why this shape: standard ONNX ``Conv``, ``BatchNormalization`` and the pooling ops only exist
in NCHW, so a pure-ONNX NHWC conv region cannot be written down; the layout a kernel really
uses is the backend's choice. What *is* expressible, and what costs real time, are the
``Transpose`` nodes a model already carries: TF/Keras exports (NHWC input ->
``Transpose(0,3,1,2)`` -> Conv ... -> ``Transpose(0,2,3,1)`` -> elementwise ->
``Transpose(0,3,1,2)`` -> Conv) and layout shuffles in transformers. This pass is the engine
that removes them, in the spirit of onnxruntime's transpose optimizer. It does not insert
layout changes around convolutions and does not move Transposes through Conv, BatchNormalization,
pooling, Reshape, MatMul, Softmax or reductions (those have an axis meaning it does not remap).

Rules, applied to the main graph until nothing changes:

1. Compose: ``Transpose(q)`` reading the output of ``Transpose(p)`` becomes one
   ``Transpose(p[q[i]])`` reading ``Transpose(p)``'s input (the first one goes when unused).
2. Cancel: a ``Transpose`` whose permutation is the identity is removed and its readers read
   its input (kept only when its output is a graph output and its input is a graph input or
   initializer, so the signature holds).
3. Sink through a unary elementwise op (:data:`passes.group_elementwise.UNARY`, extra inputs
   constant) that is the only reader of ``Transpose(p)``: ``op(T_p(x)) -> T_p(op(x))``.
4. Sink through a binary elementwise op (:data:`passes.group_elementwise.BINARY`) that is the
   only reader of a ``Transpose(p)``, when its other operand is a constant (made rank-``n``
   with leading 1s and transposed by ``p``'s inverse, a new initializer; one-element constants
   stay as they are) or is ``Transpose(p)`` of something too:
   ``op(T_p(a), T_p(b)) -> T_p(op(a, b))``.
5. Sink through ``Concat(axis)`` whose inputs are all ``Transpose(p)`` outputs read only by it:
   ``Concat(T_p(a), T_p(b), axis=k) -> T_p(Concat(a, b, axis=p[k]))``.

Sinking never adds a Transpose (one or more in, one out) and always moves one strictly towards
the outputs, so the rewrite terminates; rules 1 and 2 then remove the pairs that meet.

Before/After (an NHWC-style elementwise island between two NCHW convs)::

    Conv -> Transpose(0,2,3,1) -> Add(bias[C]) -> Relu -> Transpose(0,3,1,2) -> Conv
    Conv -> Add(bias[C,1,1]) -> Relu -> Conv

Invariant: the values the graph computes are unchanged; graph inputs and outputs keep their
names. Constants left unused are for dead-code elimination.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from passes.group_elementwise import BINARY, UNARY
from passes.registry import register
from passes.values import const_array

_MAX_ROUNDS = 10_000


def _perm(node: ir.Node) -> list[int] | None:
    if node.op_type != "Transpose" or node.domain != "" or node.inputs[0] is None:
        return None
    perm = node.attributes.get_ints("perm", None)
    if perm is None:
        shape = node.inputs[0].shape
        return None if shape is None else list(range(len(shape)))[::-1]
    return list(perm)


def _transposed_shape(shape: ir.Shape | None, perm: list[int]) -> ir.Shape | None:
    if shape is None or len(shape) != len(perm):
        return None
    return ir.Shape([shape[i] for i in perm])


class _Sinker:
    def __init__(self, graph: ir.Graph) -> None:
        self.graph = graph
        self.taken = {v.name for v in graph.inputs if v.name} | set(graph.initializers)
        for node in graph:
            self.taken.update(o.name for o in node.outputs if o.name)

    def fresh(self, base: str) -> str:
        name, n = base, 0
        while name in self.taken:
            n += 1
            name = f"{base}_{n}"
        self.taken.add(name)
        return name

    def replace(self, old: ir.Value, new: ir.Value) -> None:
        """Readers (and the graph output slot) of ``old`` read ``new``; ``new`` takes ``old``'s name."""
        name = old.name
        ir.convenience.replace_all_uses_with(old, new, replace_graph_outputs=True)
        old.name = None
        new.name = name

    def drop_if_unused(self, node: ir.Node) -> None:
        if node.graph is self.graph and not any(o.uses() or o.is_graph_output() for o in node.outputs):
            self.graph.remove(node, safe=True)

    # -- rules 1 and 2 -------------------------------------------------------------------------
    def compose_or_cancel(self, t: ir.Node) -> bool:
        perm = _perm(t)
        if perm is None:
            return False
        x, y = t.inputs[0], t.outputs[0]
        assert x is not None
        first = x.producer()
        first_perm = _perm(first) if first is not None else None
        if first is not None and first_perm is not None and len(first_perm) == len(perm):
            source = first.inputs[0]
            assert source is not None
            t.replace_input_with(0, source)
            t.attributes["perm"] = ir.Attr("perm", ir.AttributeType.INTS, [first_perm[i] for i in perm])
            self.drop_if_unused(first)
            return True
        if perm == list(range(len(perm))):
            if y.is_graph_output() and (x.is_graph_input() or x.is_initializer() or x.is_graph_output()):
                return False
            if y.is_graph_output():
                self.replace(y, x)
            else:
                ir.convenience.replace_all_uses_with(y, x)
            self.graph.remove(t, safe=True)
            return True
        return False

    # -- rules 3 to 5 --------------------------------------------------------------------------
    def sink(self, t: ir.Node) -> bool:
        perm = _perm(t)
        if perm is None:
            return False
        y = t.outputs[0]
        if y.is_graph_output() or len({u.node for u in y.uses()}) != 1:
            return False
        reader = next(iter(y.uses())).node
        if reader.domain != "" or len(reader.outputs) != 1:
            return False
        if reader.op_type in UNARY and reader.inputs[0] is y:
            if any(v is not None and (v is y or const_array(v) is None) for v in reader.inputs[1:]):
                return False
            return self._rebuild(reader, t, perm, [t.inputs[0], *reader.inputs[1:]], [])
        if reader.op_type in BINARY and len(reader.inputs) == 2:
            new_inputs: list[ir.Value | None] = []
            sources: list[ir.Node] = []
            for v in reader.inputs:
                assert v is not None
                producer = v.producer()
                if producer is not None and _perm(producer) == perm:
                    new_inputs.append(producer.inputs[0])
                    sources.append(producer)
                    continue
                array = const_array(v)
                if array is None or array.ndim > len(perm):
                    return False
                new_inputs.append(v if array.size == 1 else self._permuted_const(v, array, perm))
            return self._rebuild(reader, t, perm, new_inputs, sources)
        if reader.op_type == "Concat":
            sources = []
            for v in reader.inputs:
                producer = v.producer() if v is not None else None
                if producer is None or _perm(producer) != perm or len({u.node for u in v.uses()}) != 1:
                    return False
                if v.is_graph_output():
                    return False
                sources.append(producer)
            axis = reader.attributes.get_int("axis", 0)
            axis = axis + len(perm) if axis < 0 else axis
            attrs = {"axis": ir.Attr("axis", ir.AttributeType.INT, perm[axis])}
            return self._rebuild(reader, t, perm, [s.inputs[0] for s in sources], sources, attrs)
        return False

    def _permuted_const(self, value: ir.Value, array: np.ndarray, perm: list[int]) -> ir.Value:
        full = array.reshape((1,) * (len(perm) - array.ndim) + array.shape)
        inverse = [0] * len(perm)
        for i, p in enumerate(perm):
            inverse[p] = i
        moved = np.ascontiguousarray(np.transpose(full, inverse))
        name = self.fresh(f"{value.name or 'const'}.perm")
        tensor = ir.tensor(moved, name=name)
        new = ir.Value(
            name=name, shape=ir.Shape(moved.shape), type=ir.TensorType(tensor.dtype), const_value=tensor
        )
        self.graph.register_initializer(new)
        return new

    def _rebuild(
        self,
        reader: ir.Node,
        t: ir.Node,
        perm: list[int],
        inputs: list[ir.Value | None],
        sources: list[ir.Node],
        attributes: dict[str, ir.Attr] | None = None,
    ) -> bool:
        attrs = {name: ir.Attr(name, a.type, a.value) for name, a in reader.attributes.items()}
        attrs.update(attributes or {})
        old = reader.outputs[0]
        inner = ir.Node(
            "", reader.op_type, inputs, list(attrs.values()), name=f"{reader.name or reader.op_type}.sunk"
        )
        inner_out = inner.outputs[0]
        inner_out.name = self.fresh(f"{old.name}.pre_transpose")
        inner_out.type = old.type
        inverse = [0] * len(perm)
        for i, p in enumerate(perm):
            inverse[p] = i
        inner_out.shape = _transposed_shape(old.shape, inverse)
        after = ir.Node("", "Transpose", [inner_out], [ir.Attr("perm", ir.AttributeType.INTS, perm)],
                        name=f"{t.name or 'transpose'}.sunk")
        after_out = after.outputs[0]
        after_out.type, after_out.shape = old.type, old.shape
        self.graph.insert_after(reader, [inner, after])
        self.replace(old, after_out)
        self.graph.remove(reader, safe=True)
        for node in {t, *sources}:
            self.drop_if_unused(node)
        return True


def sink_transposes(graph: ir.Graph) -> int:
    """Apply rules 1 to 5 to ``graph`` until nothing changes; return how many rewrites were made."""
    sinker = _Sinker(graph)
    rewrites = 0
    for _ in range(_MAX_ROUNDS):
        changed = False
        for node in list(graph):
            if node.graph is not graph or node.op_type != "Transpose":
                continue
            if sinker.compose_or_cancel(node) or sinker.sink(node):
                rewrites += 1
                changed = True
        if not changed:
            break
    return rewrites


@register("layout_nhwc")
class LayoutNHWC(ir.passes.InPlacePass):
    """Push Transposes through layout-agnostic ops and cancel inverse pairs (see module docstring)."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        return ir.passes.PassResult(model, modified=bool(sink_transposes(model.graph)))
