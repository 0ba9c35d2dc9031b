"""Cut a per-rank program at its comm ops into pure compute segments.

Both backends use this: ONNX Runtime runs each segment as a session, and the TVM backend imports
each segment with ``from_onnx`` and calls the comm ops between them (DESIGN.md, "Facts checked").

Rules:
1. Nodes keep their order; a maximal run of non-comm nodes of the same kind is one
   :class:`Segment`, and each comm node is one :class:`CommStep`. The kind is ``"compute"``
   unless a ``kind_of`` function says otherwise (the TVM backend marks the nodes ONNX Runtime
   must run, so they form segments of their own).
2. A segment's inputs are the values it reads that come from outside it (graph inputs, earlier
   steps); initializers it reads are copied into it. Values read by subgraphs count too.
3. A segment's outputs are the values it produces that a later step or the graph output reads.
4. Every segment is a valid ONNX model with typed, shaped inputs and outputs (taken from the
   program's inputs, outputs and ``value_info``; the program must be shape-inferred).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Union

import onnx
from onnx import helper

from partitioner.core.comm_ops import DOMAIN, CommOp, is_comm
from partitioner.core.errors import VerifyError


@dataclass(frozen=True)
class Segment:
    index: int
    model: onnx.ModelProto
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    kind: str = "compute"


@dataclass(frozen=True)
class CommStep:
    index: int
    op: CommOp

    @property
    def inputs(self) -> tuple[str, ...]:
        return tuple(i for i in self.op.inputs if i)

    @property
    def outputs(self) -> tuple[str, ...]:
        return self.op.outputs


Step = Union[Segment, CommStep]


def _subgraph_reads(node: onnx.NodeProto) -> set[str]:
    """Names read by a node's subgraphs from the enclosing scope."""
    names: set[str] = set()
    for attr in node.attribute:
        graphs = list(attr.graphs) + ([attr.g] if attr.HasField("g") else [])
        for g in graphs:
            local = {i.name for i in g.input} | {i.name for i in g.initializer}
            for n in g.node:
                local.update(n.output)
            for n in g.node:
                names.update(i for i in n.input if i and i not in local)
                names.update(r for r in _subgraph_reads(n) if r not in local)
            names.update(o.name for o in g.output if o.name not in local)  # an outer value returned as is
    return names


def all_nodes(graph: onnx.GraphProto) -> Iterable[onnx.NodeProto]:
    """Every node of ``graph`` and, depth first, of its subgraphs."""
    for node in graph.node:
        yield node
        for attr in node.attribute:
            for g in list(attr.graphs) + ([attr.g] if attr.HasField("g") else []):
                yield from all_nodes(g)


def node_reads(node: onnx.NodeProto) -> set[str]:
    return {i for i in node.input if i} | _subgraph_reads(node)


def value_infos(model: onnx.ModelProto) -> dict[str, onnx.ValueInfoProto]:
    g = model.graph
    infos = {v.name: v for v in g.value_info}
    infos.update({v.name: v for v in g.input})
    infos.update({v.name: v for v in g.output})
    for init in g.initializer:
        infos.setdefault(init.name, helper.make_tensor_value_info(init.name, init.data_type, list(init.dims)))
    return infos


def split_program(model: onnx.ModelProto, kind_of: Callable[[onnx.NodeProto], str] | None = None) -> list[Step]:
    """Split ``model`` (a per-rank program, shape-inferred) into segments and comm steps."""
    g = model.graph
    groups: list[list[onnx.NodeProto] | onnx.NodeProto] = []
    kinds: list[str] = []
    for node in g.node:
        kind = "comm" if is_comm(node) else (kind_of(node) if kind_of else "compute")
        if kind == "comm":
            groups.append(node)
        elif groups and isinstance(groups[-1], list) and kinds[-1] == kind:
            groups[-1].append(node)
            continue
        else:
            groups.append([node])
        kinds.append(kind)

    # later_reads[i] = every name read by groups after i (and the graph outputs)
    reads = [set().union(*(node_reads(n) for n in grp)) if isinstance(grp, list) else node_reads(grp) for grp in groups]
    later: list[set[str]] = [set() for _ in groups]
    acc = {o.name for o in g.output}
    for i in range(len(groups) - 1, -1, -1):
        later[i] = set(acc)
        acc |= reads[i]

    infos = value_infos(model)
    inits = {t.name: t for t in g.initializer}
    opsets = [o for o in model.opset_import if o.domain != DOMAIN]
    steps: list[Step] = []
    for i, grp in enumerate(groups):
        if not isinstance(grp, list):
            steps.append(CommStep(i, CommOp.from_node(grp)))
            continue
        produced = [o for n in grp for o in n.output if o]
        produced_set = set(produced)
        ins = sorted(r for r in reads[i] if r not in produced_set and r not in inits)
        outs = [o for o in produced if o in later[i]]
        seg = _segment_model(model, grp, ins, outs, [inits[r] for r in sorted(reads[i]) if r in inits], infos, opsets, i)
        steps.append(Segment(i, seg, tuple(ins), tuple(outs), kinds[i]))
    return steps


def _segment_model(model, nodes, ins, outs, initializers, infos, opsets, index) -> onnx.ModelProto:
    missing = [n for n in list(ins) + list(outs) if n not in infos]
    if missing:
        raise VerifyError(
            f"segment {index} of graph {model.graph.name!r}: no type/shape for value(s) {', '.join(missing[:5])}; "
            "run shape inference on the per-rank program first"
        )
    io, produced = set(ins) | set(outs), _names(nodes)
    graph = helper.make_graph(
        list(nodes), f"{model.graph.name}_seg{index}",
        [infos[n] for n in ins], [infos[n] for n in outs], initializer=list(initializers),
        value_info=[v for k, v in infos.items() if k not in io and k in produced],
    )
    seg = helper.make_model(graph, opset_imports=opsets, ir_version=model.ir_version)
    for f in model.functions:
        seg.functions.append(f)
    return seg


def _names(nodes: Iterable[onnx.NodeProto]) -> set[str]:
    return {o for n in nodes for o in n.output}
