"""Per-rank programs in their two forms: onnx-ir (what lowering builds, the simulator and the
verifier read) and protobuf (what the artifact stores and the backends import).

Rules:
1. A program is serialised once, where it leaves the process (the artifact writer, an export):
   :func:`to_proto` is that step and passes a ``ModelProto`` through unchanged. Initializers get
   no ``value_info`` (their tensors carry dtype and dims; onnx-ir would add one per weight), so a
   rank program's bytes are what the lowering has always written.
2. :func:`to_ir` is for programs that arrive as protobuf (hand-built in tests, read back from an
   artifact); lowering's own output is never parsed back.
3. :func:`outer_values` names what a node's subgraphs read from the enclosing scope: those reads
   are not node inputs, yet they are uses (pruning, placement, verification count them).
"""

from __future__ import annotations

import onnx
import onnx_ir as ir


def to_proto(program: ir.Model | onnx.ModelProto) -> onnx.ModelProto:
    """Rule 1."""
    if isinstance(program, onnx.ModelProto):
        return program
    proto = ir.serde.serialize_model(program)
    g = proto.graph
    inits = {t.name for t in g.initializer}
    if any(v.name in inits for v in g.value_info):
        kept = [v for v in g.value_info if v.name not in inits]
        del g.value_info[:]
        g.value_info.extend(kept)
    return proto


def to_ir(program: ir.Model | onnx.ModelProto) -> ir.Model:
    """Rule 2."""
    return ir.serde.deserialize_model(program) if isinstance(program, onnx.ModelProto) else program


def graph_attributes(node: ir.Node) -> dict[str, ir.Attr]:
    """The node's GRAPH and GRAPHS attributes (an If's branches, a Loop's body), by name."""
    return {k: a for k, a in node.attributes.items()
            if isinstance(a, ir.Attr) and a.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS)}


def _graph_attrs(node: ir.Node) -> list[ir.Graph]:
    graphs: list[ir.Graph] = []
    for attr in graph_attributes(node).values():
        graphs.extend([attr.as_graph()] if attr.type == ir.AttributeType.GRAPH else attr.as_graphs())
    return graphs


def outer_values(node: ir.Node) -> dict[str, ir.Value]:
    """Rule 3: every value ``node``'s subgraphs (at any depth) read from outside them, node
    inputs included, by name."""
    graphs: list[ir.Graph] = []
    todo = _graph_attrs(node)
    while todo:
        g = todo.pop()
        graphs.append(g)
        for n in g:
            todo.extend(_graph_attrs(n))
    inside = set(map(id, graphs))
    found: dict[str, ir.Value] = {}
    for g in graphs:
        for n in g:
            for v in n.inputs:
                if v is not None and id(v.graph) not in inside:
                    found.setdefault(v.name or "", v)
        for v in g.outputs:  # a branch returning an outer value as is
            if id(v.graph) not in inside:
                found.setdefault(v.name or "", v)
    return found
