"""Saving a zoo model of any size: external data above a threshold, sparse data for shapes-only.

Rules (``save_model``):

1. A model whose initializers all hold their bytes is saved as one ``.onnx`` file when its
   protobuf is at most :data:`AUTO_EXTERNAL_BYTES` (1.5 GB, safely under protobuf's 2 GB limit
   on one message); above that, every tensor of 1 KiB or more goes to one external data file
   ``<stem>.data`` beside the model (onnx's ``save_as_external_data``), so the protobuf part
   stays small.
2. A shapes-only model (its weights are external references with no bytes anywhere, made by a
   builder such as ``llama --shapes-only``) is saved as its protobuf, and its data file is
   created *sparse* with ``truncate`` to the size the references need: it takes no disk
   blocks, every reference is in bounds, and nothing is ever allocated. An existing data file is
   only replaced when it is itself sparse (never a file holding real weights).
3. Every failure (an unwritable path, a message protobuf cannot encode, running out of
   memory) is a one-line :class:`UsageError` naming the file.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import onnx

from partitioner.core.errors import UsageError

AUTO_EXTERNAL_BYTES = 1_500_000_000
_SMALL_TENSOR_BYTES = 1024


def data_file_name(output: str | os.PathLike[str]) -> str:
    """The external data file name for a model saved at ``output``: ``<stem>.data``."""
    return Path(output).stem + ".data"


def _external_extent(model: onnx.ModelProto) -> tuple[str | None, int]:
    """(location, bytes needed) of the model's external references (rule 2), or (None, 0)."""
    location, end = None, 0
    for t in model.graph.initializer:
        if t.data_location != onnx.TensorProto.EXTERNAL:
            continue
        info = {e.key: e.value for e in t.external_data}
        if location not in (None, info.get("location")):
            raise UsageError(f"model {model.graph.name!r}: shapes-only references must share one data file")
        location = info.get("location")
        end = max(end, int(info.get("offset", 0)) + int(info.get("length", 0)))
    return location, end


def _tensor_bytes(model: onnx.ModelProto) -> int:
    """Bytes of the model's tensor data (initializers and Constant attributes), from their dims.

    Not ``model.ByteSize()``: past 2 GB protobuf's size is a 32-bit count that wraps around, so a
    2.9 GB model once measured as small and went on to fail in ``SerializeToString``."""
    total = 0
    tensors = list(model.graph.initializer)
    tensors += [a.t for n in model.graph.node for a in n.attribute if a.HasField("t")]
    for t in tensors:
        if t.data_type == onnx.TensorProto.STRING:
            total += sum(len(v) for v in t.string_data)
            continue
        n = 1
        for d in t.dims:
            n *= int(d)
        total += n * onnx.helper.tensor_dtype_to_np_dtype(t.data_type).itemsize
    return total


def _is_sparse(path: Path) -> bool:
    st = path.stat()
    return getattr(st, "st_blocks", 0) * 512 < max(st.st_size // 100, 1 << 20)


def save_model(model: onnx.ModelProto, output: str | os.PathLike[str]) -> dict[str, Any]:
    """Write ``model`` to ``output`` by the rules above; returns what was written."""
    out = Path(output)
    location, extent = _external_extent(model)
    try:
        if location is not None:  # rule 2
            data = out.parent / location
            if data.exists() and not _is_sparse(data):
                raise UsageError(f"{data}: exists and holds data; a shapes-only export would replace it "
                                 "(remove it or choose another -o)")
            out.write_bytes(model.SerializeToString())
            with open(data, "wb") as fh:
                fh.truncate(extent)
            return {"bytes": out.stat().st_size, "data_file": str(data), "data_bytes": extent, "sparse": True}
        if _tensor_bytes(model) <= AUTO_EXTERNAL_BYTES:  # rule 1, small
            onnx.save(model, str(out))
            return {"bytes": out.stat().st_size, "data_file": None, "data_bytes": 0, "sparse": False}
        name = data_file_name(out)
        data = out.parent / name
        if data.exists():
            data.unlink()  # onnx appends to an existing data file
        onnx.save(model, str(out), save_as_external_data=True, all_tensors_to_one_file=True, location=name,
                  size_threshold=_SMALL_TENSOR_BYTES)
        return {"bytes": out.stat().st_size, "data_file": str(data), "data_bytes": data.stat().st_size,
                "sparse": False}
    except UsageError:
        raise
    except OSError as exc:
        raise UsageError(f"{out}: cannot write the model ({exc.strerror or exc})") from exc
    except MemoryError:
        raise UsageError(f"{out}: ran out of memory while writing the model") from None
    except Exception as exc:  # protobuf's EncodeError and friends
        text = " ".join(str(exc).split())[:200]
        raise UsageError(f"{out}: cannot write the model ({type(exc).__name__}: {text})") from exc


__all__ = ["AUTO_EXTERNAL_BYTES", "data_file_name", "save_model"]
