"""Safe model loading and validation: ``load(path | ModelProto | zoo name) -> onnx_ir.Model``.

Checks, in the order they run (each failure is one :class:`ModelLoadError` line naming the file,
node or tensor):

1. The source is a regular, non-empty file under 2 GB (protobuf's limit, which binds the protobuf
   part only: external data may be any size), or a ModelProto, or a zoo name
   (``partitioner zoo list``). Folders, empty, truncated, random-byte and non-ONNX files
   are refused.
2. Structure: a graph with outputs, nesting of If/Loop/Scan subgraphs at most ``MAX_NESTING``
   deep, default-domain opset within [7, the installed onnx's highest], every operator known
   (all unsupported ones are listed at once), SSA (no duplicate output names), no dangling
   inputs, no cycles. An acyclic graph stored out of order is sorted.
3. Tensor data: external data must live in the model's own folder (no ``..``, no absolute path,
   no symlink, offsets and lengths inside the file, lengths agreeing with dims). Main-graph
   initializers over ``INLINE_EXTERNAL_BYTES`` stay *lazy*: the loaded model holds an
   ``onnx_ir.ExternalTensor`` (memory-mapped only when its values are asked for), so loading,
   ``inspect`` and ``plan`` read no weight bytes. Smaller external tensors (shape constants) and
   those in subgraphs or attributes are read in, the running total of the protobuf plus what
   was read in staying under 2 GB. With ``shapes_only=True`` a missing data file is accepted
   (path-safety checks still apply): the model can be planned, not run. Raw or typed data must
   agree with dims (sub-byte types packed).
   Nothing outside the model's folder is ever opened; files are opened non-blocking and
   re-checked on the open descriptor. Node names and types must be valid UTF-8.
4. Allocation bombs: no tensor (initializer, ConstantOfShape/Expand output in any graph or
   subgraph, any graph input or inferred value) may exceed ``max_elements`` elements; checked
   before anything is allocated.
5. Legacy ``-1`` dimensions become unknown; inputs named in ``constants`` become initializers;
   dynamic dimensions are bound with ``batch`` / ``shapes`` (every unbound one listed at once,
   :mod:`partitioner.bind_inputs`); then ``onnx.checker`` with
   ``full_check=True`` and strict shape inference run.

Any other exception raised on hostile bytes becomes a one-line ModelLoadError ("malformed
model"), chained to the original. The catalogue of refused inputs is docs/hostile_inputs.md.
"""

from __future__ import annotations

import math
import os
import re
import stat
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import networkx as nx
import numpy as np
import onnx
import onnx_ir as ir
from onnx import helper

from partitioner.bind_inputs import bind_constants, bind_dims, clear_legacy_dims
from partitioner.core.errors import ModelLoadError, PartitionerError, UnsupportedOpError

MIN_OPSET = 7
MAX_NESTING = 16
MAX_FILE_BYTES = 2**31 - 1
# External main-graph initializers above this stay lazy (memory-mapped on use); smaller ones are
# read in, so shape constants reach ONNX's data propagation.
INLINE_EXTERNAL_BYTES = 64 * 1024
DEFAULT_MAX_ELEMENTS = int(os.environ.get("PARTITIONER_MAX_TENSOR_ELEMENTS", 2**32))
from partitioner.core.comm_ops import DOMAIN as COMM_DOMAIN
_KNOWN_DOMAINS = ("", "ai.onnx", "ai.onnx.ml", "ai.onnx.preview.training", COMM_DOMAIN)


def load(
    source: str | os.PathLike[str] | onnx.ModelProto,
    *,
    batch: int | None = None,
    shapes: Mapping[str, Sequence[int]] | None = None,
    max_elements: int = DEFAULT_MAX_ELEMENTS,
    shapes_only: bool = False,
    constants: Mapping[str, Any] | None = None,
) -> ir.Model:
    """Load, validate and shape-infer a model. Returns an onnx-ir model with static shapes.

    Large external initializers stay lazy (``ir.ExternalTensor`` with its folder set), so a model
    of any size loads in the memory of its graph; ``shapes_only`` accepts absent data files.
    ``constants`` binds inputs to values (``--const``; :mod:`partitioner.bind_inputs`).
    """
    proto, base_dir = _load_checked(source, batch=batch, shapes=shapes, max_elements=max_elements,
                                    shapes_only=shapes_only, constants=constants)
    try:
        model = ir.serde.deserialize_model(proto)
    except Exception as exc:
        raise ModelLoadError(f"{proto.graph.name or '<model>'}: onnx-ir cannot read the model "
                             f"({type(exc).__name__}: {_one_line(exc)})") from exc
    if base_dir is not None:
        ir.external_data.set_base_dir(model.graph, base_dir)
    return model


def load_proto(
    source: str | os.PathLike[str] | onnx.ModelProto,
    *,
    batch: int | None = None,
    shapes: Mapping[str, Sequence[int]] | None = None,
    max_elements: int = DEFAULT_MAX_ELEMENTS,
    shapes_only: bool = False,
    constants: Mapping[str, Any] | None = None,
) -> onnx.ModelProto:
    """Like :func:`load` but returns the validated, shape-inferred ``ModelProto``.

    Large external initializers remain external references (location relative to the model's
    folder), as in :func:`load`.
    """
    return _load_checked(source, batch=batch, shapes=shapes, max_elements=max_elements, shapes_only=shapes_only,
                         constants=constants)[0]


def _load_checked(
    source: str | os.PathLike[str] | onnx.ModelProto,
    *,
    batch: int | None,
    shapes: Mapping[str, Sequence[int]] | None,
    max_elements: int,
    shapes_only: bool,
    constants: Mapping[str, Any] | None = None,
) -> tuple[onnx.ModelProto, Path | None]:
    """The checks of the module docstring; returns the proto and the model's folder.

    Any exception other than a :class:`PartitionerError` raised while checking hostile bytes
    (a malformed field the checks above did not foresee) becomes a one-line ModelLoadError naming
    the file, chained to the original for ``--debug``.
    """
    label = str(source) if isinstance(source, (str, os.PathLike)) else "<model>"
    try:
        label, proto, base_dir = _read_source(source)
        _check_structure(proto, label)
        _resolve_tensor_data(proto, label, base_dir, max_elements, shapes_only)
        _guard_constant_of_shape(proto, label, max_elements)
        clear_legacy_dims(proto)
        bind_constants(proto, label, dict(constants or {}))
        _bind_dims(proto, label, batch, dict(shapes or {}))
        proto = _check_and_infer(proto, label)
        _guard_inferred_sizes(proto, label, max_elements)
        return proto, base_dir
    except PartitionerError:
        raise
    except RecursionError:
        raise ModelLoadError(f"{label}: nested too deeply to check; refused") from None
    except MemoryError:
        raise ModelLoadError(f"{label}: ran out of memory while checking the model; refused") from None
    except Exception as exc:
        raise ModelLoadError(f"{label}: malformed model ({type(exc).__name__}: {_one_line(exc)})") from exc


# 1. reading ------------------------------------------------------------------------------------

def _read_source(source: Any) -> tuple[str, onnx.ModelProto, Path | None]:
    if isinstance(source, onnx.ModelProto):
        proto = onnx.ModelProto()
        proto.CopyFrom(source)
        label = proto.graph.name or "<model>"
        return label, proto, None
    if isinstance(source, ir.Model):
        return source.graph.name or "<model>", ir.serde.serialize_model(source), None
    if not isinstance(source, (str, os.PathLike)):
        raise ModelLoadError(f"cannot load a model from a {type(source).__name__}; give a path, a ModelProto or a zoo name")
    path = Path(source)
    if not os.path.lexists(path):
        from models_zoo import is_zoo_name

        if isinstance(source, str) and is_zoo_name(source):
            from models_zoo import build

            return source, build(source), None
        raise ModelLoadError(f"{path}: no such file (and not a zoo name; see `partitioner zoo list`)")
    label = str(path)
    try:
        st = os.stat(path)  # follows a symlinked model file; the checks below apply to its target
    except FileNotFoundError:
        raise ModelLoadError(f"{label}: no such file (a symlink to a missing target?)") from None
    except OSError as exc:
        raise ModelLoadError(f"{label}: cannot read the file: {exc.strerror or exc}") from None
    if stat.S_ISDIR(st.st_mode):
        raise ModelLoadError(f"{label}: is a folder, not an .onnx file")
    if not stat.S_ISREG(st.st_mode):
        raise ModelLoadError(f"{label}: not a regular file")
    if st.st_size == 0:
        raise ModelLoadError(f"{label}: empty file, not an ONNX model")
    if st.st_size > MAX_FILE_BYTES:
        raise ModelLoadError(
            f"{label}: {st.st_size / 2**30:.1f} GiB is over protobuf's 2 GB limit; save the model with external data "
            "(onnx.save(..., save_as_external_data=True))"
        )
    data = _read_regular_file(path, label, st.st_size, follow_symlink=True)
    proto = onnx.ModelProto()
    try:
        proto.ParseFromString(data)
    except Exception as exc:  # google.protobuf.message.DecodeError and friends
        if "MaxDepth" in str(exc) or "recursion" in str(exc).lower():
            raise ModelLoadError(
                f"{label}: messages nested too deeply for protobuf to parse (subgraphs nested far past the "
                f"limit of {MAX_NESTING}); refused"
            ) from None
        raise ModelLoadError(f"{label}: not an ONNX model (protobuf parse failed: {_one_line(exc)})") from None
    if not proto.HasField("graph") or proto.ir_version <= 0:
        raise ModelLoadError(f"{label}: not an ONNX model (no graph or ir_version; truncated or another format?)")
    return label, proto, path.resolve().parent


def _read_regular_file(path: Path, label: str, max_bytes: int, offset: int = 0, length: int | None = None,
                       *, follow_symlink: bool = False) -> bytes:
    """Open ``path`` without blocking (and, unless ``follow_symlink``, without following a final
    symlink), check on the open descriptor that it is still a regular file of at most
    ``max_bytes`` (closing the race between the checks and the open), then read ``length``
    bytes at ``offset``."""
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | (0 if follow_symlink else getattr(os, "O_NOFOLLOW", 0))
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        raise ModelLoadError(f"{label}: cannot open the file: {exc.strerror or exc}") from None
    with os.fdopen(fd, "rb") as fh:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > max_bytes:
            raise ModelLoadError(f"{label}: the file changed while it was being checked; refused")
        want = st.st_size - offset if length is None else length
        if offset < 0 or want < 0 or offset + want > st.st_size:
            raise ModelLoadError(f"{label}: the file changed while it was being checked; refused")
        fh.seek(offset)
        data = fh.read(want)
    if len(data) != want:
        raise ModelLoadError(f"{label}: read {len(data)} of {want} bytes; the file changed while it was being read")
    return data


def _node_label(node: onnx.NodeProto, index: int) -> str:
    """``'name'`` for a named node, ``#index (OpType)`` for an unnamed one."""
    return repr(node.name) if node.name else f"#{index} ({node.op_type})"


# 2. structure ----------------------------------------------------------------------------------

def _walk_graphs(graph: onnx.GraphProto, depth: int = 0):
    yield graph, depth
    for node in graph.node:
        for attr in node.attribute:
            subs = ([attr.g] if attr.HasField("g") else []) + list(attr.graphs)
            for sub in subs:
                yield from _walk_graphs(sub, depth + 1)


def _check_structure(proto: onnx.ModelProto, label: str) -> None:
    g = proto.graph
    if not g.node and not g.output:
        raise ModelLoadError(f"{label}: the graph is empty (no nodes, no outputs)")
    if not g.output:
        raise ModelLoadError(f"{label}: the graph has no outputs")
    opsets = {o.domain: o.version for o in proto.opset_import}
    default = opsets.get("", opsets.get("ai.onnx"))
    highest = onnx.defs.onnx_opset_version()
    if default is None:
        raise ModelLoadError(f"{label}: no default-domain opset_import")
    if not MIN_OPSET <= default <= highest:
        raise ModelLoadError(f"{label}: opset {default} is out of range: supported are {MIN_OPSET}..{highest}")
    local_functions = {(f.domain, f.name) for f in proto.functions}
    unsupported: list[tuple[str, str]] = []
    for graph, depth in _walk_graphs(g):
        if depth > MAX_NESTING:
            raise ModelLoadError(f"{label}: subgraphs nested {depth} deep in graph {graph.name!r}; the limit is {MAX_NESTING}")
        for idx, node in enumerate(graph.node):
            _check_text_fields(node, idx, graph, label)
            dom = node.domain or ""
            if (dom, node.op_type) in local_functions:
                continue
            if dom not in _KNOWN_DOMAINS or dom not in opsets and dom not in ("", "ai.onnx"):
                unsupported.append((f"{dom}::{node.op_type}", node.name or "<unnamed>"))
                continue
            if dom == COMM_DOMAIN:
                continue
            version = opsets.get(dom, default)
            if not onnx.defs.has(node.op_type, version, dom):
                unsupported.append((node.op_type if not dom else f"{dom}::{node.op_type}", node.name or "<unnamed>"))
    if unsupported:
        listing = ", ".join(f"{op} (node {name!r})" for op, name in unsupported[:50])
        more = f" and {len(unsupported) - 50} more" if len(unsupported) > 50 else ""
        raise UnsupportedOpError(f"{label}: {len(unsupported)} unsupported operator(s): {listing}{more}", unsupported)
    _check_dataflow(g, label)


def _check_text_fields(node: onnx.NodeProto, idx: int, graph: onnx.GraphProto, label: str) -> None:
    """protobuf hands back ``bytes`` for a string field that is not valid UTF-8; refuse those."""
    fields = [node.op_type, node.domain, node.name, *node.input, *node.output, *(a.name for a in node.attribute)]
    if any(isinstance(f, bytes) for f in fields):
        raise ModelLoadError(f"{label}: node #{idx} of graph {graph.name!r} has a name or type that is not valid UTF-8")


def _check_dataflow(g: onnx.GraphProto, label: str) -> None:
    """SSA, dangling inputs and cycles, with a message naming the node; sorts an acyclic graph."""
    defined = {i.name for i in g.input} | {t.name for t in g.initializer} | {t.name for t in g.sparse_initializer}
    producer: dict[str, int] = {}
    for idx, node in enumerate(g.node):
        for out in node.output:
            if not out:
                continue
            if out in producer or out in defined:
                raise ModelLoadError(
                    f"{label}: value {out!r} is produced twice (node {_node_label(node, idx)}); the graph is not SSA"
                )
            producer[out] = idx
    dag = nx.DiGraph()
    dag.add_nodes_from(range(len(g.node)))
    from partitioner.core.segments import node_reads

    for idx, node in enumerate(g.node):
        for name in node_reads(node):
            if name in producer:
                dag.add_edge(producer[name], idx)
            elif name not in defined:
                raise ModelLoadError(
                    f"{label}: input {name!r} of node {_node_label(node, idx)}"
                    f"{f' ({node.op_type})' if node.name else ''} is not produced by any node, "
                    "graph input or initializer"
                )
    for out in g.output:
        if out.name not in producer and out.name not in defined:
            raise ModelLoadError(f"{label}: graph output {out.name!r} is not produced by any node")
    if not nx.is_directed_acyclic_graph(dag):
        cycle = nx.find_cycle(dag)
        names = " -> ".join(_node_label(g.node[a], a) for a, _ in cycle)
        raise ModelLoadError(f"{label}: the graph has a cycle: {names}")
    order = list(nx.lexicographical_topological_sort(dag))
    if order != list(range(len(g.node))):
        nodes = [g.node[i] for i in order]
        copies = [onnx.NodeProto() for _ in nodes]
        for c, n in zip(copies, nodes):
            c.CopyFrom(n)
        del g.node[:]
        g.node.extend(copies)


# 3. tensor data --------------------------------------------------------------------------------

def _all_tensors(proto: onnx.ModelProto):
    """``(tensor, may_stay_lazy)`` for every tensor: only main-graph initializers may stay lazy
    (onnx-ir memory-maps those; a subgraph's or an attribute's tensor is read in)."""
    for graph, depth in _walk_graphs(proto.graph):
        for t in graph.initializer:
            yield t, depth == 0
        for node in graph.node:
            for attr in node.attribute:
                if attr.HasField("t"):
                    yield attr.t, False
                for t in attr.tensors:
                    yield t, False


def _expected_bytes(t: onnx.TensorProto) -> int | None:
    if t.data_type in (onnx.TensorProto.STRING, onnx.TensorProto.UNDEFINED):
        return None
    try:
        np_dtype = helper.tensor_dtype_to_np_dtype(t.data_type)
    except Exception:
        return None
    bits = _SUB_BYTE_BITS.get(t.data_type)
    n = math.prod(t.dims)
    if bits:
        return (n * bits + 7) // 8
    return n * np.dtype(np_dtype).itemsize


# Sub-byte types are packed in raw_data (onnx.helper.make_tensor); typed fields pack 4-bit values
# two per int32 and 2-bit values four per int32, and store 6-bit values one per int32.
_SUB_BYTE_BITS = {
    onnx.TensorProto.INT4: 4, onnx.TensorProto.UINT4: 4, onnx.TensorProto.FLOAT4E2M1: 4,
    onnx.TensorProto.INT2: 2, onnx.TensorProto.UINT2: 2,
    onnx.TensorProto.FLOAT6E2M3: 6, onnx.TensorProto.FLOAT6E3M2: 6,
}
_TYPED_PER_INT32 = {
    onnx.TensorProto.INT4: 2, onnx.TensorProto.UINT4: 2, onnx.TensorProto.FLOAT4E2M1: 2,
    onnx.TensorProto.INT2: 4, onnx.TensorProto.UINT2: 4,
}


_TYPED_FIELDS = ("float_data", "int32_data", "int64_data", "double_data", "uint64_data", "string_data")


def _resolve_tensor_data(proto: onnx.ModelProto, label: str, base_dir: Path | None, max_elements: int,
                         shapes_only: bool = False) -> None:
    inlined = [proto.ByteSize()]  # running total of the protobuf's bytes, external data read in included
    for t, may_stay_lazy in _all_tensors(proto):
        n = math.prod(t.dims)
        if any(d < 0 for d in t.dims):
            raise ModelLoadError(f"{label}: tensor {t.name!r} has a negative dimension {list(t.dims)}")
        if n > max_elements:
            raise ModelLoadError(f"{label}: tensor {t.name!r} has {_count(n)} elements, over the limit of {_count(max_elements)}")
        want = _expected_bytes(t)
        if t.data_location == onnx.TensorProto.EXTERNAL:
            _read_external(t, label, base_dir, want, inlined, may_stay_lazy, shapes_only)
            continue
        if t.HasField("raw_data"):
            if want is not None and len(t.raw_data) != want:
                raise ModelLoadError(
                    f"{label}: tensor {t.name!r}: raw_data has {len(t.raw_data)} bytes but dims {list(t.dims)} "
                    f"need {want}"
                )
            continue
        counts = [len(getattr(t, f)) for f in _TYPED_FIELDS if len(getattr(t, f))]
        have = counts[0] if counts else 0
        if t.data_type in (onnx.TensorProto.COMPLEX64, onnx.TensorProto.COMPLEX128):
            have //= 2
        per = _TYPED_PER_INT32.get(t.data_type, 1)
        expected_count = (n + per - 1) // per
        if have != expected_count:
            raise ModelLoadError(
                f"{label}: tensor {t.name!r} holds {have} values but dims {list(t.dims)} need {expected_count}"
            )


def _read_external(t: onnx.TensorProto, label: str, base_dir: Path | None, want: int | None,
                   inlined: list[int], may_stay_lazy: bool = False, shapes_only: bool = False) -> None:
    """Check one tensor's external data reference; inline it unless it may stay lazy and is over
    ``INLINE_EXTERNAL_BYTES``. ``inlined[0]`` is the running byte total of the protobuf: a read
    that would take it past protobuf's 2 GB limit is refused before it happens. A lazy tensor's
    reference is rewritten with its offset and length explicit (what onnx-ir maps)."""
    info = {e.key: e.value for e in t.external_data}
    loc = info.get("location", "")
    where = f"{label}: tensor {t.name!r}: external data {loc!r}"
    if base_dir is None:
        raise ModelLoadError(f"{where}: a model given in memory cannot use external data; load it from its file")
    if not loc:
        raise ModelLoadError(f"{where}: no location given")
    if "\x00" in loc:
        raise ModelLoadError(f"{where}: the location holds a NUL byte; refused")
    p = Path(loc)
    if p.is_absolute() or loc.startswith(("/", "\\")) or (len(loc) > 1 and loc[1] == ":"):
        raise ModelLoadError(f"{where}: absolute paths are refused; external data must sit in the model's folder")
    if any(part == ".." for part in Path(loc.replace("\\", "/")).parts):
        raise ModelLoadError(f"{where}: '..' is refused; external data must sit in the model's folder")
    target = base_dir / p
    # refuse a symlink anywhere on the way, before anything is opened
    cur = base_dir
    for part in p.parts:
        cur = cur / part
        if cur.is_symlink():
            raise ModelLoadError(f"{where}: {part!r} is a symlink; refused")
    if not target.resolve().is_relative_to(base_dir):
        raise ModelLoadError(f"{where}: resolves outside the model's folder; refused")
    if shapes_only and may_stay_lazy and not os.path.lexists(target):
        _set_external_info(t, loc, int(info.get("offset", 0) or 0), want or 0)
        return  # planning a model whose weights are not here: the reference is kept unchecked
    if not target.is_file():
        raise ModelLoadError(f"{where}: no such file beside the model")
    try:
        offset = int(info.get("offset", 0))
        length = int(info["length"]) if "length" in info else None
    except ValueError:
        raise ModelLoadError(f"{where}: offset/length are not integers") from None
    size = target.stat().st_size
    if length is None:
        length = size - offset
    if offset < 0 or length < 0 or offset + length > size:
        raise ModelLoadError(f"{where}: offset {offset} + length {length} is outside the file ({size} bytes)")
    if want is not None and length != want:
        raise ModelLoadError(f"{where}: length {length} bytes but dims {list(t.dims)} need {want}")
    if may_stay_lazy and length > INLINE_EXTERNAL_BYTES:
        _set_external_info(t, loc, offset, length)
        return
    if inlined[0] + length > MAX_FILE_BYTES:
        raise ModelLoadError(
            f"{where}: {length / 2**30:.2f} GiB more would take the model to {(inlined[0] + length) / 2**30:.2f} GiB, "
            "over protobuf's 2 GB limit; refused before reading"
        )
    t.raw_data = _read_regular_file(target, where, size, offset, length)
    inlined[0] += length
    del t.external_data[:]
    t.data_location = onnx.TensorProto.DEFAULT


def _set_external_info(t: onnx.TensorProto, location: str, offset: int, length: int) -> None:
    """Keep only the keys onnx-ir reads (location, offset, length), all explicit."""
    del t.external_data[:]
    for key, value in (("location", location), ("offset", str(offset)), ("length", str(length))):
        entry = t.external_data.add()
        entry.key, entry.value = key, value


# 4. allocation bombs ---------------------------------------------------------------------------

def _guard_constant_of_shape(proto: onnx.ModelProto, label: str, max_elements: int) -> None:
    """ConstantOfShape/Expand whose shape is a constant (initializer or Constant node, in any graph
    or subgraph) must not ask for more than ``max_elements`` elements."""
    graphs = [g for g, _ in _walk_graphs(proto.graph)]
    inits = {t.name: t for g in graphs for t in g.initializer}
    consts = {n.output[0]: n.attribute[0].t for g in graphs for n in g.node
              if n.op_type == "Constant" and n.output and n.attribute and n.attribute[0].HasField("t")}
    for node in (n for g in graphs for n in g.node):
        if node.op_type not in ("ConstantOfShape", "Expand", "Tile", "Range") or len(node.input) < 1:
            continue
        src = node.input[0] if node.op_type == "ConstantOfShape" else (node.input[1] if len(node.input) > 1 else "")
        t = inits.get(src) or consts.get(src)
        if t is None or node.op_type == "Range":
            continue
        try:
            vals = onnx.numpy_helper.to_array(t).astype(np.float64).ravel()
        except Exception as exc:
            raise ModelLoadError(f"{label}: shape tensor {t.name!r} of node {node.name!r} cannot be read: "
                                 f"{_one_line(exc)}") from None
        n = float(np.prod(vals)) if node.op_type in ("ConstantOfShape", "Expand") else None
        if n is not None and n > max_elements:
            raise ModelLoadError(
                f"{label}: node {node.name!r} ({node.op_type}) would allocate {_count(n)} elements, over the limit of "
                f"{_count(max_elements)}; refused before allocating"
            )


def _guard_inferred_sizes(proto: onnx.ModelProto, label: str, max_elements: int) -> None:
    """No graph input, output or inferred value (in any graph or subgraph) over ``max_elements``."""
    values = [vi for g, _ in _walk_graphs(proto.graph) for vi in (*g.input, *g.value_info, *g.output)]
    for vi in values:
        tt = vi.type.tensor_type
        if not tt.HasField("shape"):
            continue
        dims = [d.dim_value for d in tt.shape.dim if d.HasField("dim_value")]
        if dims and math.prod(dims) > max_elements:
            raise ModelLoadError(
                f"{label}: value {vi.name!r} would hold {_count(math.prod(dims))} elements, over the limit of "
                f"{_count(max_elements)}"
            )


# 5. shapes, checker, inference -----------------------------------------------------------------

def _bind_dims(proto: onnx.ModelProto, label: str, batch: int | None, shapes: dict[str, list[int]]) -> None:
    """Bind symbolic input dimensions (rules in :mod:`partitioner.bind_inputs`)."""
    bind_dims(proto, label, batch, shapes)


def _check_and_infer(proto: onnx.ModelProto, label: str) -> onnx.ModelProto:
    """The checker and strict shape inference. Lazy (external) initializers are shown to them as
    typed graph inputs, since onnx's checker opens external files relative to the working
    folder; they are put back, unchanged, into the inferred model."""
    if proto.ByteSize() > MAX_FILE_BYTES:
        raise ModelLoadError(f"{label}: the model is over protobuf's 2 GB limit in memory; refused")
    g = proto.graph
    lazy = [t for t in g.initializer if t.data_location == onnx.TensorProto.EXTERNAL]
    if not lazy:
        return _check_and_infer_proto(proto, label)
    lazy_names = {t.name for t in lazy}
    order = [t.name for t in g.initializer]
    listed = {i.name for i in g.input}
    stub = onnx.ModelProto()
    stub.CopyFrom(proto)
    kept = [t for t in stub.graph.initializer if t.name not in lazy_names]
    del stub.graph.initializer[:]
    stub.graph.initializer.extend(kept)
    added = [t.name for t in lazy if t.name not in listed]
    stub.graph.input.extend(helper.make_tensor_value_info(t.name, t.data_type, list(t.dims))
                            for t in lazy if t.name not in listed)
    if stub.ir_version < 4:
        stub.ir_version = 4  # an initializer-less input needs IR >= 4; only the stub is changed
    inferred = _check_and_infer_proto(stub, label)
    inferred.ir_version = proto.ir_version
    added_set = set(added)
    inputs = [i for i in inferred.graph.input if i.name not in added_set]
    del inferred.graph.input[:]
    inferred.graph.input.extend(inputs)
    by_name = {t.name: t for t in inferred.graph.initializer}
    by_name.update({t.name: t for t in lazy})
    del inferred.graph.initializer[:]
    inferred.graph.initializer.extend(by_name[n] for n in order)
    return inferred


def _check_and_infer_proto(proto: onnx.ModelProto, label: str) -> onnx.ModelProto:
    try:
        onnx.checker.check_model(proto, full_check=False)
    except Exception as exc:
        raise ModelLoadError(f"{label}: invalid model: {_one_line(exc)}") from None
    try:
        inferred = onnx.shape_inference.infer_shapes(proto, check_type=True, strict_mode=True, data_prop=True)
    except Exception as exc:
        raise _inference_refusal(label, exc) from None
    try:
        onnx.checker.check_model(inferred, full_check=True)
    except Exception as exc:
        raise ModelLoadError(f"{label}: invalid model: {_one_line(exc)}") from None
    return inferred


def _inference_refusal(label: str, exc: BaseException) -> ModelLoadError:
    """Rule: strict shape inference failing is a plain ModelLoadError (an invalid model), except in
    two forms where onnx's own inference of one op is what fails, which are refused naming that op
    (the project compiles with onnx's inferred shapes, so it cannot compile such an op):
    the failure is inside the op's function body (``(op_type:X): ... (op_type:Y)``; onnx 1.23:
    MeanVarianceNormalization's body), or onnx infers a shape that differs from the one the model
    declares (onnx 1.23: STFT's onesided bin count)."""
    text = _one_line(exc)
    ops = re.findall(r"\(op_type:([A-Za-z0-9_]+)", text)
    nested = len(ops) >= 2 and text.count("Inference error(s)") >= 2
    if ops and (nested or "Inferred shape and existing shape differ" in text):
        return UnsupportedOpError(f"{label}: shape inference failed inside onnx's inference of the op {ops[0]}, "
                                  f"whose static shapes the compiler needs; refused ({text})", [("", ops[0])])
    return ModelLoadError(f"{label}: shape inference failed: {text}")


def _count(n: float) -> str:
    """An element count for a message: exact below a million, else three significant digits."""
    return str(int(n)) if n < 1e6 else f"{n:.3g}"


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text[:400] + ("..." if len(text) > 400 else "")
