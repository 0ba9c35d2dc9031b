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


def build(program: onnx.ModelProto, out_path: pathlib.Path, *, target: Any = None, options: Any = None) -> dict:
    """Write the per-rank program (ONNX Runtime runs the .onnx itself)."""
    import onnxruntime

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
                    raise BackendError(f"onnxruntime cannot load segment {step.index} of "
                                       f"{program.graph.name!r}: {str(exc).splitlines()[0]}") from None
                self.steps.append((step, sess))
            else:
                self.steps.append((step, None))

    def run(self, feeds: Mapping[str, np.ndarray], comm: comm_ops.Communicator) -> dict[str, np.ndarray]:
        env: dict[str, np.ndarray] = dict(feeds)
        for step, sess in self.steps:
            if isinstance(step, CommStep):
                outs = comm_ops.execute(step.op, [env.get(i) for i in step.op.inputs], comm)
                env.update(zip(step.outputs, outs))
            else:
                try:
                    res = sess.run(list(step.outputs), {n: env[n] for n in step.inputs})
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
