"""The operator graph as an inline SVG, each node coloured by the device(s) that run it.

Layout: nodes are placed by topological generation (networkx), one row per generation, so a
reader sees the DAG top to bottom; edges are straight lines. Past ``max_nodes`` nodes the drawing
keeps its shape but drops labels and edges, so it stays small and fast for thousands of nodes.
"""

from __future__ import annotations

import html
from typing import Any, Mapping, Sequence

import networkx as nx

_PALETTE = ("#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1", "#ff9da7",
            "#9c755f", "#bab0ac")


def rank_colour(rank: int) -> str:
    if rank < len(_PALETTE):
        return _PALETTE[rank]
    return f"hsl({(rank * 47) % 360},60%,55%)"


def plan_graph_svg(nodes: Sequence[tuple[str, str, Sequence[str], Sequence[str]]], ranks_of: Mapping[str, Sequence[int]],
                   stage_of: Mapping[str, int] | None = None, *, max_nodes: int = 400, width: int = 1100) -> str:
    """``nodes``: (name, op_type, input names, output names) in topological order.
    ``ranks_of``: node name -> ranks that run it."""
    g = nx.DiGraph()
    producer: dict[str, str] = {}
    for name, _, _, outs in nodes:
        g.add_node(name)
        for o in outs:
            producer[o] = name
    for name, _, ins, _ in nodes:
        for i in ins:
            if i in producer and producer[i] != name:
                g.add_edge(producer[i], name)
    layers = [sorted(gen, key=lambda n: list(g.nodes).index(n)) for gen in nx.topological_generations(g)]
    detailed = len(nodes) <= max_nodes
    row_h = 34 if detailed else 8
    box_h = 22 if detailed else 6
    pos: dict[str, tuple[float, float]] = {}
    widest = max((len(layer) for layer in layers), default=1)
    box_w = max(4.0, min(120.0, (width - 20) / widest - 6))
    for y, layer in enumerate(layers):
        step = (width - 20) / max(len(layer), 1)
        for x, n in enumerate(layer):
            pos[n] = (10 + step * x + (step - box_w) / 2, 10 + y * row_h)
    height = 20 + len(layers) * row_h
    op_of = {n: op for n, op, _, _ in nodes}
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="10">']
    if detailed:
        for a, b in g.edges:
            (x1, y1), (x2, y2) = pos[a], pos[b]
            out.append(f'<line x1="{x1 + box_w / 2:.1f}" y1="{y1 + box_h:.1f}" x2="{x2 + box_w / 2:.1f}" '
                       f'y2="{y2:.1f}" stroke="#999" stroke-width="0.7"/>')
    for n, (x, y) in pos.items():
        ranks = list(ranks_of.get(n, ()))
        colour = rank_colour(ranks[0]) if ranks else "#ccc"
        stroke = "#222" if len(ranks) > 1 else "none"
        stage = f", stage {stage_of[n]}" if stage_of and n in stage_of else ""
        tip = html.escape(f"{n} ({op_of[n]}) on ranks {ranks}{stage}")
        out.append(f'<g><title>{tip}</title><rect x="{x:.1f}" y="{y:.1f}" width="{box_w:.1f}" height="{box_h}" '
                   f'rx="3" fill="{colour}" stroke="{stroke}" stroke-width="1"/>')
        if detailed and box_w > 30:
            label = html.escape(op_of[n][: max(3, int(box_w / 6))])
            out.append(f'<text x="{x + box_w / 2:.1f}" y="{y + 15:.1f}" text-anchor="middle" fill="#fff">{label}</text>')
        out.append("</g>")
    out.append("</svg>")
    return "".join(out)


def legend_html(world_size: int) -> str:
    items = "".join(f'<span style="display:inline-block;margin-right:12px"><span style="display:inline-block;'
                    f'width:12px;height:12px;background:{rank_colour(r)};margin-right:4px"></span>rank {r}</span>'
                    for r in range(world_size))
    return f"<p>{items} (outlined: replicated or sharded over several ranks)</p>"


def graph_svg_for_plan(model: Any, plan: Any, **kw: Any) -> str:
    """Convenience: an onnx-ir model and a :class:`partitioner.core.plan.Plan`."""
    nodes = [(n.name, n.op_type, [v.name for v in n.inputs if v is not None], [v.name for v in n.outputs])
             for n in model.graph]
    ranks_of = {name: np_.ranks for name, np_ in plan.nodes.items()}
    stage_of = {name: np_.stage for name, np_ in plan.nodes.items()}
    return legend_html(plan.world_size) + plan_graph_svg(nodes, ranks_of, stage_of, **kw)


def plan_report_html(model: Any, result: Any, cluster: Any) -> str:
    """The whole report of a :class:`partitioner.partition.PartitionResult`: predicted timeline,
    memory against capacity, bytes per link, and the graph coloured by device (self-contained)."""
    from partitioner.report_html import render_report

    plan = result.plan
    title = f"{model.graph.name or 'model'}: {plan.strategy} on {cluster.name}"
    extra = {"strategy": plan.strategy, "mesh": f"{list(plan.mesh_shape)} {list(plan.mesh_axes)}",
             "stages": plan.num_stages, "explanation": result.explanation}
    return render_report(title, result.simulation, cluster, extra=extra, graph_svg=graph_svg_for_plan(model, plan))
