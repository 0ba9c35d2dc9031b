"""Seeded inputs for a model: the one place tests and benchmarks get their feeds from.

Rules:
1. Float inputs are standard normal, drawn from ``numpy.random.default_rng(seed)`` in input order.
2. Integer inputs (token ids, indices) are uniform in ``[0, high)``, where ``high`` is the
   smallest table size along the gathered axis over the ``Gather`` nodes that read the input
   (so ids are always valid), or ``default_high`` when no Gather reads it.
3. Boolean inputs are all True. Initializers listed as graph inputs (IR < 4) are not fed.
Shapes must be static (bind symbolic dims first).
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper

from partitioner.core.errors import UsageError


def _gather_bounds(model: onnx.ModelProto) -> dict[str, int]:
    shapes = {t.name: list(t.dims) for t in model.graph.initializer}
    for vi in list(model.graph.input) + list(model.graph.value_info):
        dims = vi.type.tensor_type.shape.dim
        if all(d.HasField("dim_value") for d in dims):
            shapes.setdefault(vi.name, [d.dim_value for d in dims])
    bounds: dict[str, int] = {}
    for node in model.graph.node:
        if node.op_type != "Gather" or len(node.input) < 2 or node.input[0] not in shapes:
            continue
        axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
        table = shapes[node.input[0]]
        size = table[axis % len(table)] if table else 0
        if size > 0:
            bounds[node.input[1]] = min(bounds.get(node.input[1], size), size)
    return bounds


def sample_inputs(model: onnx.ModelProto, seed: int = 0, default_high: int = 2) -> dict[str, np.ndarray]:
    """Seeded feeds for every non-initializer graph input of ``model`` (rules above)."""
    rng = np.random.default_rng(seed)
    inits = {t.name for t in model.graph.initializer}
    bounds = _gather_bounds(model)
    feeds: dict[str, np.ndarray] = {}
    for vi in model.graph.input:
        if vi.name in inits:
            continue
        tt = vi.type.tensor_type
        dims = list(tt.shape.dim)
        if not all(d.HasField("dim_value") for d in dims):
            raise UsageError(f"input {vi.name!r} has a symbolic shape; bind it before drawing inputs")
        shape = [d.dim_value for d in dims]
        dtype = np.dtype(helper.tensor_dtype_to_np_dtype(tt.elem_type))
        if dtype.kind == "f":
            feeds[vi.name] = rng.standard_normal(shape).astype(dtype)
        elif dtype.kind == "b":
            feeds[vi.name] = np.ones(shape, dtype=dtype)
        else:
            feeds[vi.name] = rng.integers(0, bounds.get(vi.name, default_high), shape).astype(dtype)
    return feeds
