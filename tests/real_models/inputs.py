"""Seeded inputs for a corpus model, in the ranges the model expects.

Rule: an input listed under the entry's ``input_ranges`` (``{"bytes": [0, 255]}``) gets seeded
integers in that closed range, in the input's dtype (magika reads byte values, not noise); other
float inputs get N(0, 1), integer inputs 0 or 1, bool inputs True. Shapes are the entry's
``shapes`` bindings, else the model's static input shapes; ``consts`` inputs are not fed (they are
bound at compile time) but :func:`const_feeds` gives them for running the original model.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
from onnx import helper


def _inputs(proto: onnx.ModelProto) -> list[onnx.ValueInfoProto]:
    inits = {t.name for t in proto.graph.initializer}
    return [i for i in proto.graph.input if i.name not in inits]


def seeded_feeds(entry: dict[str, Any], proto: onnx.ModelProto, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    feeds: dict[str, np.ndarray] = {}
    for vi in _inputs(proto):
        if vi.name in entry.get("consts", {}):
            continue
        tt = vi.type.tensor_type
        dtype = np.dtype(helper.tensor_dtype_to_np_dtype(tt.elem_type))
        shape = entry.get("shapes", {}).get(vi.name) or [d.dim_value for d in tt.shape.dim]
        lo_hi = entry.get("input_ranges", {}).get(vi.name)
        if lo_hi is not None:
            feeds[vi.name] = rng.integers(lo_hi[0], lo_hi[1] + 1, size=shape).astype(dtype)
        elif dtype.kind == "f":
            feeds[vi.name] = rng.standard_normal(shape).astype(dtype)
        elif dtype.kind == "b":
            feeds[vi.name] = np.ones(shape, dtype=dtype)
        else:
            feeds[vi.name] = rng.integers(0, 2, size=shape).astype(dtype)
    return feeds


def const_feeds(entry: dict[str, Any], proto: onnx.ModelProto) -> dict[str, np.ndarray]:
    """The ``consts`` bindings as feeds of the original model (for ONNX Runtime on it)."""
    out = {}
    for vi in _inputs(proto):
        if vi.name in entry.get("consts", {}):
            dtype = helper.tensor_dtype_to_np_dtype(vi.type.tensor_type.elem_type)
            value = np.asarray(entry["consts"][vi.name], dtype=dtype)
            rank = len(vi.type.tensor_type.shape.dim)
            out[vi.name] = value.reshape(()) if rank == 0 else value.reshape(-1)
    return out
