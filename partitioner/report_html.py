"""A self-contained HTML report of a simulated plan: summary table, per-device Gantt timeline,
memory against capacity, and bytes moved per link level.

The page has inline CSS and inline SVG only: no scripts, no fonts, no network references (the
SVG namespace URI is an identifier, not a fetch). Every string from the model or cluster is
HTML-escaped.
"""

from __future__ import annotations

import html
from typing import Any

from partitioner.cluster import Cluster
from partitioner.cost.simulate import SimResult

SVG_NS = "http://www.w3.org/2000/svg"
COLORS = {"compute": "#4c78a8", "comm": "#f58518", "idle": "#d9d9d9"}
MAX_EVENTS = 20000  # beyond this the shortest events are dropped from the drawing (not the totals)

_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,Helvetica,Arial,sans-serif;margin:24px;color:#222}
h1{font-size:1.4em}h2{font-size:1.1em;margin-top:28px}
table{border-collapse:collapse;font-size:.9em}td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}
th{background:#f3f3f3}td.l,th.l{text-align:left}.bad{color:#b00020;font-weight:600}
.legend span{display:inline-block;width:12px;height:12px;margin:0 4px 0 12px;vertical-align:middle}
svg text{font-size:11px;fill:#333}
"""


def _e(x: Any) -> str:
    return html.escape(str(x), quote=True)


def fmt_seconds(s: float) -> str:
    if s == 0:
        return "0"
    if s >= 1:
        return f"{s:.3g} s"
    if s >= 1e-3:
        return f"{s * 1e3:.3g} ms"
    if s >= 1e-6:
        return f"{s * 1e6:.3g} µs"
    return f"{s * 1e9:.3g} ns"


def fmt_bytes(b: float) -> str:
    for unit, k in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if b >= k:
            return f"{b / k:.3g} {unit}"
    return f"{b:.0f} B"


def _gantt(sim: SimResult) -> str:
    width, left, row, top = 960, 90, 20, 24
    span = sim.step_latency or 1.0
    events = list(sim.events)
    if len(events) > MAX_EVENTS:
        events = sorted(events, key=lambda e: e.end - e.start, reverse=True)[:MAX_EVENTS]
    height = top + row * sim.num_ranks + 30
    scale = (width - left - 10) / span
    parts = [f'<svg xmlns="{SVG_NS}" width="{width}" height="{height}" role="img" aria-label="timeline">']
    for r in range(sim.num_ranks):
        y = top + r * row
        parts.append(f'<text x="4" y="{y + 14}">{_e(r)}: {_e(sim.device_names[r])[:10]}</text>')
        parts.append(f'<rect x="{left}" y="{y + 2}" width="{width - left - 10}" height="{row - 4}" fill="#f7f7f7"/>')
    for ev in events:
        x = left + ev.start * scale
        w = max(0.5, (ev.end - ev.start) * scale)
        y = top + ev.rank * row + 2
        parts.append(f'<rect x="{x:.2f}" y="{y}" width="{w:.2f}" height="{row - 4}" fill="{COLORS.get(ev.kind, "#999")}">'
                     f'<title>rank {ev.rank} {_e(ev.kind)} {_e(ev.label)}: {_e(fmt_seconds(ev.start))} – '
                     f'{_e(fmt_seconds(ev.end))}</title></rect>')
    axis_y = top + row * sim.num_ranks + 14
    for k in range(6):
        x = left + (width - left - 10) * k / 5
        parts.append(f'<text x="{x:.1f}" y="{axis_y}" text-anchor="middle">{_e(fmt_seconds(span * k / 5))}</text>')
    parts.append("</svg>")
    return "".join(parts)


def _bars(rows: list[tuple[str, float, float, str]], unit_fmt: Any) -> str:
    """Horizontal bars: (label, value, full scale, annotation)."""
    width, left, row = 960, 200, 20
    height = row * len(rows) + 10
    parts = [f'<svg xmlns="{SVG_NS}" width="{width}" height="{height}" role="img">']
    for i, (label, value, full, note) in enumerate(rows):
        y = 4 + i * row
        frac = value / full if full > 0 else 0.0
        w = (width - left - 160) * min(frac, 1.0)
        color = "#b00020" if frac > 1 else "#54a24b"
        parts.append(f'<text x="4" y="{y + 13}">{_e(label)}</text>')
        parts.append(f'<rect x="{left}" y="{y}" width="{width - left - 160}" height="{row - 4}" fill="#eee"/>')
        parts.append(f'<rect x="{left}" y="{y}" width="{w:.2f}" height="{row - 4}" fill="{color}">'
                     f'<title>{_e(unit_fmt(value))} of {_e(unit_fmt(full))}</title></rect>')
        parts.append(f'<text x="{width - 150}" y="{y + 13}">{_e(note)}</text>')
    parts.append("</svg>")
    return "".join(parts)


def render_report(title: str, sim: SimResult, cluster: Cluster, extra: dict[str, Any] | None = None,
                  graph_svg: str | None = None) -> str:
    """The report page as one HTML string (module docstring)."""
    out = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
           f"<title>{_e(title)}</title><style>{_CSS}</style></head><body>", f"<h1>{_e(title)}</h1>"]
    summary = [("cluster", cluster.name), ("ranks", sim.num_ranks), ("micro-batches", sim.microbatches),
               ("batch size", sim.batch_size), ("step latency", fmt_seconds(sim.step_latency)),
               ("throughput", f"{sim.throughput:.4g} samples/s"),
               ("fits in memory", "yes" if sim.fits else "NO")]
    for k, v in (extra or {}).items():
        summary.append((str(k), v if isinstance(v, (str, int, float)) else str(v)))
    out.append("<h2>Summary</h2><table>")
    for k, v in summary:
        cls = ' class="l bad"' if (k == "fits in memory" and v == "NO") else ' class="l"'
        out.append(f'<tr><th class="l">{_e(k)}</th><td{cls}>{_e(v)}</td></tr>')
    out.append("</table>")

    out.append("<h2>Per device</h2><table><tr><th>rank</th><th class='l'>device</th><th>compute</th>"
               "<th>comm</th><th>idle</th><th>peak memory</th><th>capacity</th></tr>")
    for r in range(sim.num_ranks):
        over = sim.peak_memory[r] > sim.memory_capacity[r]
        out.append(f"<tr><td>{r}</td><td class='l'>{_e(sim.device_names[r])}</td>"
                   f"<td>{_e(fmt_seconds(sim.compute_time[r]))}</td><td>{_e(fmt_seconds(sim.comm_time[r]))}</td>"
                   f"<td>{_e(fmt_seconds(sim.idle_time[r]))}</td>"
                   f"<td{' class=bad' if over else ''}>{_e(fmt_bytes(sim.peak_memory[r]))}</td>"
                   f"<td>{_e(fmt_bytes(sim.memory_capacity[r]))}</td></tr>")
    out.append("</table>")

    out.append("<h2>Timeline</h2><div class='legend'>" + "".join(
        f"<span style='background:{c}'></span>{_e(k)}" for k, c in COLORS.items()) + "</div>")
    out.append(_gantt(sim))

    out.append("<h2>Memory per device</h2>")
    out.append(_bars([(f"{r}: {sim.device_names[r]}", sim.peak_memory[r], sim.memory_capacity[r],
                       f"{100 * sim.peak_memory[r] / sim.memory_capacity[r]:.1f}%")
                      for r in range(sim.num_ranks)], fmt_bytes))

    out.append("<h2>Bytes moved per link level</h2>")
    if sim.bytes_per_level:
        top = max(sim.bytes_per_level.values()) or 1.0
        out.append(_bars([(k, v, top, fmt_bytes(v)) for k, v in sim.bytes_per_level.items()], fmt_bytes))
    else:
        out.append("<p>No communication.</p>")
    out.append("<table><tr><th class='l'>level</th><th>α</th><th>bandwidth</th></tr>")
    for lv in cluster.levels:
        out.append(f"<tr><td class='l'>{_e(lv.name)}</td><td>{_e(fmt_seconds(lv.alpha_s))}</td>"
                   f"<td>{_e(fmt_bytes(lv.bandwidth))}/s</td></tr>")
    out.append("</table>")

    if graph_svg:
        out.append("<h2>Graph</h2>")
        out.append(graph_svg)
    out.append("</body></html>")
    return "\n".join(out)
