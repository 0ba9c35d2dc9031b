"""A read-only, name-keyed view of an ``onnx_ir`` model that strategies and lowering share.

Invariants: nodes are in the graph's (topological) order and have unique, non-empty names
(:func:`ensure_node_names` gives unnamed or duplicate nodes ``<op_type>_<index>`` names, in
place); every value the partitioner touches has a static shape, else :class:`PlanError` names it.
"""

from __future__ import annotations

from functools import cached_property

import numpy as np
import onnx_ir as ir

from partitioner.core.errors import PlanError, UnsupportedOpError


def ensure_node_names(model: ir.Model) -> None:
    """Give every node of the main graph a unique, non-empty name (in place)."""
    seen: set[str] = set()
    for i, node in enumerate(model.graph):
        if not node.name or node.name in seen:
            base = f"{node.op_type}_{i}"
            name, k = base, 1
            while name in seen:
                name, k = f"{base}_{k}", k + 1
            node.name = name
        seen.add(node.name)


class ModelView:
    """Shapes, dtypes, constants, producers and consumers of one model, keyed by name."""

    def __init__(self, model: ir.Model) -> None:
        ensure_node_names(model)
        self.model = model
        self.graph = model.graph
        self.nodes: list[ir.Node] = list(model.graph)
        self.node_by_name = {n.name: n for n in self.nodes}
        self.index = {n.name: i for i, n in enumerate(self.nodes)}
        self.values: dict[str, ir.Value] = {}
        for v in self.graph.inputs:
            self.values[v.name] = v
        for name, v in self.graph.initializers.items():
            self.values[name] = v
        for n in self.nodes:
            for v in n.inputs:
                if v is not None:
                    self.values.setdefault(v.name, v)
            for v in n.outputs:
                if v.name:  # an omitted optional output ("") is no value: nothing to place or send
                    self.values[v.name] = v
        for v in [*self.graph.inputs, *self.graph.outputs]:
            if v.type is not None and not isinstance(v.type, ir.TensorType):
                raise UnsupportedOpError(f"graph {'input' if v.is_graph_input() else 'output'} {v.name!r} is "
                                         f"{type(v.type).__name__.replace('Type', '').lower()}-typed; the partitioner "
                                         "and its artifacts take and return tensors only; run this model with ONNX Runtime")
        self.initializers = {name: v for name, v in self.graph.initializers.items() if v.const_value is not None}
        self.inputs = [v.name for v in self.graph.inputs if v.name not in self.initializers]
        self.outputs = [v.name for v in self.graph.outputs]
        self._shapes: dict[str, tuple[int, ...]] = {}
        self._nbytes: dict[str, int] = {}
        self.producer: dict[str, str] = {}
        self.consumers: dict[str, list[str]] = {}
        for n in self.nodes:
            for v in n.outputs:
                self.producer[v.name] = n.name
            for v in n.inputs:
                if v is not None:
                    self.consumers.setdefault(v.name, []).append(n.name)

    # ---- values -------------------------------------------------------------------------------
    def shape(self, name: str) -> tuple[int, ...]:
        cached = self._shapes.get(name)
        if cached is not None:
            return cached
        self._shapes[name] = out = self._shape(name)
        return out

    def _shape(self, name: str) -> tuple[int, ...]:
        if not name:  # an omitted optional output or input: no value, no element to place or send
            return (0,)
        v = self.values.get(name)
        if v is None:
            raise PlanError(f"model has no value {name!r}")
        if v.const_value is not None:
            return tuple(int(d) for d in v.const_value.shape)
        if v.type is not None and not isinstance(v.type, ir.TensorType):
            raise self._refusal(name, f"is a {type(v.type).__name__.replace('Type', '').lower()} value, not a "
                                "tensor; the partitioner places, sends and binds tensors only")
        if v.shape is None or not all(isinstance(d, int) for d in v.shape):
            if self._made_from_static(name):
                raise self._refusal(name, "gets a shape that depends on input values (its inputs have static "
                                    "shapes); the project compiles static shapes only")
            raise PlanError(f"value {name!r} has no static shape ({v.shape}); bind the batch (--batch) "
                            "and run shape inference before partitioning")
        return tuple(int(d) for d in v.shape)

    def _made_from_static(self, name: str) -> bool:
        """Whether ``name`` is made by a node whose tensor inputs all have static shapes."""
        node = self.node_by_name.get(self.producer.get(name, ""))
        if node is None:
            return False
        for v in node.inputs:
            if v is None or v.const_value is not None:
                continue
            if not isinstance(v.type, ir.TensorType) or v.shape is None or not v.shape.is_static():
                return False
        return True

    def _refusal(self, name: str, why: str) -> UnsupportedOpError:
        """Rule: a value the planner cannot place because of what the model asks for (a sequence or
        optional value, a data-dependent shape) is a refusal naming the op that makes it, not a
        plan failure: nothing went wrong, the project does not do it."""
        node = self.node_by_name.get(self.producer.get(name, ""))
        made_by = f" (made by {node.name} ({node.op_type}))" if node is not None else " (a graph input)"
        return UnsupportedOpError(f"value {name!r}{made_by} {why}; run this model with ONNX Runtime")

    def rank(self, name: str) -> int:
        return len(self.shape(name))

    def elem_type(self, name: str) -> int:
        v = self.values[name]
        if v.const_value is not None:
            return int(v.const_value.dtype)
        if v.dtype is None:
            raise PlanError(f"value {name!r} has no dtype; run shape inference before partitioning")
        return int(v.dtype)

    def np_dtype(self, name: str) -> np.dtype:
        return np.dtype(ir.DataType(self.elem_type(name)).numpy())

    def nbytes(self, name: str) -> int:
        if not name:
            return 0
        cached = self._nbytes.get(name)
        if cached is None:
            cached = self._nbytes[name] = int(np.prod(self.shape(name), dtype=np.int64)) * self.np_dtype(name).itemsize
        return cached

    def is_const(self, name: str) -> bool:
        return name in self.initializers

    def const(self, name: str) -> np.ndarray | None:
        """The value of an initializer or of a Constant node's output, else None."""
        v = self.initializers.get(name)
        if v is not None:
            return v.const_value.numpy()
        p = self.producer.get(name)
        if p is not None:
            node = self.node_by_name[p]
            if node.op_type == "Constant" and "value" in node.attributes:
                return node.attributes["value"].value.numpy()
        return None

    @cached_property
    def constant_nodes(self) -> set[str]:
        """Nodes whose inputs all come from initializers or other constant nodes (no graph input)."""
        const_values = set(self.initializers)
        out: set[str] = set()
        for n in self.nodes:
            if all(v is None or v.name in const_values for v in n.inputs) and not _has_subgraph(n):
                out.add(n.name)
                const_values.update(v.name for v in n.outputs)
        return out

    def param_bytes(self) -> int:
        return sum(self.nbytes(n) for n in self.initializers)

    def batch_dims(self) -> list[int]:
        """The leading (batch) dimension of every graph input of rank >= 1: the one place that
        says which inputs are batched. A step processes :meth:`batch_size` samples; a strategy
        can split the batch at most ``min(batch_dims())`` ways."""
        return [self.shape(n)[0] for n in self.inputs if self.rank(n) >= 1]

    def batch_size(self) -> int:
        """Samples one step processes (throughput counts these): the largest batch dimension, 1
        without a batched input."""
        return max(self.batch_dims(), default=1)

    def node_inputs(self, node: ir.Node) -> list[str]:
        return [v.name if v is not None else "" for v in node.inputs]

    def node_outputs(self, node: ir.Node) -> list[str]:
        return [v.name for v in node.outputs]


def _has_subgraph(node: ir.Node) -> bool:
    return any(a.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS) for a in node.attributes.values())


def attr(node: ir.Node, name: str, default=None):
    a = node.attributes.get(name)
    return default if a is None else a.value
