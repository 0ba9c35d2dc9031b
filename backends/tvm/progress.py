"""The progress display for building many ranks: one bar per rank and stage.

On a TTY each rank is a ``tqdm`` bar (one position per rank, redrawn in place); elsewhere (logs,
CI) each stage change is printed once as a plain line, so the output stays readable when captured.
Both are drawn by ``tqdm`` from the same format (:data:`BAR_FORMAT`; the plain line through
``tqdm.format_meter`` with an ASCII bar), nothing is drawn by hand.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

STAGES = ("queued", "import", "build", "export", "done")
BAR_FORMAT = "rank{rank}: [{{bar:20}}] {{desc}} {{elapsed}}"


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
        self._bars: dict[int, object] = {}
        if self.enabled and self.tty:
            self._open_bars()

    def _open_bars(self) -> None:
        from tqdm import tqdm

        for pos, r in enumerate(self.ranks):
            self._bars[r] = tqdm(total=len(STAGES) - 1, desc=self.stage[r], position=pos, leave=True,
                                 file=self.stream, bar_format=BAR_FORMAT.format(rank=r))

    def update(self, rank: int, stage: str, note: str = "") -> None:
        if rank not in self.stage or self.stage[rank] == stage:
            return
        self.stage[rank], self.note[rank] = stage, note
        if not self.enabled:
            return
        if self.tty:
            bar = self._bars[rank]
            k = STAGES.index(stage) if stage in STAGES else 0
            bar.n = k  # type: ignore[attr-defined]
            bar.set_description_str(f"{stage:<6}{' ' + note if note else ''}", refresh=False)  # type: ignore[attr-defined]
            bar.refresh()  # type: ignore[attr-defined]
        else:
            self.stream.write(self._line(rank) + "\n")
            self.stream.flush()

    def close(self) -> None:
        for bar in self._bars.values():
            bar.close()  # type: ignore[attr-defined]
        self._bars = {}

    def _line(self, rank: int) -> str:
        from tqdm import tqdm

        stage = self.stage[rank]
        k = STAGES.index(stage) if stage in STAGES else 0
        desc = f"{stage:<6}{' ' + self.note[rank] if self.note[rank] else ''}"
        return tqdm.format_meter(k, len(STAGES) - 1, time.monotonic() - self.started, ascii=".#",
                                 prefix=desc, bar_format=BAR_FORMAT.format(rank=rank))
