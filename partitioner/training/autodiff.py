"""Reverse-mode autodiff on onnx-ir: gradient rules registered per op type.

A rule is ``rule(g: GradContext) -> list[ir.Value | None]``: given the forward node and the
gradients of its outputs (``g.dy``), it emits standard ONNX nodes through ``g`` and returns one
gradient per input (``None`` where the input needs none). Rules are written the way
``torch.autograd`` formulas or onnxruntime's gradient builders are: a few lines each.

Rules of the pass:

1. Only values that depend on a trainable input *and* reach the loss get a gradient; a node is
   differentiated when one of its float inputs requires a gradient.
2. Every op that must be differentiated and has no rule is listed at once, in one error, before
   any node is emitted (:class:`MissingGradientError`, exit 2).
3. Contributions to one value are summed in the order they are produced (deterministic).
4. Every emitted node carries ``metadata_props["training.forward_node"]`` naming the forward
   node it differentiates (``"loss"`` / ``"optimizer"`` for the others), so a pipeline stage can
   keep an op's backward on the rank that ran its forward and the cost model can charge it.
5. Shapes are static: the builder runs on a model whose shapes ONNX inference fixed, so rules
   may read ``g.shape(value)`` and fold shape arithmetic into constants.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
import onnx_ir as ir

from partitioner.core.errors import UnsupportedOpError

FORWARD_NODE_KEY = "training.forward_node"

Rule = Callable[["GradContext"], Sequence["ir.Value | None"]]
GRADIENTS: dict[str, Rule] = {}


class MissingGradientError(UnsupportedOpError):
    """Ops that must be differentiated have no gradient rule; the message lists all of them."""


def register_gradient(*op_types: str) -> Callable[[Rule], Rule]:
    """Register ``rule`` as the gradient of each op type in ``op_types`` (default domain)."""

    def deco(fn: Rule) -> Rule:
        for op in op_types:
            GRADIENTS[op] = fn
        return fn

    return deco


def rule_key(node: ir.Node) -> str:
    """``op_type`` for the default domain, ``domain.op_type`` otherwise (the comm ops' rules)."""
    return node.op_type if node.domain in ("", "ai.onnx") else f"{node.domain}.{node.op_type}"


class Emitter:
    """Appends nodes and constant initializers to a graph, tagging each with its forward node."""

    def __init__(self, graph: ir.Graph, dtype: ir.DataType) -> None:
        self.graph = graph
        self.dtype = dtype
        self.np_dtype = dtype.numpy()
        self.tag = "loss"
        self._count = 0

    def _name(self, hint: str) -> str:
        self._count += 1
        return f"{hint}.{self._count}"

    def op(self, op_type: str, *inputs: ir.Value | None, _outputs: int = 1, _name: str | None = None,
           **attrs: Any) -> Any:
        """Emit ``op_type(inputs, **attrs)``; returns its output (a tuple when ``_outputs > 1``)."""
        attributes = ir.convenience.convert_attributes({k: v for k, v in attrs.items() if v is not None})
        node = ir.Node("", op_type, list(inputs), attributes=attributes, num_outputs=_outputs,
                       name=self._name(f"grad.{self.tag}.{op_type}"),
                       metadata_props={FORWARD_NODE_KEY: self.tag})
        for i, out in enumerate(node.outputs):
            out.name = _name if (_name and _outputs == 1) else self._name(f"{node.name}.out{i}")
        self.graph.append(node)
        return node.outputs[0] if _outputs == 1 else tuple(node.outputs)

    def const(self, value: Any, dtype: Any = None, name: str = "const") -> ir.Value:
        """A constant initializer (float values take the graph's float type unless ``dtype``)."""
        arr = np.asarray(value)
        if dtype is not None:
            arr = arr.astype(dtype)
        elif arr.dtype.kind == "f":
            arr = arr.astype(self.np_dtype)
        tensor = ir.tensor(arr, name=self._name(f"grad.{self.tag}.{name}"))
        v = ir.Value(name=tensor.name, shape=ir.Shape(arr.shape), type=ir.TensorType(tensor.dtype),
                     const_value=tensor)
        self.graph.register_initializer(v)
        return v

    def ints(self, values: Iterable[int]) -> ir.Value:
        return self.const(np.asarray(list(values), dtype=np.int64), name="ints")

    def scalar(self, x: float) -> ir.Value:
        return self.const(np.asarray(x, dtype=self.np_dtype), name="scalar")


def shape_of(v: ir.Value) -> tuple[int, ...]:
    """The static shape of ``v`` (rule 5); a symbolic dim is a bug of the caller."""
    if v.shape is None or not all(isinstance(d, int) for d in v.shape):
        raise UnsupportedOpError(f"value {v.name!r}: the training builder needs static shapes, got {v.shape}; "
                                 "bind the batch with --batch")
    return tuple(int(d) for d in v.shape)


class GradContext:
    """What a rule sees: the forward node, its output gradients and an emitter."""

    def __init__(self, node: ir.Node, dy: list[ir.Value | None], needs: list[bool], em: Emitter) -> None:
        self.node = node
        self.dy = dy
        self.needs = needs
        self.em = em
        self.op = em.op
        self.const = em.const
        self.ints = em.ints
        self.scalar = em.scalar

    @property
    def x(self) -> list[ir.Value | None]:
        return list(self.node.inputs)

    @property
    def y(self) -> list[ir.Value]:
        return list(self.node.outputs)

    def attr(self, name: str, default: Any = None) -> Any:
        a = self.node.attributes.get(name)
        if a is None:
            return default
        v = a.value
        return list(v) if isinstance(v, (list, tuple)) else v

    def shape(self, v: ir.Value) -> tuple[int, ...]:
        return shape_of(v)

    def const_input(self, i: int) -> np.ndarray | None:
        """The value of input ``i`` when it is a constant (initializer or Constant node)."""
        if i >= len(self.node.inputs) or self.node.inputs[i] is None:
            return None
        return constant_value(self.node.inputs[i])

    def dy_or_zeros(self, i: int) -> ir.Value:
        if self.dy[i] is not None:
            return self.dy[i]
        return self.const(np.zeros(self.shape(self.node.outputs[i]), dtype=self.em.np_dtype), name="zeros")

    def reduce_to(self, grad: ir.Value, grad_shape: Sequence[int], target: Sequence[int]) -> ir.Value:
        """Sum ``grad`` over the axes numpy broadcasting expanded to reach ``target``."""
        grad_shape, target = tuple(grad_shape), tuple(target)
        if grad_shape == target:
            return grad
        lead = len(grad_shape) - len(target)
        padded = (1,) * lead + target
        axes = [i for i, (gd, td) in enumerate(zip(grad_shape, padded)) if i < lead or (td == 1 and gd != 1)]
        out = self.op("ReduceSum", grad, self.ints(axes), keepdims=1) if axes else grad
        return self.op("Reshape", out, self.ints(target))


def constant_value(v: ir.Value) -> np.ndarray | None:
    if v.const_value is not None:
        return v.const_value.numpy()
    prod = v.producer()
    if prod is not None and prod.op_type == "Constant" and "value" in prod.attributes:
        return prod.attributes["value"].value.numpy()
    return None


def is_float(v: ir.Value | None) -> bool:
    return v is not None and v.dtype is not None and v.dtype.is_floating_point()


def _may_be_float(v: ir.Value | None) -> bool:
    """Float, or emitted by a forward rewrite (BN) before types were inferred."""
    return v is not None and (v.dtype is None or v.dtype.is_floating_point())


def differentiable_nodes(graph: ir.Graph, sources: set[str], targets: set[str]) -> tuple[list[ir.Node], set[str]]:
    """Nodes on a path from ``sources`` to ``targets`` (the values whose gradient is seeded) in
    topological order, and the value names that require a gradient (rule 1)."""
    requires: set[str] = set(sources)
    for node in graph:
        if any(v is not None and v.name in requires for v in node.inputs):
            requires.update(o.name for o in node.outputs if _may_be_float(o))
    reaches: set[str] = set(targets)
    nodes: list[ir.Node] = []
    for node in reversed(list(graph)):
        if any(o.name in reaches for o in node.outputs) and any(o.name in requires for o in node.outputs):
            nodes.append(node)
            reaches.update(v.name for v in node.inputs if v is not None)
    nodes.reverse()
    return nodes, requires & reaches


def check_rules(nodes: Sequence[ir.Node]) -> None:
    """Rule 2: one error listing every op without a gradient rule."""
    from partitioner.training import rules  # noqa: F401  (registers the rules)

    missing: dict[str, list[str]] = {}
    for n in nodes:
        if rule_key(n) not in GRADIENTS:
            missing.setdefault(n.op_type if not n.domain else f"{n.domain}.{n.op_type}", []).append(n.name or "?")
    if missing:
        listed = "; ".join(f"{op} ({', '.join(names[:3])}{', ...' if len(names) > 3 else ''})"
                           for op, names in sorted(missing.items()))
        raise MissingGradientError(f"no gradient rule for {len(missing)} op type(s): {listed}",
                                   ops=[(op, names[0]) for op, names in sorted(missing.items())])


def backward(graph: ir.Graph, loss: ir.Value, dloss: dict[str, ir.Value], sources: Sequence[ir.Value],
             em: Emitter) -> dict[str, ir.Value]:
    """Emit the backward pass of ``graph`` into it.

    ``dloss`` maps forward value names to their gradient seeds (the loss builder gives the
    gradient of the loss w.r.t. the model output directly). Returns ``{source name: gradient}``;
    a source the loss does not depend on gets a zero gradient.
    """
    from partitioner.training import rules  # noqa: F401  (registers the rules)

    names = {s.name for s in sources}
    nodes, requires = differentiable_nodes(graph, names, set(dloss))
    nodes = [n for n in nodes if any(o.name in requires for o in n.outputs)]
    check_rules(nodes)
    grads: dict[str, list[ir.Value]] = {k: [v] for k, v in dloss.items()}

    def total(v: ir.Value) -> ir.Value | None:
        parts = grads.get(v.name)
        if not parts:
            return None
        if len(parts) > 1:
            acc = parts[0]
            for p in parts[1:]:
                acc = em.op("Add", acc, p)
            grads[v.name] = [acc]
        return grads[v.name][0]

    for node in reversed(nodes):
        dy = [total(o) for o in node.outputs]
        if all(d is None for d in dy):
            continue
        needs = [v is not None and v.name in requires and _may_be_float(v) for v in node.inputs]
        if not any(needs):
            continue
        em.tag = node.name or node.op_type
        ctx = GradContext(node, dy, needs, em)
        dx = list(GRADIENTS[rule_key(node)](ctx))
        for v, need, d in zip(node.inputs, needs, dx):
            if need and d is not None:
                grads.setdefault(v.name, []).append(d)
    em.tag = "loss"
    out: dict[str, ir.Value] = {}
    for s in sources:
        g = total(s)
        out[s.name] = g if g is not None else em.const(np.zeros(shape_of(s), dtype=em.np_dtype), name="zero_grad")
    return out
