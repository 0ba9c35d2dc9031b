"""Run a TVM-built rank library: load the ``.so``, bind the comm ops to a communicator.

Rules:
1. The library calls ``partitioner.comm.<Op>`` packed functions with ``(inputs..., op_id[, out])``
   (see :mod:`backends.tvm.lower`). This module registers them once per process with
   ``tvm.register_global_func(name, f, override=True)`` (``tvm_ffi.register_global_func``).
2. op_ids are per-program indices baked into the library, so the packed functions dispatch
   through a *thread-local* context ``(communicator, comm table)`` that :meth:`TvmRankExecutable.run`
   sets around the VM call. The VM runs on the calling thread, so several ranks can run in
   threads of one process (tests, the in-process runner), each seeing its own communicator.
3. Tensors cross the boundary without copies on the CPU: ``np.from_dlpack(inp)`` and
   ``np.copyto(np.from_dlpack(out), result)``; device tensors go through ``.numpy()``/``copyfrom``.
4. An exception inside a comm op is kept and re-raised from ``run`` as itself (a RunFailed from
   the communicator stays a RunFailed), not as TVM's wrapped error.

Threads: TVM sizes its CPU thread pool from ``TVM_NUM_THREADS`` when the pool first starts;
:func:`configure_threads` sets that variable and also calls ``runtime.config_threadpool(1, n)``
(mode 1 = TVM's default "big cores" mode) so a later change takes effect too. The pool is
per process: ranks running as threads of one process share it. Untuned TVM kernels are mostly
serial loops, so threads matter little until schedules/tuning arrive.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import onnx

from partitioner.comm_ops import OPS, CommOp, Communicator, execute
from partitioner.errors import BackendError, InputError, PartitionerError, RunFailed

from .lower import KEEP_FUNC, PACKED_PREFIX, comm_table

_local = threading.local()
_register_lock = threading.Lock()
_registered = False
_threads: int | None = None


def configure_threads(threads: int) -> None:
    """Ask TVM's runtime for ``threads`` worker threads (see the module docstring)."""
    global _threads
    threads = max(1, int(threads))
    with _register_lock:
        if _threads == threads:  # reconfiguring restarts the pool: only when the count changes
            return
        os.environ["TVM_NUM_THREADS"] = str(threads)
        import tvm

        config = tvm.get_global_func("runtime.config_threadpool", allow_missing=True)
        if config is not None:
            config(1, threads)
        _threads = threads


def _to_numpy(t: Any) -> np.ndarray:
    if t.device.dlpack_device_type() == 1:  # kDLCPU: a view, no copy
        return np.from_dlpack(t)
    return t.numpy()


def _write(out: Any, value: np.ndarray) -> None:
    if out.device.dlpack_device_type() == 1:
        dst = np.from_dlpack(out)
        if dst.shape != value.shape:
            raise RunFailed(f"comm op result has shape {list(value.shape)}, the library expects {list(dst.shape)}")
        np.copyto(dst, value, casting="same_kind")
    else:
        out.copyfrom(np.ascontiguousarray(value, dtype=out.dtype))


def _handler(op_type: str):
    def run_comm(*args: Any) -> None:
        ctx = getattr(_local, "ctx", None)
        if ctx is None:
            raise RunFailed(f"{PACKED_PREFIX}{op_type} called outside TvmRankExecutable.run (no communicator bound)")
        comm, ops = ctx
        try:
            has_out = op_type != "Send"
            op_id = int(args[-2] if has_out else args[-1])
            op: CommOp = ops[op_id]
            tensors = args[:-2] if has_out else args[:-1]
            results = execute(op, [_to_numpy(t) for t in tensors], comm)
            if has_out:
                _write(args[-1], results[0])
        except BaseException as e:  # keep the real error for run() to re-raise
            _local.error = e
            raise

    return run_comm


def _keep(*_args: Any) -> None:
    """Impure sink that keeps an otherwise unread comm output alive (see lower.py)."""


def register_comm_functions() -> None:
    """Register ``partitioner.comm.<Op>`` (and the keep sink) once per process."""
    global _registered
    with _register_lock:
        if _registered:
            return
        import tvm

        for op_type in OPS:
            tvm.register_global_func(PACKED_PREFIX + op_type, _handler(op_type), override=True)
        tvm.register_global_func(KEEP_FUNC, _keep, override=True)
        _registered = True


class TvmRankExecutable:
    """A loaded rank library. ``run`` is safe to call from one thread per executable."""

    def __init__(self, program: onnx.ModelProto, path: Path, *, threads: int = 1) -> None:
        import tvm
        from tvm import relax

        configure_threads(threads)
        register_comm_functions()
        self.path = Path(path)
        if not self.path.is_file():
            raise BackendError(f"{self.path}: rank library not found; build it first (partitioner compile)")
        try:
            lib = tvm.runtime.load_module(str(self.path))
        except Exception as e:
            raise BackendError(f"{self.path}: TVM cannot load this library ({str(e).strip().splitlines()[-1] if str(e).strip() else e}); rebuild it with this TVM version") from None
        self.device = tvm.cuda(0) if _has_cuda_code(lib) else tvm.cpu(0)
        self._vm = relax.VirtualMachine(lib, self.device)
        self._main = self._vm["main"]
        init_names = {t.name for t in program.graph.initializer}
        self.inputs = tuple(v.name for v in program.graph.input if v.name not in init_names)
        self.outputs = tuple(v.name for v in program.graph.output)
        self.comm_ops = comm_table(program)

    def run(self, feeds: dict[str, np.ndarray], comm: Communicator) -> dict[str, np.ndarray]:
        import tvm

        missing = [n for n in self.inputs if n not in feeds]
        if missing:
            raise InputError(f"{self.path.name}: missing input(s) {', '.join(missing)}; expected {', '.join(self.inputs)}")
        args = [tvm.runtime.tensor(np.ascontiguousarray(feeds[n]), self.device) for n in self.inputs]
        _local.ctx = (comm, self.comm_ops)
        _local.error = None
        try:
            res = self._main(*args)
        except Exception as e:
            err = getattr(_local, "error", None)
            if isinstance(err, PartitionerError):
                raise err from None
            if err is not None:
                raise RunFailed(f"rank {getattr(comm, 'rank', '?')}: comm op failed in {self.path.name}: {type(err).__name__}: {err}") from err
            raise RunFailed(f"rank {getattr(comm, 'rank', '?')}: {self.path.name} failed: {str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__}") from e
        finally:
            _local.ctx = None
            _local.error = None
        values = list(res) if not isinstance(res, tvm.runtime.Tensor) else [res]
        return {name: v.numpy() for name, v in zip(self.outputs, values)}


def _has_cuda_code(lib: Any) -> bool:
    try:
        return any(m.kind == "cuda" or getattr(m, "type_key", "") == "cuda" for m in _imports(lib))
    except Exception:
        return False


def _imports(lib: Any) -> Sequence[Any]:
    found, stack = [], list(getattr(lib, "imports", []) or [])
    while stack:
        m = stack.pop()
        found.append(m)
        stack.extend(getattr(m, "imports", []) or [])
    return found


def load(program: onnx.ModelProto, path: Path, *, threads: int = 1) -> TvmRankExecutable:
    """Backend contract: load ``path`` (built from ``program``) as a runnable rank."""
    return TvmRankExecutable(program, path, threads=threads)
