"""Per-segment ONNX Runtime fallback inside a TVM rank (``--fallback onnxruntime``).

When a per-rank program holds ops TVM's ONNX importer cannot convert, only the runs of those
ops go to ONNX Runtime; everything else is still compiled by TVM, in the same process.

Rules:
1. A program opts in with the metadata entry ``partitioner.fallback = "onnxruntime"``
   (:func:`mark_program`; :func:`mark_programs`, called by the compile driver, sets it only on programs that
   need it, so other programs stay byte-identical). Without it, unsupported ops are a
   :class:`BackendError` that lists them all (:func:`backends.tvm.lower.check_supported`).
2. The program is first prepared for the import exactly as :func:`backends.tvm.lower.lower_program`
   prepares it (:func:`backends.tvm.import_pipeline.prepare_for_import`: function bodies of ops TVM
   lacks expanded, recurrent ops unrolled, types inferred, the import rewrites applied); only what
   remains unimportable goes to ONNX Runtime. :func:`split_with_fallback` cuts the program in node order into: comm steps (one per comm node),
   TVM segments (maximal runs of importable nodes) and ORT segments (maximal runs of nodes that are
   not importable: an op missing from the importer's convert map, a non-default domain, or a
   subgraph holding one). Each segment is a valid ONNX model with typed boundaries
   (:mod:`partitioner.core.segments` rules 2-4).
3. ORT segment ``k`` (its ordinal among the program's ORT segments) is stored next to the rank
   library as ``rank<i>.seg<k>.onnx`` (:func:`segment_file`), hashed in the manifest like every file.
   In Relax it is ``R.call_dps_packed("partitioner.ort_segment", (k, inputs...), out_ty=...)``;
   the packed function receives ``(k, inputs..., outputs...)`` and runs the segment's
   ``InferenceSession`` on the calling thread, writing the destination tensors in place.
4. The decision depends only on the program and the installed TVM's convert map, so the builder
   and the artifact writer derive the same segments; the loader reads the segment files
   themselves (:func:`load_sessions`), so an artifact does not depend on how a later version
   would cut the program.
"""

from __future__ import annotations

import threading
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import onnx

from partitioner.core.comm_ops import is_comm
from partitioner.core.errors import BackendError, RunFailed
from partitioner.core.segments import CommStep, Segment, split_program

from .import_pipeline import prepare_for_import, tvm_known_ops

META_KEY = "partitioner.fallback"
ORT = "onnxruntime"
PACKED_NAME = "partitioner.ort_segment"


@dataclass(frozen=True)
class OrtSegment:
    """A run of nodes TVM cannot import; runs under ONNX Runtime. ``key`` is k in rank<i>.seg<k>.onnx."""

    index: int
    key: int
    model: onnx.ModelProto
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    nodes: tuple[str, ...]
    op_types: tuple[str, ...]

    def describe(self) -> dict[str, Any]:
        return {"segment": self.key, "nodes": list(self.nodes), "op_types": sorted(set(self.op_types)),
                "inputs": list(self.inputs), "outputs": list(self.outputs)}


def _subgraphs(node: onnx.NodeProto):
    for attr in node.attribute:
        yield from list(attr.graphs) + ([attr.g] if attr.HasField("g") else [])


def unimportable_op(node: onnx.NodeProto, known: Collection[str]) -> str | None:
    """The op type (``domain::Op`` outside the default domain) of ``node`` when TVM's importer has
    no converter for it (``known``: :func:`backends.tvm.expand_functions.tvm_known_ops`), subgraphs
    not looked into; None for comm nodes and nodes it converts. The one test both the support
    check (:func:`backends.tvm.lower.check_supported`) and :func:`unsupported_op` apply."""
    if is_comm(node):
        return None
    if node.domain not in ("", "ai.onnx"):
        return f"{node.domain}::{node.op_type}"
    return node.op_type if node.op_type not in known else None


def unsupported_op(node: onnx.NodeProto, known: Collection[str] | None = None,
                   refused: frozenset[str] = frozenset()) -> str | None:
    """The op type (``domain::Op`` outside the default domain) that keeps TVM from importing
    ``node``, looking into its subgraphs too; None when TVM can import it. Comm nodes are None.
    A node whose first output is in ``refused`` (:func:`backends.tvm.op_support.refused_outputs`:
    a form of the op the support table refuses) counts as unsupported too."""
    if is_comm(node):
        return None
    if node.output and node.output[0] in refused:
        return node.op_type
    known = tvm_known_ops() if known is None else known
    bad = unimportable_op(node, known)
    if bad is not None:
        return bad
    for g in _subgraphs(node):
        for inner in g.node:
            bad = unsupported_op(inner, known)
            if bad is not None:
                return bad
    return None


def wants_fallback(program: onnx.ModelProto) -> bool:
    return any(p.key == META_KEY and p.value == ORT for p in program.metadata_props)


def needs_fallback(program: onnx.ModelProto) -> bool:
    """Whether any top-level node of ``program``, prepared for the import (rule 2), cannot be
    imported by TVM."""
    from .op_support import refused_outputs

    known = tvm_known_ops()
    program = prepare_for_import(program)
    refused = refused_outputs(program)
    return any(unsupported_op(n, known, refused) is not None for n in program.graph.node)


def mark_program(program: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of ``program`` that asks the TVM lowering for per-segment ORT fallback (rule 1)."""
    out = onnx.ModelProto()
    out.CopyFrom(program)
    if not wants_fallback(out):
        entry = out.metadata_props.add()
        entry.key, entry.value = META_KEY, ORT
    return out


def segment_file(library: str | Path, key: int) -> str:
    """``rank<i>.seg<k>.onnx`` for the library ``rank<i>.so`` (only the stem is used)."""
    return f"{Path(library).name.split('.')[0]}.seg{key}.onnx"


def split_with_fallback(program: onnx.ModelProto) -> list[Segment | CommStep | OrtSegment]:
    """Rule 2. ``program`` must be prepared (:func:`prepare_for_import`: boundaries need types)."""
    from .op_support import refused_outputs

    known = tvm_known_ops()
    refused = refused_outputs(program)
    steps: list[Segment | CommStep | OrtSegment] = []
    n_ort = 0
    for step in split_program(program, kind_of=lambda n: "ort" if unsupported_op(n, known, refused) else "tvm"):
        if not (isinstance(step, Segment) and step.kind == "ort"):
            steps.append(step)
            continue
        nodes = step.model.graph.node
        step.model.graph.name = f"{program.graph.name}_ort{n_ort}"
        steps.append(OrtSegment(step.index, n_ort, step.model, step.inputs, step.outputs,
                                tuple(n.name or "<unnamed>" for n in nodes),
                                tuple(unsupported_op(n, known, refused) or n.op_type for n in nodes)))
        n_ort += 1
    return steps


def ort_segments(program: onnx.ModelProto) -> list[OrtSegment]:
    """The program's ORT segments (empty unless it opted in and needs them)."""
    if not wants_fallback(program):
        return []
    return [s for s in split_with_fallback(prepare_for_import(program)) if isinstance(s, OrtSegment)]


def mark_programs(programs: Sequence[onnx.ModelProto]) -> tuple[list[onnx.ModelProto], bool]:
    """Mark the programs holding ops TVM cannot import (rule 1) so that the TVM lowering runs just
    those segments under ONNX Runtime; other programs are left byte-identical. Returns the
    programs and whether any was marked."""
    out, marked = [], False
    for p in programs:
        if needs_fallback(p):
            p, marked = mark_program(p), True
        out.append(p)
    return out, marked


def write_segments(directory: Path, programs: Sequence[onnx.ModelProto]) -> list[list[dict[str, Any]]]:
    """Write ``rank<i>.seg<k>.onnx`` for every ORT segment (rule 3); return their descriptions per rank."""
    described: list[list[dict[str, Any]]] = []
    for i, p in enumerate(programs):
        rows = []
        for seg in ort_segments(p):
            name = segment_file(f"rank{i}.so", seg.key)
            (directory / name).write_bytes(seg.model.SerializeToString(deterministic=True))
            rows.append({"file": name, **seg.describe()})
        described.append(rows)
    return described


def segments_note(segments_per_rank: list[list[dict[str, Any]]]) -> dict[str, Any]:
    """The manifest's ``fallback`` entry for a per-segment fallback: which segments of which rank
    run under ONNX Runtime and why."""
    parts = [f"rank {i} segment {s['segment']} ({', '.join(s['op_types'])}: nodes {', '.join(s['nodes'])})"
             for i, rows in enumerate(segments_per_rank) for s in rows]
    ops = sorted({t for rows in segments_per_rank for s in rows for t in s["op_types"]})
    return {"from": "tvm", "to": "onnxruntime", "scope": "segments",
            "reason": f"TVM cannot import {', '.join(ops)}; ONNX Runtime runs only these segments inside "
                      f"their rank: {'; '.join(parts)}",
            "segments": [{"rank": i, **s} for i, rows in enumerate(segments_per_rank) for s in rows]}


# -- run time -----------------------------------------------------------------------------------

_local = threading.local()
_register_lock = threading.Lock()
_registered = False


@dataclass(frozen=True)
class _Session:
    session: Any  # onnxruntime.InferenceSession
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    elems: dict[str, int]  # element type of each segment input and output (backends.onnxruntime.run_session)


def load_sessions(program: onnx.ModelProto, library: Path, *, threads: int = 1) -> dict[int, _Session]:
    """ORT sessions for the ORT segments stored next to ``library`` (``rank<i>.seg<k>.onnx``).

    The segments are read from the files the artifact holds (verified by the manifest's hashes),
    not re-derived from the program: an artifact keeps working when a later version of the
    project would cut the program differently. Each file's graph inputs and outputs, in order,
    are the packed call's arguments (rule 3).
    """
    import re

    if not wants_fallback(program):
        return {}
    library = Path(library)
    stem = library.name.split(".")[0]
    pattern = re.compile(rf"{re.escape(stem)}\.seg(\d+)\.onnx")
    files = {int(m.group(1)): p for p in library.parent.glob(f"{stem}.seg*.onnx") if (m := pattern.fullmatch(p.name))}
    if not files:
        segs = ort_segments(program)
        if segs:
            path = library.parent / segment_file(library, segs[0].key)
            raise BackendError(f"{path}: ONNX Runtime fallback segment {segs[0].key} is missing; recompile with "
                               "--fallback onnxruntime")
        return {}
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = max(1, int(threads))
    opts.inter_op_num_threads = 1
    opts.log_severity_level = 3
    table = {}
    for key, path in sorted(files.items()):
        from backends.onnxruntime import check_forms

        try:
            model = onnx.load(str(path), load_external_data=False)
        except Exception as exc:  # noqa: BLE001 - onnx raises its own classes
            raise BackendError(f"{path}: cannot read this fallback segment ({type(exc).__name__}: {exc})") from None
        check_forms(model, str(path))  # forms ORT fails on at run time: refused here, naming the node
        try:
            sess = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
        except Exception as exc:  # noqa: BLE001 - onnx and ORT raise their own classes
            from backends.onnxruntime import lacks_kernel

            lacks_kernel(exc, str(path))  # ORT has no kernel for an op: a clean refusal naming it
            raise BackendError(f"{path}: ONNX Runtime cannot load this fallback segment "
                               f"({str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__})") from None
        inits = {t.name for t in model.graph.initializer}
        inputs = tuple(v.name for v in model.graph.input if v.name not in inits)
        from backends.onnxruntime import elem_types

        table[key] = _Session(sess, inputs, tuple(v.name for v in model.graph.output), elem_types(model))
    return table


def bind(table: dict[int, _Session] | None) -> None:
    """Make ``table`` the current thread's sessions (the executable does this around a VM call)."""
    _local.table = table
    _local.error = None


def last_error() -> BaseException | None:
    return getattr(_local, "error", None)


def _to_numpy(t: Any) -> np.ndarray:
    if t.device.dlpack_device_type() == 1:  # kDLCPU: a view, no copy (a copy for bfloat16/float8)
        from backends.tvm.executable import host_view

        return host_view(t)
    return t.numpy()


def _write(out: Any, value: np.ndarray) -> None:
    from backends.tvm.executable import _dlpack_ok

    if out.device.dlpack_device_type() == 1 and _dlpack_ok(out):
        dst = np.from_dlpack(out)
        if dst.shape != value.shape:
            raise RunFailed(f"{PACKED_NAME}: segment result has shape {list(value.shape)}, the library expects "
                            f"{list(dst.shape)}")
        np.copyto(dst, value, casting="same_kind")
    else:
        out.copyfrom(np.asarray(value, dtype=out.dtype, order="C"))


def _run_segment(*args: Any) -> None:
    try:
        table = getattr(_local, "table", None)
        if table is None:
            raise RunFailed(f"{PACKED_NAME} called outside TvmRankExecutable.run (no fallback sessions bound)")
        key = int(args[0])
        entry = table.get(key)
        if entry is None:
            raise RunFailed(f"{PACKED_NAME}: no ONNX Runtime segment {key} in this rank")
        n_in = len(entry.inputs)
        feeds = {name: np.asarray(_to_numpy(t), order="C") for name, t in zip(entry.inputs, args[1:1 + n_in])}
        from backends.onnxruntime import run_session

        outs = args[1 + n_in:]
        results = run_session(entry.session, list(entry.outputs), feeds, entry.elems,
                              {n: tuple(int(d) for d in o.shape) for n, o in zip(entry.outputs, outs)})
        for out, value in zip(outs, results):
            _write(out, np.asarray(value))
    except BaseException as e:  # keep the real error for the executable to re-raise
        _local.error = e
        raise


def register() -> None:
    """Register ``partitioner.ort_segment`` once per process."""
    global _registered
    with _register_lock:
        if _registered:
            return
        import tvm

        tvm.register_global_func(PACKED_NAME, _run_segment, override=True)
        _registered = True
