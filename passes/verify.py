"""The graph invariants every pass keeps, written as one checkable spec.

Rules, checked in one walk over the nodes in their stored order:

1. Every node's domain is imported by the model (``opset_imports``); a node in the
   ``partitioner.comm`` domain is one of the known communication operators (they are legal and
   side-effecting; ``Send`` has no outputs, the others have at least one).
2. SSA: every value is defined once (graph input, initializer, or one output of one node), and
   every named value has a name no other value in the graph has. An output's ``producer()`` is
   the node that lists it.
3. Topological order and no dangling inputs: every input of a node is a graph input, an
   initializer, an outer-scope value (in subgraphs), or an output of an *earlier* node.
4. Use-def consistency: a node reading value ``v`` at input ``i`` appears as ``(node, i)`` in
   ``v.uses()``, and every entry of ``v.uses()`` is a node of this graph that really reads ``v``
   there.
5. Every graph output is defined.
6. With ``require_shapes``: every value of the main graph (inputs, initializers, node outputs)
   has a known dtype and a fully static shape. Node outputs that nothing reads (a ``Dropout``
   mask) and subgraph values are not held to this.

Per-rank programs (the lowering's output, :func:`verify_programs`) are held to rules 1-5 on each
rank and, across ranks, to:

7. every value a rank's node reads (inputs and subgraph reads) is produced on that rank: a value
   crossing ranks must go through a comm op;
8. every Send has exactly one Recv with the same (source, destination, tag), shape and dtype;
9. the comm ops cannot deadlock: the ranks are simulated step by step with non-blocking Sends,
   blocking Recvs and collectives that need every group member at the same (group, tag);
10. the bindings cover every model input and output, and each placement names a graph
    input/output of its rank's program;
11. with ``model`` given: every model node runs on some rank (by node name).

This is the one verifier: the pass manager runs :func:`verify` after each pass, lowering runs
:func:`verify_programs` on what it built. Each failure raises
:class:`partitioner.core.errors.VerifyError` with one line naming the node or value (and rank)
and what is wrong.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import Any

import onnx
import onnx_ir as ir

from partitioner.core.bindings import Bindings
from partitioner.core.comm_ops import COLLECTIVES, CommOp, is_comm
from partitioner.core.errors import VerifyError
from partitioner.core.programs import outer_values, to_ir, to_proto
from passes.side_effects import COMM_DOMAIN, COMM_OP_TYPES

_ONNX_DOMAINS = ("", "ai.onnx")


def describe_node(node: ir.Node) -> str:
    """A short, readable name for a node in messages: ``'name' (OpType)``."""
    op = f"{node.domain}::{node.op_type}" if node.domain not in _ONNX_DOMAINS else node.op_type
    return f"node '{node.name or '<unnamed>'}' ({op})"


def _describe_value(value: ir.Value) -> str:
    return f"value '{value.name}'"


def verify(model: ir.Model, *, require_shapes: bool = True) -> None:
    """Check the invariants listed in the module docstring; raise VerifyError on the first break."""
    opsets = dict(model.opset_imports)
    _verify_graph(model.graph, outer=frozenset(), opsets=opsets, require_shapes=require_shapes)


def _check_domain(node: ir.Node, opsets: dict[str, int]) -> None:
    domain = node.domain
    if domain in _ONNX_DOMAINS:
        if not any(d in opsets for d in _ONNX_DOMAINS):
            raise VerifyError(f"{describe_node(node)}: the model imports no default ONNX opset")
    elif domain not in opsets:
        raise VerifyError(
            f"{describe_node(node)}: domain '{domain}' is not in the model's opset_imports; add it"
        )
    if domain == COMM_DOMAIN:
        if node.op_type not in COMM_OP_TYPES:
            raise VerifyError(
                f"{describe_node(node)}: unknown communication op; "
                f"known: {', '.join(sorted(COMM_OP_TYPES))}"
            )
        if node.op_type == "Send" and len(node.outputs) != 0:
            raise VerifyError(f"{describe_node(node)}: Send must have no outputs")
        if node.op_type != "Send" and len(node.outputs) == 0:
            raise VerifyError(f"{describe_node(node)}: {node.op_type} must have an output")


def _check_shape(value: ir.Value, where: str) -> None:
    dtype = value.dtype
    shape = value.shape
    if value.const_value is not None:
        # An initializer's tensor is the ground truth when the Value carries no annotation.
        dtype = dtype if dtype is not None else value.const_value.dtype
        shape = shape if shape is not None else value.const_value.shape
    if value.type is not None and not isinstance(value.type, ir.TensorType):
        return  # sequence / optional / sparse values carry no single static shape
    if dtype is None:
        raise VerifyError(f"{_describe_value(value)} ({where}) has no known dtype; run shape_inference")
    if shape is None:
        raise VerifyError(f"{_describe_value(value)} ({where}) has no known shape; run shape_inference")
    if not shape.is_static():
        raise VerifyError(
            f"{_describe_value(value)} ({where}) has a non-static shape {shape}; "
            "bind the input shapes (e.g. --batch) so every dimension is a number"
        )


def _verify_graph(
    graph: ir.Graph,
    *,
    outer: frozenset[ir.Value],
    opsets: dict[str, int],
    require_shapes: bool,
) -> None:
    nodes = list(graph)
    node_set = set(nodes)
    defined: set[ir.Value] = set()
    names: dict[str, ir.Value] = {}

    def define(value: ir.Value, where: str) -> None:
        if value in defined:
            raise VerifyError(f"{_describe_value(value)} is defined twice (again as {where}); SSA broken")
        defined.add(value)
        if value.name:
            other = names.get(value.name)
            if other is not None and other is not value:
                raise VerifyError(
                    f"two values are named '{value.name}' (second one: {where}); names must be unique"
                )
            names[value.name] = value

    for value in graph.inputs:
        define(value, "graph input")
    for name, value in graph.initializers.items():
        if value.name != name:
            raise VerifyError(f"initializer registered as '{name}' is named '{value.name}'")
        if value.producer() is not None:
            raise VerifyError(f"initializer '{name}' is also produced by {describe_node(value.producer())}")
        if value in defined:
            # IR < 4 lists initializers among the graph inputs: one value, two roles, legal.
            continue
        define(value, "initializer")

    # Values produced anywhere in this graph, to tell "later" (rule 3, order) from "nowhere".
    producer_of: dict[ir.Value, int] = {}
    for index, node in enumerate(nodes):
        for out in node.outputs:
            producer_of.setdefault(out, index)

    for index, node in enumerate(nodes):
        _check_domain(node, opsets)
        _check_inputs(node, nodes, defined, outer, producer_of)
        for attr in node.attributes.values():
            if isinstance(attr, ir.Attr) and attr.type == ir.AttributeType.GRAPH:
                _verify_subgraphs([attr.as_graph()], outer | defined, opsets)
            elif isinstance(attr, ir.Attr) and attr.type == ir.AttributeType.GRAPHS:
                _verify_subgraphs(attr.as_graphs(), outer | defined, opsets)
        for j, out in enumerate(node.outputs):
            if out.producer() is not node or out.index() != j:
                raise VerifyError(
                    f"{describe_node(node)} output {j} {_describe_value(out)} names another producer"
                )
            if not out.name:
                if out.uses() or out.is_graph_output():
                    raise VerifyError(f"{describe_node(node)} output {j} is used but has no name")
                continue  # an omitted optional output
            define(out, f"output {j} of {describe_node(node)}")

    _check_uses(graph, node_set, defined)

    for k, out in enumerate(graph.outputs):
        if out not in defined and out not in outer:
            raise VerifyError(
                f"graph output {k} {_describe_value(out)} is not produced by any node, input or initializer"
            )

    if require_shapes:
        _check_shapes(graph, nodes)


def _check_inputs(node: ir.Node, nodes: list[ir.Node], defined: set[ir.Value], outer: frozenset[ir.Value],
                  producer_of: dict[ir.Value, int]) -> None:
    """Rules 3 and 4 for one node's inputs: defined earlier (or outside), and listed as uses."""
    for i, inp in enumerate(node.inputs):
        if inp is None:
            continue
        if inp not in defined and inp not in outer:
            if inp in producer_of:
                later = nodes[producer_of[inp]]
                raise VerifyError(
                    f"{describe_node(node)} reads {_describe_value(inp)} before "
                    f"{describe_node(later)} produces it; graph is not topologically sorted"
                )
            raise VerifyError(
                f"{describe_node(node)} input {i} {_describe_value(inp)} is dangling: not produced by "
                "any node, graph input or initializer"
            )
        if (node, i) not in inp.uses():
            raise VerifyError(
                f"{describe_node(node)} reads {_describe_value(inp)} at input {i} but the value's "
                "uses do not list it; use-def links are broken"
            )


def _check_uses(graph: ir.Graph, node_set: set[ir.Node], defined: set[ir.Value]) -> None:
    """Every use a value lists is a node of the graph that reads that value there (rule 4)."""
    for value in defined:
        for use in value.uses():
            if use.node.graph is None or (use.node.graph is graph and use.node not in node_set):
                raise VerifyError(f"{_describe_value(value)} lists a use by a node that is not in the graph")
            if use.idx >= len(use.node.inputs) or use.node.inputs[use.idx] is not value:
                raise VerifyError(
                    f"{_describe_value(value)} lists a use by {describe_node(use.node)} at input "
                    f"{use.idx}, which reads something else; use-def links are broken"
                )


def _check_shapes(graph: ir.Graph, nodes: list[ir.Node]) -> None:
    """Rule 6: inputs, initializers and every output somebody reads have static shapes."""
    for value in graph.inputs:
        _check_shape(value, "graph input")
    for value in graph.initializers.values():
        _check_shape(value, "initializer")
    for node in nodes:
        for out in node.outputs:
            # An output nobody reads (a Dropout mask) may stay unshaped: nothing depends on it.
            if out.name and (out.uses() or out.is_graph_output()):
                _check_shape(out, f"output of {describe_node(node)}")


def _verify_subgraphs(graphs: Iterable[ir.Graph], outer: set[ir.Value], opsets: dict[str, int]) -> None:
    for sub in graphs:
        sub_opsets = {**opsets, **dict(sub.opset_imports)}
        _verify_graph(sub, outer=frozenset(outer), opsets=sub_opsets, require_shapes=False)


# ---- per-rank programs (rules 7-11) ---------------------------------------------------------------
def verify_programs(programs: Sequence[ir.Model | onnx.ModelProto], bindings: Bindings, *, model: Any = None) -> None:
    """Rules 1-5 on every rank, then 7-11 across ranks (module docstring)."""
    if len(programs) != bindings.world_size:
        raise VerifyError(f"{len(programs)} programs for a world size of {bindings.world_size}")
    models = [to_ir(p) for p in programs]
    comm: list[list[CommOp]] = []
    sends: dict[tuple[int, int, int], list[tuple[int, tuple[int, ...]]]] = defaultdict(list)
    recvs: dict[tuple[int, int, int], list[tuple[int, tuple[int, ...]]]] = defaultdict(list)
    for r, p in enumerate(models):
        comm.append(_rank_comm(r, p, sends, recvs))
        try:
            verify(p, require_shapes=False)
        except VerifyError as exc:
            raise VerifyError(f"rank {r}: {exc}") from None
    for key in set(sends) | set(recvs):
        s, d, tag = key
        if len(sends.get(key, [])) != len(recvs.get(key, [])):
            raise VerifyError(f"Send/Recv mismatch from rank {s} to rank {d} tag {tag}: "
                              f"{len(sends.get(key, []))} send(s), {len(recvs.get(key, []))} recv(s)")
        for st, rt in zip(sends[key], recvs[key]):
            if st != rt:
                raise VerifyError(f"Send from rank {s} to rank {d} tag {tag} carries elem type {st[0]} shape {list(st[1])} "
                                  f"but the Recv expects elem type {rt[0]} shape {list(rt[1])}")
    simulate_comm(comm)
    _check_bindings(models, bindings, model)


def cross_rank_edge(rank: int, node: str | None, op_type: str, name: str) -> VerifyError:
    """Rule 7's error: a node reads a value its rank does not produce."""
    return VerifyError(f"rank {rank}: node {node!r} ({op_type}) reads {name!r}, which is not produced on this "
                       "rank: a cross-rank edge without a comm op")


def _value_type(v: ir.Value) -> tuple[int, tuple[int, ...]]:
    dtype = v.dtype if v.dtype is not None else (v.const_value.dtype if v.const_value is not None else None)
    shape = v.shape if v.shape is not None else (v.const_value.shape if v.const_value is not None else None)
    if dtype is None or shape is None:
        return 0, ()
    return int(dtype), tuple(int(d) if isinstance(d, int) else 0 for d in shape)


def _rank_comm(r: int, p: ir.Model, sends: dict, recvs: dict) -> list[CommOp]:
    """Rule 7 on rank ``r``; collects its Sends and Recvs (rule 8) and returns its comm ops in order."""
    g = p.graph
    known = {v.name for v in g.inputs} | set(g.initializers)
    ops = []
    for node in g:
        reads = [v.name for v in node.inputs if v is not None] + list(outer_values(node))
        missing = [n for n in reads if n not in known]
        if missing:
            raise cross_rank_edge(r, node.name, node.op_type, missing[0])
        known.update(o.name for o in node.outputs if o.name)
        if not is_comm(node):
            continue
        op = CommOp.from_node(node)
        ops.append(op)
        if op.op_type == "Send":
            sends[(r, int(op.attrs["peer"]), op.tag)].append(_value_type(node.inputs[0]))
        elif op.op_type == "Recv":
            recvs[(int(op.attrs["peer"]), r, op.tag)].append(
                (int(op.attrs["dtype"]), tuple(int(d) for d in op.attrs["shape"])))
    missing_out = [o.name for o in g.outputs if o.name not in known]
    if missing_out:
        raise VerifyError(f"rank {r}: graph output {missing_out[0]!r} is never produced")
    return ops


def simulate_comm(comm: Sequence[Sequence[CommOp]]) -> None:
    """Run the ranks' comm sequences (rule 9); raise VerifyError naming the stalled ranks and ops."""
    n = len(comm)
    pc = [0] * n
    mail: dict[tuple[int, int, int], int] = defaultdict(int)
    while True:
        progress = False
        for r in range(n):
            while pc[r] < len(comm[r]):
                op = comm[r][pc[r]]
                if op.op_type == "Send":
                    mail[(r, int(op.attrs["peer"]), op.tag)] += 1
                elif op.op_type == "Recv":
                    key = (int(op.attrs["peer"]), r, op.tag)
                    if mail[key] == 0:
                        break
                    mail[key] -= 1
                else:
                    break
                pc[r] += 1
                progress = True
        # collectives: fire when every member is waiting at the same (group, tag)
        waiting: dict[tuple[tuple[int, ...], int, str], list[int]] = defaultdict(list)
        for r in range(n):
            if pc[r] < len(comm[r]) and comm[r][pc[r]].op_type in COLLECTIVES:
                op = comm[r][pc[r]]
                if r not in op.group:
                    raise VerifyError(f"rank {r}: collective {op.name!r} does not list the rank in its group {list(op.group)}")
                waiting[(op.group, op.tag, op.op_type)].append(r)
        for (group, _tag, _t), members in waiting.items():
            if sorted(members) == sorted(group):
                for r in members:
                    pc[r] += 1
                progress = True
        if all(pc[r] == len(comm[r]) for r in range(n)):
            return
        if not progress:
            stuck = [f"rank {r} at {comm[r][pc[r]].op_type} {comm[r][pc[r]].name!r}" for r in range(n) if pc[r] < len(comm[r])]
            raise VerifyError(f"deadlock: {'; '.join(stuck)}")


def _check_bindings(programs: Sequence[ir.Model], bindings: Bindings, model: Any) -> None:
    """Rules 10 and 11."""
    bindings.check()
    for kind, items in (("input", bindings.inputs), ("output", bindings.outputs)):
        for b in items:
            for p in b.placements:
                g = programs[p.rank].graph
                names = {v.name for v in (g.inputs if kind == "input" else g.outputs)}
                if p.local_name not in names:
                    raise VerifyError(f"binding of {kind} {b.name!r}: rank {p.rank} has no graph {kind} {p.local_name!r}")
    if model is None:
        return
    need_in, need_out = set(model.inputs), set(model.outputs)
    have_in, have_out = {b.name for b in bindings.inputs}, {b.name for b in bindings.outputs}
    if need_in - have_in or need_out - have_out:
        raise VerifyError(f"bindings miss model input(s)/output(s): {sorted((need_in - have_in) | (need_out - have_out))}")
    ran = {n.name for p in programs for n in p.graph}
    lost = [n.name for n in model.nodes if n.name not in ran]
    if lost:
        raise VerifyError(f"{len(lost)} model node(s) run on no rank, e.g. {lost[0]!r}")


def check_programs(programs: Sequence[ir.Model | onnx.ModelProto]) -> None:
    """``onnx.checker.check_model(full_check=True)`` on every program; raises VerifyError naming the rank."""
    for r, p in enumerate(programs):
        try:
            onnx.checker.check_model(to_proto(p), full_check=True)
        except Exception as exc:  # onnx raises several checker/inference error types
            raise VerifyError(f"rank {r}: program does not pass the ONNX checker: {str(exc).splitlines()[0]}") from None
