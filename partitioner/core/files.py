"""Helpers for the files the project writes: their sha256, and JSON of project objects.

One copy each (artifacts, backend build facts, reports and the CLI's ``--json`` all use them):
1. :func:`sha256_file` reads in 1 MiB chunks, so a multi-GB weight file is never held in memory.
2. :func:`json_default` turns numpy scalars and arrays into plain values, objects with a
   ``to_json()`` into what it returns, sets and tuples into lists, and anything else into its
   ``str()``: a report never fails half-written on an unexpected value.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any


def sha256_file(path: str | os.PathLike[str]) -> str:
    """Rule 1: the hex sha256 of the file at ``path``."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def json_default(o: Any) -> Any:
    """Rule 2: the ``default=`` of every ``json.dump`` of ours."""
    import numpy as np

    if isinstance(o, np.generic):
        return o.item()
    if isinstance(o, np.ndarray):
        return o.tolist()
    if hasattr(o, "to_json"):
        return o.to_json()
    if isinstance(o, (set, frozenset, tuple)):
        return list(o)
    return str(o)
