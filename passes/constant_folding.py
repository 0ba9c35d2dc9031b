"""Constant folding: evaluate nodes whose inputs are all known and store the results as initializers.

Rules:

0. Initializers that are also listed as graph inputs (IR version < 4, e.g. onnx's "light"
   models) are treated as constants: they are taken out of the graph inputs (onnx-ir's
   ``RemoveInitializersFromInputsPass``) and the model's IR version is raised to at least 4,
   where an initializer need not be an input. Folding them would otherwise turn an optional
   input into a required one.
1. A node of the main graph is *foldable* when it is in the default ONNX domain, has no
   subgraph attribute, is not random (``Random*``, ``Multinomial``, ``Bernoulli``, ``Dropout``),
   and every present input is a constant: an initializer or the output of a node already
   folded in this sweep. ``Constant`` nodes (no inputs) are foldable, so they become
   initializers too. Nodes in ``partitioner.comm`` are never folded (they have side effects).
2. ``Shape`` and ``Size`` of a value whose shape is fully static are foldable whatever that value
   is: this is what folds ``Shape -> Gather -> Unsqueeze -> Concat -> Reshape`` shape
   arithmetic down to a constant shape input of ``Reshape``.
3. Size guard: a node is folded only if the element count of each of its outputs is known
   before evaluation and at most ``size_limit`` (default ``2**28``). The count comes from the
   IR's static output shape or, failing that, from ONNX shape inference with data propagation
   on the node alone; when neither knows it, the node is not folded. So a ``ConstantOfShape``
   of 1e9 elements is never materialised.
4. The node is evaluated with ``onnx.reference.ReferenceEvaluator`` at the model's opset. If
   evaluation fails, or returns something that is not a tensor of the dtype the IR expects,
   the node is left alone.
3b. Lazy weights stay lazy: a node reading an external (memory-mapped, not yet read) initializer
   of more than ``_LAZY_BYTES`` is not folded, so loading, ``inspect`` and ``plan`` of a model
   larger than memory read no weight bytes (issue 14; the build folds such nodes if it wants).
5. Each used output becomes an initializer named like the output it replaces (stable and
   readable: a folded ``ConstantOfShape`` producing ``conv1_w_0`` becomes initializer
   ``conv1_w_0``); the node is removed. A node whose output is a graph output is evaluated (so
   its consumers fold) but kept, so the graph's outputs stay node outputs.

Invariant: every value the graph computes is unchanged; the graph's outputs keep their names.
Unused constants left behind are for dead-code elimination to remove.
"""

from __future__ import annotations

import logging
import math

import numpy as np
import onnx
import onnx_ir as ir
from onnx.reference import ReferenceEvaluator
from onnx_ir.passes.common import RemoveInitializersFromInputsPass

from partitioner.core.op_classes import RANDOM
from passes.registry import register

logger = logging.getLogger(__name__)

DEFAULT_SIZE_LIMIT = 2**28
_RANDOM_OPS = RANDOM | {"Dropout"}  # a training-mode Dropout draws a mask
_SHAPE_OPS = frozenset({"Shape", "Size"})
# Constant inputs up to this many elements travel with the single-node shape inference of
# rule 3 (data propagation needs the values of shape-like inputs).
_INFERENCE_VALUE_LIMIT = 4096


def _elements(shape: ir.Shape | tuple[int, ...] | None) -> int | None:
    if shape is None:
        return None
    if isinstance(shape, ir.Shape):
        if not shape.is_static():
            return None
        dims = [int(d) for d in shape]  # type: ignore[arg-type]
    else:
        dims = list(shape)
    return math.prod(dims)


def _has_subgraph(node: ir.Node) -> bool:
    return any(
        isinstance(a, ir.Attr) and a.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS)
        for a in node.attributes.values()
    )


def _fold_shape_op(node: ir.Node) -> np.ndarray | None:
    """Rule 2: ``Shape``/``Size`` of a statically shaped value."""
    data = node.inputs[0] if node.inputs else None
    if data is None or data.shape is None or not data.shape.is_static():
        return None
    dims = [int(d) for d in data.shape]  # type: ignore[arg-type]
    if node.op_type == "Size":
        return np.array(math.prod(dims), dtype=np.int64)
    rank = len(dims)
    start = node.attributes.get_int("start", 0)
    end = node.attributes.get_int("end", rank)
    start = min(max(start + rank if start < 0 else start, 0), rank)
    end = min(max(end + rank if end < 0 else end, 0), rank)
    return np.array(dims[start:end], dtype=np.int64)


_LAZY_BYTES = 1 << 20


def _is_big_lazy(value: ir.Value) -> bool:
    """Rule 3b: an initializer still on disk (``ir.ExternalTensor``) of more than ``_LAZY_BYTES``."""
    tensor = value.const_value
    return isinstance(tensor, ir.ExternalTensor) and tensor.nbytes > _LAZY_BYTES


class _Folder:
    """One sweep over a model's main graph (rules 1 to 5)."""

    def __init__(self, model: ir.Model, size_limit: int) -> None:
        self.model = model
        self.graph = model.graph
        self.size_limit = size_limit
        opsets = model.opset_imports
        self.opset = opsets.get("", opsets.get("ai.onnx", 1))
        # value -> numpy content of outputs folded in this sweep; initializers are read lazily
        # (a large model's weights are not all turned into arrays just to be looked at)
        self.folded: dict[ir.Value, np.ndarray] = {}

    def _is_const(self, value: ir.Value) -> bool:
        if value in self.folded:
            return True
        return value.is_initializer() and value.const_value is not None and not value.is_graph_input()

    def _array(self, value: ir.Value) -> np.ndarray:
        if value in self.folded:
            return self.folded[value]
        assert value.const_value is not None
        return value.const_value.numpy()

    def run(self) -> int:
        folded = 0
        for node in list(self.graph):
            results = self._try_fold(node)
            if results is None:
                continue
            if self._replace(node, results):
                folded += 1
        return folded

    # -- rule 1 and 2: is it foldable? ------------------------------------------------------
    def _try_fold(self, node: ir.Node) -> list[np.ndarray] | None:
        if node.domain not in ("", "ai.onnx") or node.op_type in _RANDOM_OPS or _has_subgraph(node):
            return None
        if not node.outputs:
            return None
        inputs = [v for v in node.inputs if v is not None]
        if node.op_type in _SHAPE_OPS and not all(self._is_const(v) for v in inputs):
            result = _fold_shape_op(node)
            return None if result is None else [result]
        if not all(self._is_const(v) for v in inputs):
            return None
        if any(_is_big_lazy(v) for v in inputs):
            logger.debug("not folding %s: it reads a large external weight (kept lazy)", node.name)
            return None
        if not self._within_size_limit(node):
            return None
        return self._evaluate(node)

    # -- rule 3: size guard ----------------------------------------------------------------
    def _within_size_limit(self, node: ir.Node) -> bool:
        counts = [_elements(out.shape) for out in node.outputs if out.name]
        if any(c is None for c in counts):
            counts = self._infer_output_elements(node)
        if counts is None or any(c is None for c in counts):
            logger.debug("not folding %s: output size unknown", node.name)
            return False
        too_big = [c for c in counts if c is not None and c > self.size_limit]
        if too_big:
            logger.info(
                "not folding node '%s' (%s): output has %d elements, over the size limit %d",
                node.name, node.op_type, too_big[0], self.size_limit,
            )
            return False
        return True

    def _infer_output_elements(self, node: ir.Node) -> list[int | None] | None:
        node_proto = ir.serde.serialize_node(node)
        inputs, initializers, seen = [], [], set()
        for value in node.inputs:
            if value is None or value.name in seen:
                continue
            seen.add(value.name)
            array = self._array(value)
            if array.size <= _INFERENCE_VALUE_LIMIT:
                initializers.append(onnx.numpy_helper.from_array(array, name=value.name))
            else:
                elem = onnx.helper.np_dtype_to_tensor_dtype(array.dtype)
                inputs.append(onnx.helper.make_tensor_value_info(value.name, elem, list(array.shape)))
        outputs = [onnx.helper.make_empty_tensor_value_info(o.name) for o in node.outputs if o.name]
        graph = onnx.helper.make_graph([node_proto], "fold", inputs, outputs, initializer=initializers)
        probe = onnx.helper.make_model(
            graph, opset_imports=[onnx.helper.make_opsetid("", self.opset)], ir_version=self.model.ir_version
        )
        try:
            inferred = onnx.shape_inference.infer_shapes(probe, strict_mode=True, data_prop=True)
        except Exception:  # the node cannot be sized, so it is not folded
            return None
        counts: list[int | None] = []
        for out in inferred.graph.output:
            tensor_type = out.type.tensor_type
            if not tensor_type.HasField("shape"):
                counts.append(None)
                continue
            dims = [d.dim_value if d.HasField("dim_value") else None for d in tensor_type.shape.dim]
            counts.append(None if any(d is None for d in dims) else math.prod(dims))  # type: ignore[misc]
        return counts

    # -- rule 4: evaluate ------------------------------------------------------------------
    def _evaluate(self, node: ir.Node) -> list[np.ndarray] | None:
        feeds = {v.name: self._array(v) for v in node.inputs if v is not None}
        try:
            # A GraphProto, not the bare NodeProto: the evaluator ignores `opsets` for a node and
            # would run the newest version of the op (Unsqueeze-13 for an opset-9 model).
            graph = onnx.helper.make_graph(
                [ir.serde.serialize_node(node)],
                "fold",
                [
                    onnx.helper.make_tensor_value_info(
                        name, onnx.helper.np_dtype_to_tensor_dtype(array.dtype), list(array.shape)
                    )
                    for name, array in feeds.items()
                ],
                [onnx.helper.make_empty_tensor_value_info(o.name) for o in node.outputs if o.name],
            )
            evaluator = ReferenceEvaluator(graph, opsets={"": self.opset})
            results = evaluator.run(None, feeds)
        except Exception as e:  # an op the reference cannot run is simply not folded
            logger.debug("not folding node '%s' (%s): %s", node.name, node.op_type, e)
            return None
        arrays = []
        for out, result in zip(node.outputs, results):
            if not isinstance(result, (np.ndarray, np.generic)):
                return None
            array = np.asarray(result)
            if array.size > self.size_limit:
                return None
            if out.dtype is not None:
                try:
                    if ir.DataType.from_numpy(array.dtype) != out.dtype:
                        return None
                except TypeError:
                    return None
            arrays.append(array)
        return arrays if len(arrays) == len(node.outputs) else None

    # -- rule 5: replace -------------------------------------------------------------------
    def _replace(self, node: ir.Node, results: list[np.ndarray]) -> bool:
        for out, array in zip(node.outputs, results):
            self.folded[out] = array
        if any(out.is_graph_output() for out in node.outputs):
            return False
        for out, array in zip(node.outputs, results):
            if not out.uses():
                continue
            name = out.name
            assert name  # a used output always has a name
            out.name = f"{name}__folded"  # free the name for the initializer
            tensor = ir.tensor(array, name=name)
            init = ir.Value(
                name=name,
                shape=ir.Shape(array.shape),
                type=ir.TensorType(tensor.dtype),
                const_value=tensor,
            )
            ir.convenience.replace_all_uses_with(out, init)
            self.graph.register_initializer(init)
        self.graph.remove(node, safe=True)
        return True


@register("constant_folding")
class ConstantFolding(ir.passes.InPlacePass):
    """Fold constant subgraphs (and static ``Shape``/``Size``) into initializers, under a size limit."""

    def __init__(self, size_limit: int = DEFAULT_SIZE_LIMIT) -> None:
        super().__init__()
        self.size_limit = size_limit

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        modified = False
        if any(init.is_graph_input() for init in model.graph.initializers.values()):
            modified = RemoveInitializersFromInputsPass()(model).modified
            model.ir_version = max(model.ir_version, 4)
        folded = _Folder(model, self.size_limit).run()
        if folded:
            logger.info("constant_folding: folded %d nodes", folded)
        return ir.passes.PassResult(model, modified or bool(folded))
