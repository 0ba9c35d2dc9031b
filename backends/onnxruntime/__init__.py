"""The reference backend: ONNX Runtime runs each pure segment, comm steps run through
:func:`partitioner.core.comm_ops.execute` (backend contract in :mod:`backends`).

:func:`partitioner.runtime.in_process.run_reference` runs all ranks of a lowered plan with this
backend in one process (one thread per rank, :class:`LocalWorld` comms): the oracle that proves a
plan right without MPI.
"""

from __future__ import annotations

import os
import pathlib
import re
from typing import Any, Mapping

import numpy as np
import onnx

from partitioner.core import comm_ops
from partitioner.core.errors import BackendError, RunFailed
from partitioner.core.segments import CommStep, Segment, split_program

NAME = "onnxruntime"
FILE_SUFFIX = ".onnx"
# Element types ONNX Runtime's Python API exchanges as raw bytes: it takes them as an OrtValue made
# from a uint8 view and returns them as uint8 arrays. :func:`to_ort`/:func:`from_ort` convert, so
# callers see the ml_dtypes arrays onnx's own reference uses (rule: one numpy dtype per ONNX type).
BYTE_VIEW_TYPES = frozenset(getattr(onnx.TensorProto, n) for n in ("FLOAT8E4M3FN", "FLOAT8E4M3FNUZ", "FLOAT8E5M2",
                            "FLOAT8E5M2FNUZ") if hasattr(onnx.TensorProto, n))
# Element types ONNX Runtime 1.32's Python API cannot exchange (it has no numpy type for them:
# "No corresponding Numpy type for Tensor Type"): a graph input or output of these types is refused
# before building. Inputs of the byte-view types go in as OrtValues; only float8e4m3fn comes back.
NO_PYTHON_TYPES = frozenset(getattr(onnx.TensorProto, n) for n in ("FLOAT8E8M0", "INT4", "UINT4", "INT2", "UINT2",
                            "FLOAT4E2M1") if hasattr(onnx.TensorProto, n))
NO_PYTHON_OUTPUT_TYPES = NO_PYTHON_TYPES | frozenset(getattr(onnx.TensorProto, n) for n in (
    "FLOAT8E4M3FNUZ", "FLOAT8E5M2", "FLOAT8E5M2FNUZ") if hasattr(onnx.TensorProto, n))


def elem_types(model: onnx.ModelProto) -> dict[str, int]:
    """Element type of each graph input and output of ``model`` (0 when not a tensor)."""
    return {v.name: v.type.tensor_type.elem_type for v in [*model.graph.input, *model.graph.output]}


def static_shapes(model: onnx.ModelProto) -> dict[str, tuple[int, ...]]:
    """Static shape of each graph output of ``model`` that has one (for :func:`run_session`)."""
    out = {}
    for v in model.graph.output:
        dims = v.type.tensor_type.shape.dim if v.type.HasField("tensor_type") else None
        if dims is not None and v.type.tensor_type.HasField("shape") and all(d.HasField("dim_value") for d in dims):
            out[v.name] = tuple(int(d.dim_value) for d in dims)
    return out


def to_ort(value: np.ndarray, elem: int) -> Any:
    """``value`` as ORT takes it: an OrtValue of the right ONNX type for a byte-view type."""
    if elem in BYTE_VIEW_TYPES:
        import onnxruntime as ort

        return ort.OrtValue.ortvalue_from_numpy_with_onnx_type(np.ascontiguousarray(value).view(np.uint8), elem)
    return value


def from_ort(value: np.ndarray, elem: int) -> np.ndarray:
    """``value`` as ORT returned it, viewed as its ONNX type's numpy dtype for a byte-view type."""
    if elem in BYTE_VIEW_TYPES and isinstance(value, np.ndarray) and value.dtype == np.uint8:
        return value.view(onnx.helper.tensor_dtype_to_np_dtype(elem))
    return value


# Element types ORT's Python API takes as an OrtValue made from a uint16 view but cannot return as
# numpy ("No corresponding Numpy type for Tensor Type. bfloat16"): :func:`run_session` binds such an
# output to a uint16 buffer of the expected shape (IOBinding) and views it as ml_dtypes' bfloat16.
UINT16_VIEW_TYPES = frozenset({onnx.TensorProto.BFLOAT16})


def run_session(sess: Any, outputs: list[str], feeds: Mapping[str, np.ndarray], elems: Mapping[str, int],
                out_shapes: Mapping[str, tuple[int, ...]] | None = None) -> list[np.ndarray]:
    """``sess.run`` for any element type the project's arrays hold (rule: one numpy dtype per ONNX
    type, the ml_dtypes one for bfloat16/float8). bfloat16 inputs go in as uint16-view OrtValues;
    bfloat16 outputs need their shape (``out_shapes``) and come back through an IOBinding."""
    import onnxruntime as ort

    def _in(n: str, x: np.ndarray) -> Any:
        e = elems.get(n, 0)
        if e in UINT16_VIEW_TYPES:
            return ort.OrtValue.ortvalue_from_numpy_with_onnx_type(np.ascontiguousarray(x).view(np.uint16), e)
        return to_ort(x, e)

    wide = [n for n in outputs if elems.get(n, 0) in UINT16_VIEW_TYPES]
    if not wide and not any(elems.get(n, 0) in UINT16_VIEW_TYPES for n in feeds):
        return [from_ort(r, elems.get(n, 0)) for n, r in zip(outputs, sess.run(outputs, {n: to_ort(x, elems.get(n, 0))
                                                                                        for n, x in feeds.items()}))]
    if wide and (out_shapes is None or any(n not in out_shapes for n in wide)):
        raise RunFailed(f"onnxruntime cannot return the bfloat16 output(s) {', '.join(wide)} without their shape")
    io = sess.io_binding()
    for n, x in feeds.items():
        v = _in(n, x)
        if isinstance(v, np.ndarray):
            io.bind_cpu_input(n, np.ascontiguousarray(v))
        else:
            io.bind_ortvalue_input(n, v)
    bufs = {}
    for n in outputs:
        if n in wide:
            bufs[n] = np.empty(out_shapes[n], dtype=np.uint16)
            io.bind_output(n, "cpu", 0, elems[n], list(bufs[n].shape), bufs[n].ctypes.data)
        else:
            io.bind_output(n, "cpu")
    sess.run_with_iobinding(io)
    res = []
    for n, r in zip(outputs, io.get_outputs()):
        res.append(bufs[n].view(onnx.helper.tensor_dtype_to_np_dtype(elems[n])) if n in bufs
                   else from_ort(r.numpy(), elems.get(n, 0)))
    return res


def lacks_kernel(exc: BaseException, where: str) -> None:
    """Raise :class:`UnsupportedByBackendError` when ``exc`` is ORT saying it has no kernel for an op
    (``NOT_IMPLEMENTED``): ORT lists the op itself, so this is a refusal naming it, not a failure."""
    from partitioner.core.errors import UnsupportedByBackendError

    text = str(exc).strip()
    locale = re.search(r"Failed to construct locale with name:\s*([^:\s]+)", text)
    if locale:  # StringNormalizer's case change needs the C++ locale installed on this machine
        raise UnsupportedByBackendError(f"{where}: ONNX Runtime's StringNormalizer needs the locale {locale.group(1)}, "
                                        "which this machine does not have (install it, e.g. locale-gen, or set the "
                                        "node's locale attribute to an installed one)") from None
    if "NOT_IMPLEMENTED" in text:
        first = text.splitlines()[0]
        raise UnsupportedByBackendError(f"{where}: ONNX Runtime has no kernel for it ({first[:300]})") from None


def _init_or_const(model: onnx.ModelProto, name: str) -> list[int] | None:
    for t in model.graph.initializer:
        if t.name == name:
            return list(t.dims)
    for v in [*model.graph.input, *model.graph.value_info]:
        if v.name == name and v.type.HasField("tensor_type") and v.type.tensor_type.HasField("shape"):
            dims = v.type.tensor_type.shape.dim
            return [int(d.dim_value) for d in dims] if all(d.HasField("dim_value") for d in dims) else None
    return None


def _align_corners_fractional(model: onnx.ModelProto, node: onnx.NodeProto) -> bool:
    mode = next((a.s for a in node.attribute if a.name == "coordinate_transformation_mode"), b"half_pixel")
    if mode != b"align_corners" or len(node.input) < 3 or not node.input[2] or (len(node.input) > 3 and node.input[3]):
        return False
    scales = next((onnx.numpy_helper.to_array(t) for t in model.graph.initializer if t.name == node.input[2]), None)
    dims = _init_or_const(model, node.input[0])
    if scales is None or dims is None:
        return True  # run-time scales: the output length may be fractional
    lengths = np.asarray(dims, dtype=np.float64) * scales.astype(np.float64)
    return bool(np.any(np.abs(lengths - np.round(lengths)) > 1e-6))


def check_forms(model: onnx.ModelProto, where: str) -> None:
    """Raise :class:`UnsupportedByBackendError` naming the node forms ONNX Runtime 1.32 has a kernel
    for but fails on at run time (so they are refused when the session is made, not mid-run):
    ConvInteger with a per-channel ``w_zero_point`` ("Non per-tensor quantization is not supported"),
    and the forms whose numbers differ from ONNX's definition: MaxUnpool with ``output_shape``,
    Resize ``align_corners`` with scales that give a fractional output length."""
    from partitioner.core.errors import UnsupportedByBackendError

    bad = []
    for n in model.graph.node:
        if n.domain not in ("", "ai.onnx"):
            continue
        why = ""
        if n.op_type == "ConvInteger" and len(n.input) > 3 and n.input[3]:
            dims = _init_or_const(model, n.input[3])
            if dims is None or int(np.prod(dims, dtype=np.int64)) != 1:
                why = "ConvInteger with a per-channel w_zero_point"
        elif n.op_type == "MaxUnpool" and len(n.input) > 2 and n.input[2]:
            why = "MaxUnpool with an output_shape input (ORT places the values differently from ONNX's definition)"
        elif n.op_type == "Resize" and _align_corners_fractional(model, n):
            why = ("Resize align_corners with scales that give a fractional output length (ORT uses the rounded "
                   "length where ONNX's definition uses scale * input length)")
        if why:
            bad.append(f"{n.name or '<unnamed>'} ({why})")
    if bad:
        raise UnsupportedByBackendError(f"{where}: ONNX Runtime's kernels do not compute {', '.join(bad[:8])}")


def check_types(program: onnx.ModelProto) -> None:
    """Raise :class:`UnsupportedByBackendError` naming the values ORT's Python API cannot pass."""
    from partitioner.core.errors import UnsupportedByBackendError

    g = program.graph
    pairs = [(v, NO_PYTHON_TYPES) for v in g.input] + [(v, NO_PYTHON_OUTPUT_TYPES) for v in g.output]
    bad = sorted({f"{v.name} ({onnx.TensorProto.DataType.Name(v.type.tensor_type.elem_type)})" for v, types in pairs
                  if v.type.HasField("tensor_type") and v.type.tensor_type.elem_type in types})
    if bad:
        raise UnsupportedByBackendError(f"graph {g.name!r}: ONNX Runtime's Python API cannot pass the value(s) "
                                        f"{', '.join(bad[:8])}")


def build(program: onnx.ModelProto, out_path: pathlib.Path, *, target: Any = None, options: Any = None) -> dict:
    """Write the per-rank program (ONNX Runtime runs the .onnx itself)."""
    import onnxruntime

    check_types(program)
    out_path = pathlib.Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_bytes(program.SerializeToString())
    return {"backend": NAME, "onnxruntime": onnxruntime.__version__, "file": out_path.name}


_ENV_ARENA: list[bool] = []
#: the process arena's ``max_dead_bytes_per_chunk`` (ONNX Runtime's default: 128 MiB). A free
#: chunk is split for a smaller request only when the rest would exceed it, so by default a 100 MiB
#: free chunk serves a 1 MiB tensor whole and the training step's peak RSS crept up over the steps.
#: Measured (session 31, one session, 1 thread, buffer reuse off, peak RSS above the loaded process
#: at step 20, 128 MiB / 1 MiB): zoo resnet b64 362 / 329 MiB, bert b32 153 / 141, heldout_unet b8
#: 142 / 138, mlp b64 41 / 41; step time with this and buffer reuse off against ORT's defaults
#: 0.96-1.00 (unet, resnet, bert, mlp; 10 interleaved steps each). The environment's
#: ``PARTITIONER_ORT_ARENA_MAX_DEAD_BYTES`` sets another value.
ARENA_MAX_DEAD_BYTES = int(os.environ.get("PARTITIONER_ORT_ARENA_MAX_DEAD_BYTES", str(1 << 20)))


def _shared_arena() -> None:
    """Register one CPU arena allocator in ONNX Runtime's process environment (once): sessions
    made with ``session.use_env_allocators`` then take their buffers from it, so the segments of a
    program split at its comm ops reuse one arena instead of each keeping its own peak (a
    training rank's step is several segments: docs/training.md)."""
    if _ENV_ARENA:
        return
    import onnxruntime as ort

    info = ort.OrtMemoryInfo("Cpu", ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0, ort.OrtMemType.DEFAULT)
    config = ort.OrtArenaCfg({"max_dead_bytes_per_chunk": ARENA_MAX_DEAD_BYTES})
    ort.create_and_register_allocator(info, config)
    _ENV_ARENA.append(True)


class RankExecutable:
    """One rank's program as ORT sessions (one per segment) and comm steps, run in order."""

    def __init__(self, program: onnx.ModelProto, *, threads: int = 1, weights_dir: pathlib.Path | None = None,
                 shared_arena: bool = False, memory_pattern: bool = True, memory_reuse: bool = True) -> None:
        import onnxruntime as ort

        opts = ort.SessionOptions()
        opts.intra_op_num_threads = max(1, int(threads))
        opts.inter_op_num_threads = 1
        opts.enable_mem_pattern = bool(memory_pattern)  # off: training steps (runner.MEMORY_PATTERN)
        opts.enable_mem_reuse = bool(memory_reuse)  # off: training steps (runner.MEMORY_REUSE)
        if shared_arena:  # one CPU arena for every segment's session (not one each): _shared_arena
            _shared_arena()
            opts.add_session_config_entry("session.use_env_allocators", "1")
        opts.log_severity_level = 3
        if weights_dir is not None:  # ORT memory-maps rank<i>.data itself (docs/large_models.md)
            opts.add_session_config_entry("session.model_external_initializers_file_folder_path", str(weights_dir))
        check_types(program)  # types ORT's Python API cannot pass: refused before any session is made
        self.outputs = [o.name for o in program.graph.output]
        inits = {t.name for t in program.graph.initializer}
        for kind, values in (("input", [v for v in program.graph.input if v.name not in inits]),
                             ("output", list(program.graph.output))):
            for v in values:
                which = v.type.WhichOneof("value")
                if which not in ("tensor_type", None):
                    raise BackendError(f"graph {program.graph.name!r}: {kind} {v.name!r} is {which.replace('_type', '')}-typed; "
                                       "artifacts take and return tensors only (npz files)")
        self.name = program.graph.name
        self.steps: list[tuple[Any, Any]] = []
        for step in split_program(program):
            if isinstance(step, Segment):
                if not step.outputs:
                    continue
                check_forms(step.model, f"segment {step.index} of {program.graph.name!r}")
                try:
                    sess = ort.InferenceSession(step.model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
                except Exception as exc:
                    lacks_kernel(exc, f"segment {step.index} of {program.graph.name!r}")
                    raise BackendError(f"onnxruntime cannot load segment {step.index} of "
                                       f"{program.graph.name!r}: {str(exc).splitlines()[0]}") from None
                self.steps.append((step, (sess, elem_types(step.model), static_shapes(step.model))))
            else:
                self.steps.append((step, None))

    def run(self, feeds: Mapping[str, np.ndarray], comm: comm_ops.Communicator) -> dict[str, np.ndarray]:
        env: dict[str, np.ndarray] = dict(feeds)
        for step, run in self.steps:
            if isinstance(step, CommStep):
                outs = comm_ops.execute(step.op, [env.get(i) for i in step.op.inputs], comm)
                env.update(zip(step.outputs, outs))
            else:
                env.update(zip(step.outputs, self._segment(step, run, env)))
        return {n: env[n] for n in self.outputs}

    def _segment(self, step: Any, run: Any, env: Mapping[str, np.ndarray]) -> list[np.ndarray]:
        """One ORT segment's outputs (``run``: the session, element types and static shapes)."""
        sess, elems, shapes = run
        try:
            return run_session(sess, list(step.outputs), {n: env[n] for n in step.inputs}, elems, shapes)
        except Exception as exc:  # noqa: BLE001 - ORT raises its own classes; one line names it
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise RunFailed(f"onnxruntime failed on segment {step.index} of {self.name!r}: "
                            f"{type(exc).__name__}: {first[:300]}") from None


def load(program: onnx.ModelProto, path: pathlib.Path | None = None, *, threads: int = 1) -> RankExecutable:
    """A :class:`RankExecutable` for ``program`` (``path`` is the built file; the proto suffices).
    Weights that ``program`` leaves in external data (loaded with ``load_external_data=False``)
    are read by ONNX Runtime from ``path``'s folder, which memory-maps page-aligned ones."""
    if program is None and path is not None:
        program = onnx.load(str(path))
    lazy = path is not None and any(t.data_location == onnx.TensorProto.EXTERNAL and not t.raw_data
                                    for t in program.graph.initializer)
    return RankExecutable(program, threads=threads, weights_dir=pathlib.Path(path).parent if lazy else None)
