"""Weights that stay on disk: shard references for lowering, and reading them in for a build.

A model loaded with external data keeps each large initializer as an ``onnx_ir.ExternalTensor``
(:mod:`partitioner.load`): a path, an offset and a length, memory-mapped only when its values
are asked for. Planning a 70B model must never ask.

Rules:

1. :func:`shard_reference` turns one rank's piece of a lazy weight (the whole tensor, or chunk
   ``k`` of ``n`` along ``axis``) into an external-data ``TensorProto`` with the piece's dims and
   no bytes. When the piece is one contiguous run of the source (no axis, or every axis before
   ``axis`` has size 1) its offset and length address exactly that run, so the reference is a
   valid ONNX external tensor. Otherwise the reference keeps the source's offset, the piece's
   length, and records the slice in the tensor's ``metadata_props`` under :data:`SLICE_KEY`
   (``axis,start,stop,d0xd1x...`` of the source): whoever writes the rank's data file later
   streams the slice from the source. Nothing is read either way.
2. :func:`read_shard` reads one such reference back (memory-mapping the source and copying only
   the piece); :func:`with_shards_read` returns programs whose references are filled in, one
   rank at a time, for a backend that wants bytes in the protobuf.
4. :func:`write_rank_program` writes one rank's program as ``rank<i>.onnx`` plus
   ``rank<i>.data`` holding only that rank's weights: each initializer of at least
   ``RANK_DATA_MIN_BYTES`` is appended to the data file, one tensor at a time (a lazy reference
   is streamed from the source model's folder, a piece at a time), page (4096-byte) aligned, and the
   protobuf keeps a reference to it. The artifact's manifest hashes the data file like every
   other file, so a changed byte is refused before anything loads.
5. :func:`map_rank_weights` (:mod:`partitioner.core.mapped_weights`) memory-maps a rank program's weights from its ``rank<i>.data`` for
   the worker: a rank's resident memory is the pages its kernels touch, never a second copy.
3. :func:`read_in_external` turns every lazy initializer of a model into an in-memory tensor,
   for the paths that still need every weight inside one process (a compile of an in-memory
   ``ir.Model``, whose source must be serialised; a compile from a path streams instead). It refuses, with one line, a model whose external weights exceed ``max_bytes``
   (default: protobuf's 2 GB, the limit of the per-rank programs the build serialises) before
   reading anything.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
from onnx import helper, numpy_helper

from partitioner.core.errors import ModelLoadError
from partitioner.core.mapped_weights import map_rank_weights

SLICE_KEY = "partitioner.slice"
RANK_DATA_MIN_BYTES = 64 * 1024
_DATA_ALIGN = 4096  # a page: ONNX Runtime memory-maps external data only at page-aligned offsets
MAX_INLINE_TOTAL = 2**31 - 1


def is_lazy(tensor: object) -> bool:
    """An initializer whose bytes are still on disk."""
    return isinstance(tensor, ir.ExternalTensor)


def shard_reference(name: str, tensor: ir.ExternalTensor, axis: int | None = None, k: int = 0,
                    n: int = 1) -> onnx.TensorProto:
    """Rule 1: chunk ``k`` of ``n`` of ``tensor`` along ``axis`` (the whole tensor when ``axis`` is
    None) as an external-data reference named ``name``; no byte is read."""
    dims = [int(d) for d in tensor.shape]
    itemsize = tensor.dtype.itemsize
    proto = onnx.TensorProto(name=name, data_type=int(tensor.dtype))
    offset = int(tensor.offset or 0)
    if axis is None or n == 1:
        piece = dims
        start = 0
    else:
        size = dims[axis] // n
        piece = list(dims)
        piece[axis] = size
        start = k * size
        if math.prod(dims[:axis]) == 1:
            offset += start * math.prod(dims[axis + 1:]) * int(itemsize)
        else:
            entry = proto.metadata_props.add()
            entry.key = SLICE_KEY
            entry.value = f"{axis},{start},{start + size},{'x'.join(str(d) for d in dims)}"
    proto.dims.extend(piece)
    proto.data_location = onnx.TensorProto.EXTERNAL
    length = int(math.prod(piece) * itemsize)
    for key, value in (("location", str(tensor.location)), ("offset", str(offset)), ("length", str(length))):
        entry = proto.external_data.add()
        entry.key, entry.value = key, value
    return proto


def read_shard(proto: onnx.TensorProto, base_dir: str | os.PathLike[str], *, copy: bool = True) -> np.ndarray:
    """Rule 2: the values of a reference made by :func:`shard_reference` (or any plain external
    tensor), read from ``base_dir``; only the piece's pages are touched. ``copy=False`` returns
    a contiguous piece as the read-only map itself (a slice is always copied)."""
    info = {e.key: e.value for e in proto.external_data}
    loc = info.get("location", "")
    if not loc or Path(loc).is_absolute() or ".." in Path(loc.replace("\\", "/")).parts:
        raise ModelLoadError(f"tensor {proto.name!r}: external data location {loc!r} must be relative to the model's folder")
    dtype = np.dtype(helper.tensor_dtype_to_np_dtype(proto.data_type))
    offset = int(info.get("offset", 0))
    dims = [int(d) for d in proto.dims]
    meta = {e.key: e.value for e in proto.metadata_props}
    path = Path(base_dir) / loc
    if SLICE_KEY not in meta:
        mapped = np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=tuple(dims))
        return np.array(mapped) if copy else mapped
    axis_s, start_s, stop_s, full_s = meta[SLICE_KEY].split(",")
    full = tuple(int(d) for d in full_s.split("x"))
    source = np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=full)
    index = [slice(None)] * len(full)
    index[int(axis_s)] = slice(int(start_s), int(stop_s))
    return np.ascontiguousarray(source[tuple(index)])


def with_shards_read(programs: Sequence[onnx.ModelProto], base_dir: str | os.PathLike[str]) -> tuple[onnx.ModelProto, ...]:
    """Copies of ``programs`` whose external initializers hold their bytes (rule 2)."""
    out = []
    for program in programs:
        copy = onnx.ModelProto()
        copy.CopyFrom(program)
        inits = copy.graph.initializer
        for i, t in enumerate(inits):
            if t.data_location == onnx.TensorProto.EXTERNAL:
                inits[i].CopyFrom(numpy_helper.from_array(read_shard(t, base_dir), t.name))
        out.append(copy)
    return tuple(out)


def write_rank_program(program: onnx.ModelProto, folder: str | os.PathLike[str], rank: int, *,
                       base_dir: str | os.PathLike[str] | None = None,
                       min_bytes: int = RANK_DATA_MIN_BYTES) -> list[str]:
    """Rule 4: write ``rank<rank>.onnx`` (and ``rank<rank>.data`` when the rank holds a weight of
    at least ``min_bytes``) into ``folder``; ``program`` is not changed. Returns the file names."""
    folder = Path(folder)
    data_name = f"rank{rank}.data"
    copy = onnx.ModelProto()
    copy.CopyFrom(program)
    offset = 0
    fh = None
    try:
        for t in copy.graph.initializer:
            external = t.data_location == onnx.TensorProto.EXTERNAL
            if not external and len(t.raw_data) < min_bytes:
                continue
            if external:
                if base_dir is None:
                    raise ModelLoadError(f"rank {rank}: weight {t.name!r} is a reference to the source model's data "
                                         "but no source folder was given")
                # a contiguous piece is written straight from the map; a slice is copied once
                payload = memoryview(np.ascontiguousarray(read_shard(t, base_dir, copy=False))).cast("B")
            else:
                payload = t.raw_data
            if fh is None:
                fh = open(folder / data_name, "wb")
            pad = -offset % _DATA_ALIGN
            fh.write(b"\0" * pad)
            offset += pad
            fh.write(payload)
            t.ClearField("raw_data")
            del t.external_data[:]
            del t.metadata_props[:]
            t.data_location = onnx.TensorProto.EXTERNAL
            for key, value in (("location", data_name), ("offset", str(offset)), ("length", str(len(payload)))):
                entry = t.external_data.add()
                entry.key, entry.value = key, value
            offset += len(payload)
            del payload
    finally:
        if fh is not None:
            fh.close()
    (folder / f"rank{rank}.onnx").write_bytes(copy.SerializeToString())
    return [f"rank{rank}.onnx"] + ([data_name] if fh is not None else [])


def external_bytes(model: ir.Model) -> int:
    """Bytes of the model's initializers that are still on disk (all graphs)."""
    return sum(v.const_value.nbytes for g in model.graphs() for v in g.initializers.values()
               if is_lazy(v.const_value))


def lazy_weights_dir(model: ir.Model) -> str | None:
    """The folder the model's lazy initializers live in (what :func:`write_rank_program` streams
    shards from), or None when it has none. A model loaded from one path has one folder."""
    dirs = {str(v.const_value.base_dir) for g in model.graphs() for v in g.initializers.values()
            if is_lazy(v.const_value)}
    if len(dirs) > 1:
        raise ModelLoadError(f"{model.graph.name or '<model>'}: lazy weights in more than one folder ({sorted(dirs)})")
    return dirs.pop() if dirs else None


def read_in_external(model: ir.Model, *, max_bytes: int = MAX_INLINE_TOTAL, purpose: str = "compile") -> ir.Model:
    """Rule 2: read every lazy initializer into memory (in place); returns ``model``."""
    total = external_bytes(model)
    if total == 0:
        return model
    if total > max_bytes:
        raise ModelLoadError(
            f"{model.graph.name or '<model>'}: {total / 2**30:.2f} GiB of external weights; {purpose} of an "
            f"in-memory model holds every weight in one process and is limited to {max_bytes / 2**30:.2f} GiB; "
            "pass the model's path instead, whose weights are streamed (docs/large_models.md)"
        )
    return ir.external_data.load_to_model(model)


__all__ = ["RANK_DATA_MIN_BYTES", "SLICE_KEY", "external_bytes", "is_lazy", "lazy_weights_dir", "map_rank_weights",
           "read_in_external",
           "read_shard",
           "shard_reference", "with_shards_read", "write_rank_program"]
