"""The reference backend: ONNX Runtime runs each pure segment, comm steps run through
:func:`partitioner.core.comm_ops.execute` (backend contract in :mod:`backends`).

:func:`partitioner.runtime.in_process.run_reference` runs all ranks of a lowered plan with this
backend in one process (one thread per rank, :class:`LocalWorld` comms): the oracle that proves a
plan right without MPI.
"""

from __future__ import annotations

import pathlib
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


def lacks_kernel(exc: BaseException, where: str) -> None:
    """Raise :class:`UnsupportedByBackendError` when ``exc`` is ORT saying it has no kernel for an op
    (``NOT_IMPLEMENTED``): ORT lists the op itself, so this is a refusal naming it, not a failure."""
    from partitioner.core.errors import UnsupportedByBackendError

    text = str(exc).strip()
    if "NOT_IMPLEMENTED" in text:
        first = text.splitlines()[0]
        raise UnsupportedByBackendError(f"{where}: ONNX Runtime has no kernel for it ({first[:300]})") from None


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


class RankExecutable:
    """One rank's program as ORT sessions (one per segment) and comm steps, run in order."""

    def __init__(self, program: onnx.ModelProto, *, threads: int = 1, weights_dir: pathlib.Path | None = None) -> None:
        import onnxruntime as ort

        opts = ort.SessionOptions()
        opts.intra_op_num_threads = max(1, int(threads))
        opts.inter_op_num_threads = 1
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
                try:
                    sess = ort.InferenceSession(step.model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
                except Exception as exc:
                    lacks_kernel(exc, f"segment {step.index} of {program.graph.name!r}")
                    raise BackendError(f"onnxruntime cannot load segment {step.index} of "
                                       f"{program.graph.name!r}: {str(exc).splitlines()[0]}") from None
                self.steps.append((step, (sess, elem_types(step.model))))
            else:
                self.steps.append((step, None))

    def run(self, feeds: Mapping[str, np.ndarray], comm: comm_ops.Communicator) -> dict[str, np.ndarray]:
        env: dict[str, np.ndarray] = dict(feeds)
        for step, run in self.steps:
            if isinstance(step, CommStep):
                outs = comm_ops.execute(step.op, [env.get(i) for i in step.op.inputs], comm)
                env.update(zip(step.outputs, outs))
            else:
                sess, elems = run
                try:
                    res = sess.run(list(step.outputs), {n: to_ort(env[n], elems.get(n, 0)) for n in step.inputs})
                    res = [from_ort(r, elems.get(n, 0)) for n, r in zip(step.outputs, res)]
                except Exception as exc:  # noqa: BLE001 - ORT raises its own classes; one line names it
                    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                    raise RunFailed(f"onnxruntime failed on segment {step.index} of {self.name!r}: "
                                    f"{type(exc).__name__}: {first[:300]}") from None
                env.update(zip(step.outputs, res))
        return {n: env[n] for n in self.outputs}


def load(program: onnx.ModelProto, path: pathlib.Path | None = None, *, threads: int = 1) -> RankExecutable:
    """A :class:`RankExecutable` for ``program`` (``path`` is the built file; the proto suffices).
    Weights that ``program`` leaves in external data (loaded with ``load_external_data=False``)
    are read by ONNX Runtime from ``path``'s folder, which memory-maps page-aligned ones."""
    if program is None and path is not None:
        program = onnx.load(str(path))
    lazy = path is not None and any(t.data_location == onnx.TensorProto.EXTERNAL and not t.raw_data
                                    for t in program.graph.initializer)
    return RankExecutable(program, threads=threads, weights_dir=pathlib.Path(path).parent if lazy else None)
