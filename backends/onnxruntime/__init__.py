"""The reference backend: ONNX Runtime runs each pure segment, comm steps run through
:func:`partitioner.comm_ops.execute` (backend contract in :mod:`backends`).

:func:`run_reference` runs all ranks of a lowered plan in one process (one thread per rank,
:class:`LocalWorld` comms): the oracle that proves a plan right without MPI. A failure on any
rank aborts the world, so no thread waits forever, and is re-raised as :class:`RunFailed`
naming the rank.
"""

from __future__ import annotations

import pathlib
import threading
from typing import Any, Mapping, Sequence

import numpy as np
import onnx

from partitioner import comm_ops
from partitioner.bindings import Bindings, gather_outputs, scatter_inputs
from partitioner.errors import BackendError, PartitionerError, RunFailed
from partitioner.segments import CommStep, Segment, split_program

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

    def __init__(self, program: onnx.ModelProto, *, threads: int = 1) -> None:
        import onnxruntime as ort

        opts = ort.SessionOptions()
        opts.intra_op_num_threads = max(1, int(threads))
        opts.inter_op_num_threads = 1
        opts.log_severity_level = 3
        self.outputs = [o.name for o in program.graph.output]
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
                res = sess.run(list(step.outputs), {n: env[n] for n in step.inputs})
                env.update(zip(step.outputs, res))
        return {n: env[n] for n in self.outputs}


def load(program: onnx.ModelProto, path: pathlib.Path | None = None, *, threads: int = 1) -> RankExecutable:
    """A :class:`RankExecutable` for ``program`` (``path`` is the built file; the proto suffices)."""
    if program is None and path is not None:
        program = onnx.load(str(path))
    return RankExecutable(program, threads=threads)


def run_reference(programs: Sequence[onnx.ModelProto], bindings: Bindings, feeds: Mapping[str, np.ndarray], *,
                  timeout_s: float = 120.0, threads: int = 1) -> dict[str, np.ndarray]:
    """Run every rank in this process and return the global outputs (see the module docstring)."""
    from partitioner.runtime.comm_local import LocalWorld

    per_rank_in = scatter_inputs(bindings, feeds)
    world = LocalWorld(bindings.world_size, timeout_s=timeout_s)
    exes = [load(p, threads=threads) for p in programs]
    results: list[list[dict[str, np.ndarray]]] = [[] for _ in programs]
    errors: dict[int, BaseException] = {}

    def work(r: int) -> None:
        comm = world.communicator(r)
        try:
            for k in range(bindings.microbatches):
                results[r].append(exes[r].run(per_rank_in[r][k], comm))
        except BaseException as exc:  # any failure must wake the other ranks
            errors[r] = exc
            world.abort(f"rank {r} failed: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}")

    threads_ = [threading.Thread(target=work, args=(r,), name=f"rank{r}", daemon=True) for r in range(len(programs))]
    for t in threads_:
        t.start()
    for t in threads_:
        t.join(timeout_s + 5)
    if any(t.is_alive() for t in threads_):
        world.abort("run_reference timed out")
        raise RunFailed(f"run_reference: rank(s) {[i for i, t in enumerate(threads_) if t.is_alive()]} did not finish "
                        f"within {timeout_s:.0f} s")
    if errors:
        # report the first rank that failed on its own (others were woken by the abort)
        first = min(errors, key=lambda r: (isinstance(errors[r], RunFailed) and "aborted" in str(errors[r]), r))
        exc = errors[first]
        msg = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        if isinstance(exc, PartitionerError) and not isinstance(exc, RunFailed):
            raise RunFailed(f"rank {first}: {msg}") from exc
        raise RunFailed(msg if msg.startswith(f"rank {first}") else f"rank {first}: {msg}") from exc
    return gather_outputs(bindings, results)
