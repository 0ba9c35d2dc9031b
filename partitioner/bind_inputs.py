"""Binding a model's inputs before anything else sees it: legacy dynamic dims, shapes, constants.

Rules (they run on the ``ModelProto`` inside :func:`partitioner.load.load_proto`, before the
checker and shape inference):

1. **Legacy dynamic dimensions.** Older exporters write ``dim_value: -1`` (any negative value)
   for a dynamic dimension; ONNX Runtime treats it as unknown, and so do we: every negative
   ``dim_value`` of every graph input, output and ``value_info`` (subgraphs included) is cleared
   to an unknown dimension, which ``--shape`` can bind and the loader lists when unbound.
2. **Constants** (``--const NAME=VALUE``, ``constants={...}``). A bound input becomes an
   initializer of the input's dtype: a scalar for a rank-0 input, otherwise the value (a single
   number is broadcast) in the input's static shape, or a 1-D tensor of the given values when the
   shape is unknown. Folding passes then see it as a constant (an ``If`` on it folds,
   ``passes/fold_constant_if.py``).
3. **Shapes.** ``--shape NAME=D0,D1,..`` binds every axis of an input; ``--batch N`` binds axis 0
   of inputs not named by ``--shape``. A symbolic name bound anywhere is bound everywhere it
   appears (other inputs, outputs and ``value_info`` of every graph and subgraph); symbolic names
   that stay unbound on outputs and intermediates are cleared so shape inference recomputes them
   from the bound inputs (exporter names like ``unk__215`` on an intermediate are not inputs to
   bind).
4. Every input axis still unbound is listed in **one** message, with a ready ``--shape`` option
   per input, so a user fixes them all in one go instead of one per run.
5. The same message names the scalar inputs whose **value** decides a branch or a loop (an
   ``If`` condition, a ``Loop`` trip count or condition, reached backwards through the graph
   without crossing a ``Shape``/``Size``), with a ready ``--const`` option: without it the branch
   stays dynamic and, when its branches disagree on shapes, the next run stops there instead.
   Only integer or bool inputs of at most one element are named (a data tensor feeding a
   computed condition, as in openwakeword's verifier head, is not something to bind).
6. **The reference model of a build with constants** (``run --check``, ``bench --baseline
   onnxruntime``) is the model as given, its inputs unbound, with each bound input kept as an
   input and given its value as an initializer of the same name (ONNX's overridable default), so
   ONNX Runtime runs the model's own branch selection at run time. Why: with the inputs' shapes
   bound and the value baked in, ONNX Runtime 1.32 constant-folds the ``If`` and infers shapes
   in the branch not taken, which are inconsistent there (silero-vad's 8 kHz branch with a
   512-sample window): it segfaults while creating the session.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper

from partitioner.core.errors import ModelLoadError, UsageError


def _graphs(graph: onnx.GraphProto) -> Iterator[onnx.GraphProto]:
    yield graph
    for node in graph.node:
        for attr in node.attribute:
            for sub in ([attr.g] if attr.HasField("g") else []) + list(attr.graphs):
                yield from _graphs(sub)


def _typed_values(proto: onnx.ModelProto) -> Iterator[onnx.ValueInfoProto]:
    for g in _graphs(proto.graph):
        yield from g.input
        yield from g.output
        yield from g.value_info


def clear_legacy_dims(proto: onnx.ModelProto) -> int:
    """Rule 1: negative ``dim_value`` -> unknown dimension. Returns how many were cleared."""
    cleared = 0
    for vi in _typed_values(proto):
        tt = vi.type.tensor_type
        if not tt.HasField("shape"):
            continue
        for d in tt.shape.dim:
            if d.HasField("dim_value") and d.dim_value < 0:
                d.Clear()
                cleared += 1
    return cleared


def parse_const_option(items: Sequence[str] | None) -> dict[str, list[float | int | bool]]:
    """``--const sr=16000 --const mask=1,0,1`` -> ``{'sr': [16000], 'mask': [1, 0, 1]}``."""
    out: dict[str, list[Any]] = {}
    for item in items or []:
        name, sep, text = item.partition("=")
        if not sep or not name or not text.strip():
            raise UsageError(f"--const {item!r}: expected NAME=VALUE or NAME=V0,V1,... e.g. sr=16000")
        values: list[Any] = []
        for tok in text.split(","):
            tok = tok.strip()
            if tok.lower() in ("true", "false"):
                values.append(tok.lower() == "true")
                continue
            try:
                values.append(int(tok))
            except ValueError:
                try:
                    values.append(float(tok))
                except ValueError:
                    raise UsageError(f"--const {item!r}: {tok!r} is not a number") from None
        out[name] = values
    return out


def bind_constants(proto: onnx.ModelProto, label: str, constants: Mapping[str, Any]) -> None:
    """Rule 2: turn each named graph input into an initializer holding the given value."""
    if not constants:
        return
    g = proto.graph
    inits = {t.name for t in g.initializer}
    real = {i.name: i for i in g.input if i.name not in inits}
    unknown = [n for n in constants if n not in real]
    if unknown:
        raise ModelLoadError(f"{label}: --const names unknown input(s) {', '.join(unknown)}; "
                             f"inputs are {', '.join(sorted(real))}")
    for name, value in constants.items():
        vi = real[name]
        tt = vi.type.tensor_type
        if not vi.type.HasField("tensor_type") or tt.elem_type == onnx.TensorProto.UNDEFINED:
            raise ModelLoadError(f"{label}: --const {name}: only tensor inputs can be bound to a value")
        dtype = helper.tensor_dtype_to_np_dtype(tt.elem_type)
        try:
            arr = np.asarray(value, dtype=dtype)
        except (TypeError, ValueError) as exc:
            raise ModelLoadError(f"{label}: --const {name}: cannot make a {dtype} tensor of {value!r}: {exc}") from None
        dims = list(tt.shape.dim) if tt.HasField("shape") else None
        if dims is not None and all(d.HasField("dim_value") and d.dim_value >= 0 for d in dims):
            shape = [d.dim_value for d in dims]
            if arr.size == 1:
                arr = np.full(shape, arr.reshape(()), dtype=dtype)
            elif list(arr.shape) != shape:
                if not shape:
                    raise ModelLoadError(f"{label}: --const {name}: the input is a scalar but {arr.size} values were given")
                if arr.size != int(np.prod(shape)):
                    raise ModelLoadError(f"{label}: --const {name}: {arr.size} value(s) given but the input has "
                                         f"shape {shape}")
                arr = arr.reshape(shape)
        elif dims is not None and len(dims) == 0:
            if arr.size != 1:
                raise ModelLoadError(f"{label}: --const {name}: the input is a scalar but {arr.size} values were given")
            arr = arr.reshape(())
        elif arr.ndim == 1 and arr.size == 1 and dims is not None and len(dims) != 1:
            raise ModelLoadError(f"{label}: --const {name}: the input has rank {len(dims)} with unknown dimensions; "
                                 "give its shape with --shape as well, or all its values")
        elif arr.ndim == 0 and dims is not None and len(dims) == 1:
            arr = arr.reshape((1,))
        keep = [i for i in g.input if i.name != name]
        del g.input[:]
        g.input.extend(keep)
        g.initializer.append(numpy_helper.from_array(arr, name))


def bind_dims(proto: onnx.ModelProto, label: str, batch: int | None, shapes: Mapping[str, Sequence[int]]) -> None:
    """Rules 3 and 4 (``shapes`` and ``batch`` as the CLI's ``--shape`` / ``--batch``)."""
    g = proto.graph
    inits = {t.name for t in g.initializer}
    real_inputs = [i for i in g.input if i.name not in inits]
    names = {i.name for i in real_inputs}
    unknown = [n for n in shapes if n not in names]
    if unknown:
        raise ModelLoadError(f"{label}: --shape names unknown input(s) {', '.join(unknown)}; "
                             f"inputs are {', '.join(sorted(names))}")
    if batch is not None and batch < 1:
        raise ModelLoadError(f"{label}: --batch must be at least 1")
    params: dict[str, int] = {}
    for vi in real_inputs:
        dims = vi.type.tensor_type.shape.dim
        if vi.name in shapes:
            want = list(shapes[vi.name])
            if len(want) != len(dims):
                raise ModelLoadError(f"{label}: --shape {vi.name}: {len(want)} dims given but the input has rank {len(dims)}")
            for axis, (d, w) in enumerate(zip(dims, want)):
                if d.HasField("dim_value") and d.dim_value != w:
                    raise ModelLoadError(f"{label}: --shape {vi.name}: axis {axis}: dimension {d.dim_value} is fixed, "
                                         f"cannot bind {w}")
                if d.HasField("dim_param"):
                    params[d.dim_param] = w
                d.dim_value = w
        elif batch is not None and dims and not dims[0].HasField("dim_value"):
            if dims[0].HasField("dim_param"):
                params[dims[0].dim_param] = batch
            dims[0].dim_value = batch
    missing: list[tuple[onnx.ValueInfoProto, list[tuple[int, str]]]] = []
    for vi in real_inputs:
        if not vi.type.HasField("tensor_type"):
            continue
        if not vi.type.tensor_type.HasField("shape"):
            missing.append((vi, [(-1, "rank unknown")]))
            continue
        axes = []
        for axis, d in enumerate(vi.type.tensor_type.shape.dim):
            if d.HasField("dim_param") and d.dim_param in params:
                d.dim_value = params[d.dim_param]
            if not d.HasField("dim_value"):
                axes.append((axis, d.dim_param or "?"))
        if axes:
            missing.append((vi, axes))
    if missing:
        raise ModelLoadError(f"{label}: {_missing_message(missing)}{_const_hint(proto, inits)}")
    bound = {id(vi) for vi in real_inputs}
    for vi in _typed_values(proto):
        if id(vi) in bound:
            continue
        for d in vi.type.tensor_type.shape.dim:
            if d.HasField("dim_param"):
                if d.dim_param in params:
                    d.dim_value = params[d.dim_param]
                else:
                    d.Clear()


_SHAPE_ONLY = frozenset({"Shape", "Size"})  # their output reads an input's shape, not its value
_INT_OR_BOOL = frozenset({onnx.TensorProto.BOOL, onnx.TensorProto.INT8, onnx.TensorProto.INT16,
                          onnx.TensorProto.INT32, onnx.TensorProto.INT64, onnx.TensorProto.UINT8,
                          onnx.TensorProto.UINT16, onnx.TensorProto.UINT32, onnx.TensorProto.UINT64})


def branch_value_inputs(proto: onnx.ModelProto, inits: set[str] | None = None) -> list[str]:
    """Rule 5: graph inputs (integer/bool, at most one element) whose value an ``If`` condition
    or a ``Loop``'s trip count/condition reads, in graph-input order."""
    g = proto.graph
    inits = inits if inits is not None else {t.name for t in g.initializer}
    producer = {o: n for sub in _graphs(g) for n in sub.node for o in n.output if o}
    todo = [n.input[k] for sub in _graphs(g) for n in sub.node if n.domain in ("", "ai.onnx")
            for k in ({"If": (0,), "Loop": (0, 1)}.get(n.op_type, ())) if k < len(n.input) and n.input[k]]
    seen: set[str] = set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        node = producer.get(name)
        if node is not None and node.op_type not in _SHAPE_ONLY:
            todo.extend(i for i in node.input if i)
    found = []
    for vi in g.input:
        tt = vi.type.tensor_type
        if vi.name not in seen or vi.name in inits or tt.elem_type not in _INT_OR_BOOL:
            continue
        dims = tt.shape.dim if tt.HasField("shape") else None
        if dims is None or all(d.HasField("dim_value") and d.dim_value == 1 for d in dims):
            found.append(vi.name)
    return found


def _const_hint(proto: onnx.ModelProto, inits: set[str]) -> str:
    names = branch_value_inputs(proto, inits)
    if not names:
        return ""
    return (f"; and input(s) {', '.join(repr(n) for n in names)} decide an If or Loop by their value: "
            f"{' '.join(f'--const {n}=VALUE' for n in names)}")


def _missing_message(missing: list[tuple[onnx.ValueInfoProto, list[tuple[int, str]]]]) -> str:
    """One message listing every input axis to bind, and the options that would bind them."""
    count = sum(len(axes) for _, axes in missing)
    parts, options = [], []
    for vi, axes in missing:
        if axes and axes[0][0] < 0:
            parts.append(f"input {vi.name!r} (rank unknown)")
            options.append(f"--shape {vi.name}=D0,D1,...")
            continue
        parts.append(f"input {vi.name!r} has " + ", ".join(
            f"an unknown dimension at axis {a}" if s == "?" else f"a symbolic dimension {s!r} at axis {a}"
            for a, s in axes))
        dims = [str(d.dim_value) if d.HasField("dim_value") else (d.dim_param or f"D{i}")
                for i, d in enumerate(vi.type.tensor_type.shape.dim)]
        options.append(f"--shape {vi.name}={','.join(dims)}")
    batch_only = all(axes == [(0, axes[0][1])] and axes[0][0] == 0 for _, axes in missing)
    hint = " (or --batch N)" if batch_only else ""
    return (f"{count} input dimension(s) to bind: {'; '.join(parts)}; bind them with {' '.join(options)}{hint}")


def reference_with_constant_defaults(model: Any, constants: Mapping[str, Any], label: str = "model") -> onnx.ModelProto:
    """Rule 6: ``model`` (a path or ``ModelProto``, not modified) with every bound input kept as an
    input whose initializer holds the value ``bind_constants`` gives it."""
    import os

    if isinstance(model, onnx.ModelProto):
        proto = onnx.ModelProto()
        proto.CopyFrom(model)
    else:
        proto = onnx.load(os.fspath(model))
    clear_legacy_dims(proto)
    bound = onnx.ModelProto()
    bound.CopyFrom(proto)
    bind_constants(bound, label, constants)
    values = {t.name: t for t in bound.graph.initializer if t.name in constants}
    proto.graph.initializer.extend(values[name] for name in constants)
    return proto

