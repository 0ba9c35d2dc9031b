"""Recognise a decomposed layer normalisation as one ``LayerNormalization`` (opset >= 17).

Rules:

1. Pattern (binary operands in either order where the op commutes)::

       m = ReduceMean(x, axes)          d = Sub(x, m)
       p = Pow(d, 2)  (or Mul(d, d))    v = ReduceMean(p, axes)
       s = Sqrt(Add(v, eps))            n = Div(d, s)
       y = Add(Mul(n, gamma), beta)     (the Mul and the Add are each optional)

   Both ReduceMeans keep dims (``keepdims`` 1) and reduce the same axes, given as an attribute
   (opset < 18) or a constant input (opset >= 18); the axes, made non-negative with the rank of
   ``x``, must be the trailing ones ``[r-k, ..., r-1]``. ``eps``, ``gamma`` and ``beta`` are
   constants; ``eps`` has one element. ``x`` has a known rank, and the normalised dims
   ``x.shape[r-k:]`` are static whenever ``gamma`` or ``beta`` must be broadcast.
2. Every intermediate value is read only by matched nodes (``d`` by the Pow/Mul and the Div,
   the others once) and none is a graph output.
3. The model imports the default opset >= 17. The nodes become
   ``LayerNormalization(x, gamma', beta', axis=r-k, epsilon=eps)`` where ``gamma'``/``beta'`` are
   ``gamma``/``beta`` broadcast to the normalised shape (ones / zeros when absent), added as new
   initializers. The new node's output takes the last matched node's output (and its name when
   it is a graph output).

Invariant: the values the graph computes are unchanged up to float rounding; graph inputs and
outputs keep their names. Constants left unused are for dead-code elimination.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx_ir as ir

from passes.registry import register
from passes.values import const_array, scalar_const

LAYERNORM_MIN_OPSET = 17


def _sole_reader(value: ir.Value, op_types: tuple[str, ...]) -> ir.Node | None:
    if value.is_graph_output() or len(value.uses()) != 1:
        return None
    node = next(iter(value.uses())).node
    return node if node.op_type in op_types and node.domain == "" else None


def _other(node: ir.Node, value: ir.Value) -> ir.Value | None:
    if len(node.inputs) != 2:
        return None
    a, b = node.inputs
    if a is value and b is not value:
        return b
    if b is value and a is not value:
        return a
    return None


def _reduce_axes(node: ir.Node, rank: int) -> tuple[int, ...] | None:
    if node.op_type != "ReduceMean" or node.domain != "" or node.attributes.get_int("keepdims", 1) != 1:
        return None
    if node.attributes.get_int("noop_with_empty_axes", 0) != 0:
        return None
    if len(node.inputs) > 1 and node.inputs[1] is not None:
        array = const_array(node.inputs[1])
        if array is None:
            return None
        axes = [int(a) for a in array.reshape(-1)]
    else:
        axes = list(node.attributes.get_ints("axes", []) or [])
    if not axes:
        return None
    return tuple(sorted(a + rank if a < 0 else a for a in axes))


@dataclasses.dataclass(frozen=True)
class _Match:
    """One matched decomposition: its input, nodes (graph order), axis, epsilon and affine constants."""

    x: ir.Value
    nodes: list[ir.Node]
    axis: int
    eps: float
    gamma: np.ndarray | None
    beta: np.ndarray | None


def match_layernorm(mean: ir.Node) -> _Match | None:
    """The layer normalisation whose first ReduceMean is ``mean`` (rules 1, 2), or None."""
    if mean.op_type != "ReduceMean" or mean.domain != "" or not mean.inputs or mean.inputs[0] is None:
        return None
    x = mean.inputs[0]
    if x.shape is None:
        return None
    rank = len(x.shape)
    axes = _reduce_axes(mean, rank)
    if axes is None or axes != tuple(range(rank - len(axes), rank)):
        return None
    sub = _sole_reader(mean.outputs[0], ("Sub",))
    if sub is None or sub.inputs[0] is not x or sub.inputs[1] is not mean.outputs[0]:
        return None
    d = sub.outputs[0]
    readers = list(dict.fromkeys(u.node for u in d.uses()))  # Mul(d, d) reads d twice
    if d.is_graph_output() or len(readers) != 2:
        return None
    square = next((n for n in readers if n.op_type in ("Pow", "Mul") and n.domain == ""), None)
    div = next((n for n in readers if n.op_type == "Div" and n.domain == "" and n is not square), None)
    if square is None or div is None or div.inputs[0] is not d:
        return None
    if square.op_type == "Pow" and not (square.inputs[0] is d and scalar_const(square.inputs[1]) == 2.0):
        return None
    if square.op_type == "Mul" and not (square.inputs[0] is d and square.inputs[1] is d):
        return None
    var = _sole_reader(square.outputs[0], ("ReduceMean",))
    if var is None or _reduce_axes(var, rank) != axes:
        return None
    add_eps = _sole_reader(var.outputs[0], ("Add",))
    if add_eps is None:
        return None
    eps = scalar_const(_other(add_eps, var.outputs[0]))
    if eps is None or eps < 0:
        return None
    sqrt = _sole_reader(add_eps.outputs[0], ("Sqrt",))
    if sqrt is None or _sole_reader(sqrt.outputs[0], ("Div",)) is not div:
        return None
    if div.inputs[1] is not sqrt.outputs[0]:
        return None
    nodes = [mean, sub, square, var, add_eps, sqrt, div]
    gamma = beta = None
    tail = div.outputs[0]
    mul = _sole_reader(tail, ("Mul",))
    if mul is not None and (g := const_array(_other(mul, tail))) is not None:
        gamma, tail = g, mul.outputs[0]
        nodes.append(mul)
    add = _sole_reader(tail, ("Add",))
    if add is not None and (b := const_array(_other(add, tail))) is not None:
        beta = b
        nodes.append(add)
    return _Match(x, nodes, rank - len(axes), eps, gamma, beta)


def _normalised(
    array: np.ndarray | None, shape: tuple[int, ...], fill: float, dtype: np.dtype
) -> np.ndarray | None:
    if array is None:
        return np.full(shape, fill, dtype=dtype)
    if array.ndim > len(shape) and any(d != 1 for d in array.shape[: array.ndim - len(shape)]):
        return None  # it would broadcast over the leading (not normalised) dims
    array = array.reshape(array.shape[array.ndim - len(shape):]) if array.ndim > len(shape) else array
    try:
        return np.broadcast_to(array, shape).astype(dtype)
    except ValueError:
        return None


def _rewrite(graph: ir.Graph, m: _Match, taken: set[str]) -> bool:
    x_shape = m.x.shape
    assert x_shape is not None
    norm_dims = list(x_shape)[m.axis:]
    if not all(isinstance(d, int) for d in norm_dims):
        return False
    dtype = m.x.dtype.numpy() if m.x.dtype is not None else np.dtype(np.float32)
    shape = tuple(int(d) for d in norm_dims)
    gamma = _normalised(m.gamma, shape, 1.0, dtype)
    beta = _normalised(m.beta, shape, 0.0, dtype)
    if gamma is None or beta is None:
        return False
    last = m.nodes[-1]
    base = last.name or "layernorm"
    inits = []
    for suffix, array in (("scale", gamma), ("bias", beta)):
        name, n = f"{base}.ln_{suffix}", 0
        while name in taken or name in graph.initializers:
            n += 1
            name = f"{base}.ln_{suffix}_{n}"
        taken.add(name)
        tensor = ir.tensor(array, name=name)
        value = ir.Value(
            name=name, shape=ir.Shape(array.shape), type=ir.TensorType(tensor.dtype), const_value=tensor
        )
        graph.register_initializer(value)
        inits.append(value)
    node = ir.Node(
        "", "LayerNormalization", [m.x, *inits],
        [ir.Attr("axis", ir.AttributeType.INT, m.axis), ir.Attr("epsilon", ir.AttributeType.FLOAT, m.eps)],
        name=f"{base}.layernorm",
    )
    old = last.outputs[0]
    new = node.outputs[0]
    new.type, new.shape = old.type, old.shape
    name, was_output = old.name, old.is_graph_output()
    new.name = f"{name}.layernorm"
    taken.add(new.name)
    graph.insert_after(last, node)
    ir.convenience.replace_all_uses_with(old, new, replace_graph_outputs=True)
    graph.remove(m.nodes, safe=True)
    if was_output:
        new.name = name
    return True


@register("recognize_layernorm")
class RecognizeLayerNorm(ir.passes.InPlacePass):
    """Replace a decomposed layer normalisation by ``LayerNormalization`` (opset >= 17)."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        opset = model.opset_imports.get("", model.opset_imports.get("ai.onnx", 1))
        if opset < LAYERNORM_MIN_OPSET:
            return ir.passes.PassResult(model, modified=False)
        return ir.passes.PassResult(model, modified=bool(rewrite_layernorms(graph)))


def rewrite_layernorms(graph: ir.Graph) -> int:
    """Rules 1-2 on every top-level node of ``graph``, each match rewritten as rule 3 says
    (without rule 3's opset check: the caller's); returns how many were rewritten."""
    taken = {v.name for v in graph.inputs if v.name} | set(graph.initializers)
    for node in graph:
        taken.update(o.name for o in node.outputs if o.name)
    changed = 0
    for node in list(graph):
        if node.graph is not graph:
            continue
        found = match_layernorm(node)
        if found is not None and _rewrite(graph, found, taken):
            changed += 1
    return changed
