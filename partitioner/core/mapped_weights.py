"""A rank's weights, memory-mapped from its ``rank<i>.data`` (docs/large_models.md).

Rules:
1. :func:`map_rank_weights` gives every external initializer of a program loaded without its
   data (``onnx.load(..., load_external_data=False)``) as a read-only ``np.memmap`` of its bytes.
   Nothing is read until a kernel touches a page, and the pages belong to the page cache
   (shared, evictable): a rank's resident memory is what it touches, never a second copy.
2. Locations must be plain names relative to the program's folder (the artifact's own files,
   whose hashes were checked before loading); anything else is refused with one line.
3. A reference that still records a slice of a source tensor (``partitioner.slice``, made while
   lowering) is not a rank file's; it is refused here (lowering's ``read_shard`` reads those).
It lives on the ground floor so that backends can use it.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np
import onnx
from onnx import helper

from partitioner.core.errors import ModelLoadError


def has_unloaded_weights(program: onnx.ModelProto) -> bool:
    """True when some initializer of ``program`` is an external reference without its bytes."""
    return any(t.data_location == onnx.TensorProto.EXTERNAL and not t.raw_data for t in program.graph.initializer)


def map_rank_weights(program: onnx.ModelProto, base_dir: str | os.PathLike[str], *,
                     mode: str = "r") -> dict[str, np.ndarray]:
    """Rule 1: name -> memmap of every unloaded external initializer of ``program``: read-only
    (``mode="r"``), or copy-on-write (``"c"``: writeable for APIs that insist, e.g. DLPack, yet
    the file is never changed and the pages stay shared until written)."""
    out: dict[str, np.ndarray] = {}
    for t in program.graph.initializer:
        if t.data_location != onnx.TensorProto.EXTERNAL or t.raw_data:
            continue
        if any(e.key == "partitioner.slice" for e in t.metadata_props):
            raise ModelLoadError(f"tensor {t.name!r}: a lowering slice reference, not a rank data file's tensor")
        info = {e.key: e.value for e in t.external_data}
        loc = info.get("location", "")
        if not loc or "/" in loc or "\\" in loc or loc in (".", ".."):
            raise ModelLoadError(f"tensor {t.name!r}: external data location {loc!r} must be a file beside the program")
        dtype = np.dtype(helper.tensor_dtype_to_np_dtype(t.data_type))
        dims = tuple(int(d) for d in t.dims)
        path = Path(base_dir) / loc
        offset = int(info.get("offset", 0))
        nbytes = math.prod(dims) * dtype.itemsize
        if not path.is_file() or offset + nbytes > path.stat().st_size:
            raise ModelLoadError(f"tensor {t.name!r}: {path} does not hold bytes {offset}..{offset + nbytes}")
        if nbytes == 0:
            out[t.name] = np.zeros(dims, dtype)
            continue
        out[t.name] = np.memmap(path, dtype=dtype, mode=mode, offset=offset, shape=dims)
    return out


__all__ = ["has_unloaded_weights", "map_rank_weights"]
