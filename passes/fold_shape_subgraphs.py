"""Fold shape subgraphs to constants, repeating shape inference to a fixed point (as onnxsim does).

Why: exporters compute reshape targets, resize sizes and slice bounds at run time
(``Shape -> Gather/Slice -> Concat/Unsqueeze/Cast/Mul/Div -> Reshape``). Once every input is
bound, all of that is static, but one round of inference and folding is not enough: ONNX's data
propagation stops at ops it does not propagate (``Div``, ``Floor``, ``Range``...), so a value's
shape becomes known only after the subgraph before it folded, and the next ``Shape`` of it
folds only after inference ran again.

Rules:

1. One round is: ONNX shape inference with data propagation (``passes/shape_inference.py``:
   ``infer_shapes(..., data_prop=True)``, merged into the IR), constant folding
   (``passes/constant_folding.py``: ``Shape``/``Size`` of a static value, and every node whose
   inputs are constants -- ``Gather``, ``Slice``, ``Concat``, ``Unsqueeze``, ``Squeeze``, ``Cast``
   and integer arithmetic among them), then folding ``If`` nodes whose condition became constant
   (``passes/fold_constant_if.py``), then unrolling ``Loop`` nodes whose trip count constants
   fix (``passes/unroll_loop.py``; a loop that stops on data stays, and rule 3 names it).
2. Rounds repeat until one folds nothing (at most ``max_rounds``).
3. Then every live value of the main graph (one a graph output depends on) must have a static
   shape. If some do not, one :class:`PassError` lists them (up to 8) and, for each, what would
   fix it: a remaining ``If`` is refused by name with the inputs its condition reads (bind them
   with ``--const``), unless both branches give the same static shapes (then it stays and runs as
   an ``If``); a value whose shape depends on input *values* names those inputs (``--const``); a
   value whose shape depends only on input shapes names the inputs to bind with ``--shape``.

Invariant: every value the graph computes is unchanged; only constant subgraphs were replaced.
"""

from __future__ import annotations

import math

import onnx_ir as ir

from partitioner.core.errors import PassError
from passes.constant_folding import ConstantFolding
from passes.fold_constant_if import FoldConstantIf
from passes.unroll_loop import UnrollLoop
from passes.registry import register
from passes.scalar_range_inputs import ScalarRangeInputs
from passes.shape_inference import ShapeInference
from passes.verify import describe_node

# Ops whose output shape depends only on the *shape* of this input, not its values.
_SHAPE_ONLY_INPUTS = {"Shape": (0,), "Size": (0,)}


def _static(value: ir.Value) -> bool:
    if value.type is not None and not isinstance(value.type, ir.TensorType):
        return True
    shape = value.shape if value.shape is not None else (
        value.const_value.shape if value.const_value is not None else None)
    return shape is not None and shape.is_static()


def _live_nodes(graph: ir.Graph) -> list[ir.Node]:
    live: set[ir.Node] = set()
    stack = [o.producer() for o in graph.outputs if o.producer() is not None]
    while stack:
        node = stack.pop()
        if node in live:
            continue
        live.add(node)
        for v in _reads(node):
            p = v.producer()
            if p is not None and p.graph is graph and p not in live:
                stack.append(p)
    return [n for n in graph if n in live]


def _reads(node: ir.Node) -> list[ir.Value]:
    """The node's inputs and the outer values its subgraphs read."""
    values = [v for v in node.inputs if v is not None]
    for attr in node.attributes.values():
        if isinstance(attr, ir.Attr) and attr.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS):
            subs = [attr.as_graph()] if attr.type == ir.AttributeType.GRAPH else list(attr.as_graphs())
            for sub in subs:
                for inner in sub.all_nodes() if hasattr(sub, "all_nodes") else sub:
                    values.extend(v for v in inner.inputs if v is not None and v.graph is not sub)
    return values


def input_dependencies(value: ir.Value, graph: ir.Graph) -> tuple[list[str], list[str]]:
    """Graph inputs ``value`` depends on: (through their values, through their shapes only)."""
    by_value: set[str] = set()
    by_shape: set[str] = set()
    seen: set[tuple[int, bool]] = set()
    inputs = {id(v) for v in graph.inputs}
    stack: list[tuple[ir.Value, bool]] = [(value, True)]
    while stack:
        v, through_value = stack.pop()
        key = (id(v), through_value)
        if key in seen:
            continue
        seen.add(key)
        if id(v) in inputs:
            (by_value if through_value else by_shape).add(v.name or "?")
            continue
        node = v.producer()
        if node is None:
            continue
        shape_only = _SHAPE_ONLY_INPUTS.get(node.op_type, ())
        for i, inp in enumerate(node.inputs):
            if inp is not None:
                stack.append((inp, through_value and i not in shape_only))
        for inp in _reads(node)[len([x for x in node.inputs if x is not None]):]:
            stack.append((inp, through_value))
    return sorted(by_value), sorted(by_shape - by_value)


def _bindable(graph: ir.Graph, name: str) -> bool:
    """An input worth suggesting for ``--const``: an integer or bool one, or one of few elements
    (a sample rate, a flag, a length), not an image or a waveform."""
    for v in graph.inputs:
        if v.name == name:
            small = v.shape is not None and v.shape.is_static() and math.prod(int(d) for d in v.shape) <= 16
            return small or (v.dtype is not None and not v.dtype.is_floating_point())
    return False


def _branch_shapes(node: ir.Node) -> tuple[list, list] | None:
    try:
        then_g = node.attributes["then_branch"].as_graph()
        else_g = node.attributes["else_branch"].as_graph()
    except KeyError:
        return None
    return [o.shape for o in then_g.outputs], [o.shape for o in else_g.outputs]


def _explain(value: ir.Value, graph: ir.Graph) -> str:
    node = value.producer()
    by_value, by_shape = input_dependencies(value, graph)
    where = f"value '{value.name}' ({'output of ' + describe_node(node) if node else 'graph input'}) has shape {value.shape}"
    small = [n for n in by_value if _bindable(graph, n)]
    if by_value and not small:
        return (f"{where}: its size is computed from the data of input(s) {', '.join(by_value)} "
                "(a data-dependent size; not supported)")
    by_value = small
    if by_value:
        return f"{where}: it depends on the value of input(s) {', '.join(by_value)}; bind with " + \
            " ".join(f"--const {n}=VALUE" for n in by_value)
    if by_shape:
        return f"{where}: bind the shape of input(s) {', '.join(by_shape)} with " + \
            " ".join(f"--shape {n}=D0,D1,..." for n in by_shape)
    return f"{where}: it depends on no graph input; the operator's output shape cannot be inferred"


def diagnose(model: ir.Model) -> list[str]:
    """Rule 3: one line per problem; empty when every live value is static."""
    graph = model.graph
    problems: list[str] = []
    for node in _live_nodes(graph):
        outs = [o for o in node.outputs if o.name and (o.uses() or o.is_graph_output())]
        if node.op_type == "If" and node.domain in ("", "ai.onnx"):
            shapes = _branch_shapes(node)
            equal = shapes is not None and all(
                a is not None and b is not None and a.is_static() and b.is_static() and list(a) == list(b)
                for a, b in zip(*shapes))
            if equal:
                for o, s in zip(node.outputs, shapes[0]):
                    if o.shape is None or not o.shape.is_static():
                        o.shape = s
                continue
            by_value, _ = input_dependencies(node.inputs[0], graph) if node.inputs[0] is not None else ([], [])
            then_s, else_s = shapes if shapes else ([], [])
            fix = " ".join(f"--const {n}=VALUE" for n in by_value) or "bind the inputs its condition reads"
            problems.append(
                f"{describe_node(node)}: the condition is not constant and the branches give different or "
                f"non-static shapes (then {[str(s) for s in then_s]}, else {[str(s) for s in else_s]}); "
                f"bind the input its condition reads: {fix}")
            continue
        for o in outs:
            if not _static(o):
                problems.append(_explain(o, graph))
    return problems


@register("fold_shape_subgraphs")
class FoldShapeSubgraphs(ir.passes.InPlacePass):
    """Shape inference + constant folding + constant ``If`` folding to a fixed point (rules 1-3)."""

    def __init__(self, max_rounds: int = 32, *, require_static: bool = True) -> None:
        super().__init__()
        self.max_rounds = max_rounds
        self.require_static = require_static

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        modified = False
        for _ in range(self.max_rounds):
            scalars = ScalarRangeInputs()(model).modified  # before inference: inlined Ifs may leave [1] bounds
            inferred = ShapeInference()(model).modified or scalars
            folded = ConstantFolding()(model).modified
            inlined = FoldConstantIf()(model).modified
            unrolled = UnrollLoop()(model).modified
            modified = modified or inferred or folded or inlined or unrolled
            if not (folded or inlined or unrolled or scalars):
                break
        if self.require_static:
            problems = diagnose(model)
            if problems:
                more = f" (and {len(problems) - 8} more)" if len(problems) > 8 else ""
                raise PassError(f"{len(problems)} value(s) keep a non-static shape after binding and folding: "
                                + "; ".join(problems[:8]) + more)
        return ir.passes.PassResult(model, modified)
