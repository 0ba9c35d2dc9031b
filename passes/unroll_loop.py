"""Unroll a ``Loop`` whose number of iterations is fixed once the inputs are bound.

Why: TVM 0.27's ONNX importer has no ``Loop``, and a loop-carried value has no static shape for
ONNX shape inference, so nothing after it can be planned. Exporters write fixed-length decoders
as a ``Loop`` whose stop condition only counts (Paddle2ONNX: ``M = 1024``, ``cond = i + 1 <
max_len + 1`` with ``max_len`` a constant, SLANet's table decoder); once the counter's start and
limit are constants the trip count is a number and the loop is a straight line.

Rules:

1. Candidates are main-graph ``Loop`` nodes whose trip count ``M`` (when given) and initial
   ``cond`` (when given) are constants.
2. The **control slice** of the body is every body node that the body's condition output needs,
   closed over loop-carried values: when the slice reads carried input ``k``, the nodes computing
   its next value join the slice. The slice may read only constants (initializers, ``Constant``
   nodes, constant values of the main graph), the iteration number and carried inputs whose
   initial value is a constant. Anything else (a value computed from data: an argmax, a stop
   token) makes the count data-dependent and the ``Loop`` stays (``fold_shape_subgraphs`` then
   names it); unrolling to a maximum length with the condition as a mask would not compute the
   same outputs, so it is not done.
3. The slice runs in ONNX's reference evaluator, iteration by iteration, until the condition is
   false or ``M`` iterations ran: that is the trip count ``N``. ``N`` above ``max_steps``
   (default 4096) leaves the ``Loop`` as it is.
4. The body is copied ``N`` times, in order, into the main graph before the ``Loop``: the
   iteration number becomes a constant, the carried inputs read the previous copy's values (the
   ``Loop``'s inputs for the first), names defined in the body (nested subgraphs included) get a
   ``__loop<k>_<i>`` suffix; body initializers move to the main graph once. The ``Loop``'s
   carried outputs become the last copy's values; each scan output is the ``Concat`` of the
   copies' values unsqueezed on axis 0. With ``N = 0`` the carried outputs are the inputs; a
   scan output then has no rows and the ``Loop`` stays.
4b. Loop-invariant body nodes are emitted once, before the copies, not ``N`` times: a node with
   no subgraph attribute, not random (:data:`RANDOM_OPS`), whose inputs are all invariant: names
   from the outer scope, body initializers, carried inputs the body passes through unchanged
   (the body output of carried value ``j`` is its input ``j``, by name: Paddle2ONNX carries
   every decoder weight that way), and outputs of other invariant nodes (``Constant`` nodes
   included). Such a node computes the same value at every step. A passed-through carried input
   reads the ``Loop``'s input directly (no ``Identity`` per step). SLANet's 166-node decoder body
   has 56 such nodes (52 ``Constant``, two weight ``Transpose`` and two ``Squeeze``): 28k nodes
   fewer before constant folding at 501 steps.
5. The rewrite is done on the ``ModelProto`` (a copy of nodes with nested subgraphs is plain
   there) and the model is rebuilt only when a ``Loop`` was unrolled.
6. A scan output of more than :data:`CONCAT_FANIN` rows is concatenated as a two-level tree of
   about ``sqrt(N)`` groups: TVM's ``concatenate`` picks each element's input through a chain of
   selects over all its inputs (a flat ``Concat`` of 128 rows cost ~10x a copy, and an ``N``-deep
   select chain is what TVM's schedule then analyses).

Invariant: for the bound inputs, the graph computes the same outputs under the same names.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np
import onnx
import onnx_ir as ir
from onnx import helper, numpy_helper

from passes.registry import register

MAX_STEPS = 4096


def _subgraphs(node: onnx.NodeProto) -> Iterator[onnx.GraphProto]:
    for attr in node.attribute:
        if attr.HasField("g"):
            yield attr.g
        yield from attr.graphs


def _defined(graph: onnx.GraphProto) -> set[str]:
    """Every name a graph defines, its nested subgraphs included (ONNX names are unique model-wide)."""
    names = {i.name for i in graph.input} | {t.name for t in graph.initializer}
    for node in graph.node:
        names.update(o for o in node.output if o)
        for sub in _subgraphs(node):
            names |= _defined(sub)
    return names


def _rename(node: onnx.NodeProto, mapping: dict[str, str], suffix: str) -> onnx.NodeProto:
    """A copy of ``node`` with every input/output name (nested subgraphs too) mapped and every
    node name suffixed."""
    out = onnx.NodeProto()
    out.CopyFrom(node)
    _rename_in_place(out, mapping, suffix)
    return out


def _rename_in_place(node: onnx.NodeProto, mapping: dict[str, str], suffix: str) -> None:
    node.input[:] = [mapping.get(i, i) for i in node.input]
    node.output[:] = [mapping.get(o, o) for o in node.output]
    if node.name:
        node.name += suffix
    for sub in _subgraphs(node):
        for vi in [*sub.input, *sub.output, *sub.value_info]:
            vi.name = mapping.get(vi.name, vi.name)
        for t in sub.initializer:
            t.name = mapping.get(t.name, t.name)
        for inner in sub.node:
            _rename_in_place(inner, mapping, suffix)


class _Consts:
    """Constant values of the main graph by name (initializers and ``Constant`` outputs)."""

    def __init__(self, graph: onnx.GraphProto) -> None:
        inputs = {i.name for i in graph.input}
        self.values = {t.name: t for t in graph.initializer if t.name not in inputs}
        for node in graph.node:
            if node.op_type == "Constant" and len(node.attribute) == 1 and node.attribute[0].name == "value":
                self.values[node.output[0]] = node.attribute[0].t

    def get(self, name: str) -> np.ndarray | None:
        t = self.values.get(name)
        return None if t is None else numpy_helper.to_array(t)


def _control_slice(body: onnx.GraphProto, carried: int) -> tuple[list[onnx.NodeProto], set[int], set[str]] | None:
    """Rule 2: (slice nodes in body order, carried indices it reads, outer names it reads)."""
    producer = {o: k for k, n in enumerate(body.node) for o in n.output if o}
    body_in = {vi.name: k for k, vi in enumerate(body.input)}
    local = _defined(body)
    wanted: set[int] = set()
    carried_read: set[int] = set()
    outer: set[str] = set()
    todo = [body.output[0].name]
    seen: set[str] = set()
    while todo:
        name = todo.pop()
        if not name or name in seen:
            continue
        seen.add(name)
        if name in body_in:
            k = body_in[name]
            if k >= 2 and k - 2 < carried and k - 2 not in carried_read:
                carried_read.add(k - 2)
                todo.append(body.output[k - 1].name)
            continue
        if name in producer:
            idx = producer[name]
            if idx not in wanted:
                wanted.add(idx)
                node = body.node[idx]
                todo.extend(node.input)
                for sub in _subgraphs(node):  # outer reads of a nested graph
                    inner = _defined(sub)
                    todo.extend(i for n in sub.node for i in n.input if i and i not in inner)
            continue
        if name not in local:
            outer.add(name)
    return [body.node[k] for k in sorted(wanted)], carried_read, outer


def trip_count(loop: onnx.NodeProto, consts: _Consts, max_steps: int, opset: int) -> int | None:
    """Rules 1-3: the number of iterations, or None when it is not fixed (or above ``max_steps``)."""
    from onnx.reference import ReferenceEvaluator

    body = next(a.g for a in loop.attribute if a.name == "body")
    carried = len(loop.input) - 2
    m = consts.get(loop.input[0]) if loop.input[0] else None
    cond0 = consts.get(loop.input[1]) if len(loop.input) > 1 and loop.input[1] else np.array(True)
    if (loop.input[0] and m is None) or cond0 is None:
        return None
    limit = int(np.asarray(m).reshape(())) if m is not None else None
    sliced = _control_slice(body, carried)
    if sliced is None:
        return None
    nodes, carried_read, outer = sliced
    state = {}
    for k in carried_read:
        value = consts.get(loop.input[2 + k])
        if value is None:
            return None  # rule 2: a carried value the condition reads starts from data
        state[k] = value
    outer_values = {name: consts.get(name) for name in outer}
    if any(v is None for v in outer_values.values()):
        return None
    names = [body.input[0].name, body.input[1].name] + [body.input[2 + k].name for k in sorted(carried_read)]
    outs = [body.output[0].name] + [body.output[1 + k].name for k in sorted(carried_read)]
    g = helper.make_graph(nodes, "control", [helper.make_tensor_value_info(n, onnx.TensorProto.UNDEFINED, None)
                                             for n in names],
                          [helper.make_tensor_value_info(n, onnx.TensorProto.UNDEFINED, None) for n in outs],
                          [numpy_helper.from_array(np.asarray(v), n) for n, v in outer_values.items()]
                          + list(body.initializer))
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    evaluator = ReferenceEvaluator(model)
    cond = bool(np.asarray(cond0).reshape(()))
    n = 0
    while cond and (limit is None or n < limit):
        if n >= max_steps:
            return None
        feeds = {names[0]: np.array(n, np.int64), names[1]: np.array(cond)}
        feeds.update({body.input[2 + k].name: state[k] for k in sorted(carried_read)})
        results = evaluator.run(None, feeds)
        cond = bool(np.asarray(results[0]).reshape(()))
        for k, value in zip(sorted(carried_read), results[1:]):
            state[k] = value
        n += 1
    return n


RANDOM_OPS = frozenset({"RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike", "Multinomial",
                        "Bernoulli", "Dropout"})


def _invariant(body: onnx.GraphProto, carried: int) -> tuple[set[int], list[int]]:
    """Rule 4b: (carried indices passed through unchanged, indices of invariant body nodes)."""
    through = {j for j in range(carried) if body.output[1 + j].name == body.input[2 + j].name}
    local = _defined(body) - {t.name for t in body.initializer}
    known = {body.input[2 + j].name for j in through}
    nodes = []
    for idx, node in enumerate(body.node):
        if (node.op_type in RANDOM_OPS or any(True for _ in _subgraphs(node))
                or not all(not i or i in known or i not in local for i in node.input)):
            continue
        nodes.append(idx)
        known.update(o for o in node.output if o)
    return through, nodes


def unroll(graph: onnx.GraphProto, at: int, steps: int, k: int) -> list[onnx.NodeProto] | None:
    """Rules 4 and 4b for the ``Loop`` at ``graph.node[at]``: the nodes that replace it (None: scan
    outputs with no iteration)."""
    loop = graph.node[at]
    body = next(a.g for a in loop.attribute if a.name == "body")
    carried = len(loop.input) - 2
    scans = len(body.output) - 1 - carried
    if steps == 0 and scans:
        return None
    nodes: list[onnx.NodeProto] = []
    for t in body.initializer:  # rule 4: once, not per copy
        moved = onnx.TensorProto()
        moved.CopyFrom(t)
        moved.name = f"{t.name}__loop{k}"
        graph.initializer.append(moved)
    hoisted = {t.name: f"{t.name}__loop{k}" for t in body.initializer}
    through, once = _invariant(body, carried) if steps else (set(), [])
    hoisted.update({body.input[2 + j].name: loop.input[2 + j] for j in through})
    for idx in once:  # rule 4b: defined once, every copy reads it
        hoisted.update({o: f"{o}__loop{k}" for o in body.node[idx].output if o})
    nodes.extend(_rename(body.node[idx], hoisted, f"__loop{k}") for idx in once)
    once_set = set(once)
    per_step = [n for idx, n in enumerate(body.node) if idx not in once_set]
    defined = _defined(body) - set(hoisted)
    state = [loop.input[2 + j] for j in range(carried)]
    rows: list[list[str]] = [[] for _ in range(scans)]
    for i in range(steps):
        suffix = f"__loop{k}_{i}"
        mapping = {name: name + suffix for name in defined}
        mapping.update(hoisted)
        it = body.input[0].name + suffix
        nodes.append(helper.make_node("Constant", [], [it], value=numpy_helper.from_array(np.array(i, np.int64))))
        cond_in = body.input[1].name + suffix
        nodes.append(helper.make_node("Constant", [], [cond_in], value=numpy_helper.from_array(np.array(True))))
        for j in range(carried):
            if j not in through:
                nodes.append(helper.make_node("Identity", [state[j]], [body.input[2 + j].name + suffix]))
        nodes.extend(_rename(n, mapping, suffix) for n in per_step)
        state = [mapping.get(body.output[1 + j].name, body.output[1 + j].name) for j in range(carried)]
        for s in range(scans):
            rows[s].append(mapping.get(body.output[1 + carried + s].name, body.output[1 + carried + s].name))
    axes = f"{loop.output[0] if loop.output else 'loop'}__loop{k}_axes0"
    graph.initializer.append(numpy_helper.from_array(np.array([0], np.int64), axes))
    for j in range(carried):
        if j < len(loop.output) and loop.output[j]:
            nodes.append(helper.make_node("Identity", [state[j]], [loop.output[j]]))
    for s in range(scans):
        out = loop.output[carried + s] if carried + s < len(loop.output) else ""
        if not out:
            continue
        parts = []
        for i, name in enumerate(rows[s]):
            parts.append(f"{out}__row{i}")
            nodes.append(helper.make_node("Unsqueeze", [name, axes], [parts[-1]]))
        nodes.extend(_concat_tree(parts, out))
    return nodes


CONCAT_FANIN = 16


def _concat_tree(parts: list[str], out: str) -> list[onnx.NodeProto]:
    """Rule 6: ``Concat(parts, axis=0) -> out``, as a two-level tree when there are more than
    :data:`CONCAT_FANIN` parts."""
    if len(parts) <= CONCAT_FANIN:
        return [helper.make_node("Concat", parts, [out], axis=0)]
    size = math.isqrt(len(parts) - 1) + 1
    nodes, groups = [], []
    for g, i in enumerate(range(0, len(parts), size)):
        chunk = parts[i:i + size]
        if len(chunk) == 1:
            groups.append(chunk[0])
            continue
        groups.append(f"{out}__rows{g}")
        nodes.append(helper.make_node("Concat", chunk, [groups[-1]], axis=0))
    nodes.append(helper.make_node("Concat", groups, [out], axis=0))
    return nodes


def unroll_loops_proto(proto: onnx.ModelProto, max_steps: int = MAX_STEPS) -> tuple[onnx.ModelProto, int]:
    """Rules 1-4 on every main-graph ``Loop`` of ``proto`` (modified in place). Returns the model
    and how many loops were unrolled."""
    graph = proto.graph
    opset = next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), 13)
    done = 0
    at = 0
    while at < len(graph.node):
        node = graph.node[at]
        if node.op_type != "Loop" or node.domain not in ("", "ai.onnx"):
            at += 1
            continue
        steps = trip_count(node, _Consts(graph), max_steps, opset)
        new = None if steps is None else unroll(graph, at, steps, done)
        if new is None:
            at += 1
            continue
        del graph.node[at]
        for offset, n in enumerate(new):
            graph.node.insert(at + offset, n)
        at += len(new)
        done += 1
    return proto, done


def _candidate(node: ir.Node) -> bool:
    """Rule 1 on the IR: a default-domain ``Loop`` with constant (or absent) ``M`` and ``cond``."""
    if node.op_type != "Loop" or node.domain not in ("", "ai.onnx"):
        return False
    def constant(v: ir.Value | None) -> bool:
        producer = None if v is None else v.producer()
        return v is None or v.const_value is not None or (producer is not None and producer.op_type == "Constant")

    return all(constant(v) for v in list(node.inputs)[:2])


@register("unroll_loop")
class UnrollLoop(ir.passes.InPlacePass):
    """Unroll every main-graph ``Loop`` whose trip count is fixed by constants (rules 1-4)."""

    def __init__(self, max_steps: int = MAX_STEPS) -> None:
        super().__init__()
        self.max_steps = max_steps

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        if not any(_candidate(n) for n in model.graph):  # rule 1 first: serializing is not free
            return ir.passes.PassResult(model, False)
        proto, done = unroll_loops_proto(ir.serde.serialize_model(model), self.max_steps)
        if not done:
            return ir.passes.PassResult(model, False)
        new = ir.serde.deserialize_model(proto)
        _replace_contents(model, new)
        return ir.passes.PassResult(model, True)


def _replace_contents(model: ir.Model, new: ir.Model) -> None:
    """An in-place pass must hand back the same object: move ``new``'s graph into ``model``."""
    model.graph = new.graph
