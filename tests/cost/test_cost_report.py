"""The HTML report is self-contained and well-formed, and shows the numbers it was given."""

from __future__ import annotations

import re
from html.parser import HTMLParser

from test_cost_simulate import cluster, stage

from partitioner.cost.simulate import simulate
from partitioner.report_html import render_report


class _Collect(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.tags: list[str] = []
        self.stack: list[str] = []

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        if tag not in ("meta", "br", "img", "link"):
            self.stack.append(tag)

    def handle_startendtag(self, tag, attrs):
        self.tags.append(tag)

    def handle_endtag(self, tag):
        assert self.stack and self.stack[-1] == tag, f"unbalanced </{tag}> (open: {self.stack[-3:]})"
        self.stack.pop()


def test_report_is_self_contained():
    p, m = 4, 4
    c = cluster(p)
    sim = simulate([stage(r, p) for r in range(p)], c, microbatches=m, batch_size=m)
    page = render_report("pipeline <demo> & co", sim, c, extra={"strategy": "pipeline"},
                         graph_svg='<svg xmlns="http://www.w3.org/2000/svg" width="10" height="10"></svg>')
    parser = _Collect()
    parser.feed(page)
    parser.close()
    assert not parser.stack
    assert "svg" in parser.tags and "rect" in parser.tags and "table" in parser.tags
    urls = re.findall(r"https?://[^\s\"'<>]*", page)
    assert urls and all(u == "http://www.w3.org/2000/svg" for u in urls)
    assert "<script" not in page and "@import" not in page and "url(" not in page
    assert "pipeline &lt;demo&gt; &amp; co" in page  # escaped title
    # one row per rank in the device table, and rects for every event kind
    for r in range(p):
        assert f"<td>{r}</td>" in page
    for color in ("#4c78a8", "#f58518", "#d9d9d9"):
        assert color in page
