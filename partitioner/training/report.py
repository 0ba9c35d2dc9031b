"""The run folder's ``report.html``: the loss curve as an inline SVG (no script, no download),
with the run's settings, so a browser shows training progress from the folder alone."""

from __future__ import annotations

import html
import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

_W, _H, _PAD = 720, 320, 48


def loss_curve_svg(losses: Sequence[float]) -> str:
    """A polyline of loss against step, axes labelled with the first/last step and min/max loss."""
    pts = [(i + 1, v) for i, v in enumerate(losses) if math.isfinite(v)]
    if not pts:
        return "<p>no finite loss recorded</p>"
    lo, hi = min(v for _, v in pts), max(v for _, v in pts)
    span = (hi - lo) or 1.0
    n = max(len(losses), 2)

    def xy(step: int, v: float) -> str:
        x = _PAD + (step - 1) / (n - 1) * (_W - 2 * _PAD)
        y = _H - _PAD - (v - lo) / span * (_H - 2 * _PAD)
        return f"{x:.1f},{y:.1f}"

    line = " ".join(xy(s, v) for s, v in pts)
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{_W}" height="{_H}" role="img" aria-label="loss curve">'
            f'<rect width="{_W}" height="{_H}" fill="white"/>'
            f'<line x1="{_PAD}" y1="{_H - _PAD}" x2="{_W - _PAD}" y2="{_H - _PAD}" stroke="#444"/>'
            f'<line x1="{_PAD}" y1="{_PAD}" x2="{_PAD}" y2="{_H - _PAD}" stroke="#444"/>'
            f'<polyline fill="none" stroke="#1f77b4" stroke-width="1.5" points="{line}"/>'
            f'<text x="{_PAD}" y="{_H - _PAD + 16}" font-size="12">step 1</text>'
            f'<text x="{_W - _PAD}" y="{_H - _PAD + 16}" font-size="12" text-anchor="end">step {len(losses)}</text>'
            f'<text x="{_PAD - 4}" y="{_PAD + 4}" font-size="12" text-anchor="end">{hi:.3g}</text>'
            f'<text x="{_PAD - 4}" y="{_H - _PAD}" font-size="12" text-anchor="end">{lo:.3g}</text></svg>')


def run_report_html(settings: Mapping[str, Any], history: Sequence[Mapping[str, Any]],
                    checkpoints: Sequence[str]) -> str:
    losses = [float(h["loss"]) for h in history]
    rows = "".join(f"<tr><th>{html.escape(str(k))}</th><td>{html.escape(json.dumps(v))}</td></tr>"
                   for k, v in settings.items())
    ck = "".join(f"<li>{html.escape(c)}</li>" for c in checkpoints)
    last = f"{losses[-1]:.4f}" if losses else "-"
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>training run</title></head><body>"
            f"<h1>Training run</h1><p>{len(losses)} steps, last loss {last}</p>{loss_curve_svg(losses)}"
            f"<h2>Settings</h2><table>{rows}</table><h2>Checkpoints</h2><ul>{ck}</ul></body></html>")
