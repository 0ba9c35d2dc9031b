"""A dependency-free text progress display for building many ranks: one line per rank and stage.

On a TTY the block of lines is redrawn in place; elsewhere (logs, CI) each stage change is printed
once as a plain line, so the output stays readable when captured.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

STAGES = ("queued", "import", "build", "export", "done")
_WIDTH = 20


class BuildProgress:
    """Shows ``rank<i>: [#####.....] stage  12.3s`` for every rank being built."""

    def __init__(self, ranks: list[int], *, enabled: bool | None = None, stream: TextIO | None = None) -> None:
        self.stream = stream or sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.enabled = self.tty if enabled is None else enabled
        self.ranks = list(ranks)
        self.stage = {r: "queued" for r in ranks}
        self.note = {r: "" for r in ranks}
        self.started = time.monotonic()
        self._drawn = 0
        if self.enabled and self.tty:
            self._draw()

    def update(self, rank: int, stage: str, note: str = "") -> None:
        if rank not in self.stage or self.stage[rank] == stage:
            return
        self.stage[rank], self.note[rank] = stage, note
        if not self.enabled:
            return
        if self.tty:
            self._draw()
        else:
            self.stream.write(self._line(rank) + "\n")
            self.stream.flush()

    def close(self) -> None:
        if self.enabled and self.tty:
            self._draw()

    def _line(self, rank: int) -> str:
        stage = self.stage[rank]
        k = STAGES.index(stage) if stage in STAGES else 0
        filled = round(_WIDTH * k / (len(STAGES) - 1))
        bar = "#" * filled + "." * (_WIDTH - filled)
        note = f" {self.note[rank]}" if self.note[rank] else ""
        return f"rank{rank}: [{bar}] {stage:<6} {time.monotonic() - self.started:6.1f}s{note}"

    def _draw(self) -> None:
        out = self.stream
        if self._drawn:
            out.write(f"\x1b[{self._drawn}F")
        for r in self.ranks:
            out.write("\x1b[2K" + self._line(r) + "\n")
        self._drawn = len(self.ranks)
        out.flush()
