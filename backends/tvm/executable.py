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
   ``np.copyto(np.from_dlpack(out), result)`` (a ``Recv`` receives straight into the output tensor
   when the communicator has ``recv_into``); GPU tensors go to :mod:`backends.tvm.device_comm`
   (NCCL on device pointers, or staged through host memory over MPI). A CUDA library runs on GPU
   ``local rank % GPU count`` (:func:`cuda_device_index`).
   One exception: ``Send`` copies its input before the non-blocking send, because the VM's static
   memory plan may reuse that storage for a later tensor of the same call (or the next call may
   overwrite a persistent input buffer) while the message is still in flight.
5. The per-call path is kept lean (it is the per-micro-batch runtime overhead): on the CPU each
   input has one persistent TVM tensor, filled with ``np.copyto`` through a cached numpy view
   (``tvm.runtime.tensor`` costs ~100x more), and outputs are returned as ``np.from_dlpack`` views
   of the VM's fresh result tensors (no copy); an output that is an input buffer or a view of one is copied.
   ``vm_s`` accumulates the seconds spent inside the VM call (for the worker's ``--profile``).
   Whether an output aliases an input buffer is a property of the program (an output is the VM's
   fresh storage, or a view of an argument), so with ``CACHE_OUTPUT_ALIASING`` it is checked on
   the first call and remembered until an input buffer is reallocated or a different set of
   inputs comes as rule 9's tensors (the checks cost the resnet's first pipeline stage, 124 outputs
   a forward call, about 5 ms a step).
   With ``reuse_readonly_inputs`` (set by a caller that never changes an array it made
   read-only: the pipeline runner's weights, constant through a step's micro-batches) a feed
   that is the very read-only array a buffer was last filled from is not copied again.
6. Programs with ONNX Runtime fallback segments (:mod:`backends.tvm.fallback`) get one
   ``InferenceSession`` per segment at load time, bound thread-locally around the VM call like the
   communicator; the library calls them through ``partitioner.ort_segment``.
7. On the CPU, a program without comm ops or fallback segments run with 2+ threads is watched by
   the calling thread's contention guard (:mod:`backends.tvm.contention`): a run whose calling
   thread was switched out involuntarily ``CONTENTION_SWITCHES`` times or more, and about once per
   parallel kernel (per ``CONTENTION_CPU_MS_PER_SWITCH`` of its CPU time: the pool taking turns on
   one core, or yielding to other processes), drops that thread's pool to 1 thread for a while,
   then probes the requested count again.
8. A library with step-constant transforms lifted out of ``main`` (:mod:`backends.tvm.lift_step_constants`)
   keeps the results of ``main_transform_params`` and calls it again only when one of its
   step-constant input buffers was refilled on this call (rule 5: a read-only weight it already
   holds is not); ``main`` gets those results in place of the step constants. The old results
   are dropped before the new ones are computed (not alive together), and
   :meth:`TvmRankExecutable.release_step_constants` drops them for a caller that will change the
   step constants before the next call (the pipeline runner, after a program's last call of a
   step).
9. With ``keep_output_tensors`` (set by a caller that feeds some outputs of this call straight
   into another program, the pipeline runner's stash and its weights) ``output_tensors`` holds this
   call's output tensors that were returned without a copy, and ``run`` passes a feed that is a CPU
   ``tvm.runtime.Tensor`` to the VM as it is (no copy into an input buffer). The VM never writes
   its inputs, and the tensor is a fresh result of an earlier call, held by the caller. A step
   constant (rule 8) given as the same tensor object as on the last call does not rerun the lifted
   transforms (the caller never writes a tensor it feeds: the pipeline runner's weights are
   replaced each step, not written). An input given as a tensor frees the persistent buffer an
   earlier array of it filled (``RELEASE_PASSED_BUFFERS``; a later array makes a new one).
4. An exception inside a comm op or a fallback segment is kept and re-raised from ``run`` as itself (a RunFailed from
   the communicator stays a RunFailed), not as TVM's wrapped error.
10. The fast call path (``FAST_CALL_PATH``): a CPU program without comm ops, ONNX Runtime
   fallback segments or lifted step constants (decided once, at load) needs none of rule 2's and
   rule 6's thread-local bindings, so once its input buffers exist and its outputs' aliasing is
   known (rule 5, after the first call), a call whose feeds are numpy arrays of the buffers'
   shapes and dtypes, without ``keep_output_tensors`` / ``reuse_readonly_inputs``, runs a lean
   path: one copy per input, the VM call (the contention guard and ``vm_s`` as in the general
   path), one ``ffi.ArrayGetItem`` per output (``Array`` slicing costs a ``len`` and a generator:
   ~1.2 us for one output, measured), the remembered aliasing. Any other call takes the general
   path, which the fast one returns to for a new shape, dtype, a tensor feed or a missing input.
   Same results bit for bit (tests/backends/test_tvm_fast_call_path.py). It is for tiny models
   (openwakeword timer / hey_jarvis: ~20 us in the VM; around it, 1 thread, hey_jarvis: ~8 us on
   the general path, ~4 us on this one; docs/per_device_speed.md, session 15).

Threads: TVM sizes its CPU thread pool from ``TVM_NUM_THREADS`` when the pool first starts.
TVM also pins its threads to cores by itself (starting from core 0), which overrides the core
share a worker pinned the process to: two 1-thread ranks then both land on core 0 and each runs
at half speed (measured: resnet b4 315 ms with binding, 149 ms without, two ranks at once). So
:func:`configure_threads` sets ``TVM_BIND_THREADS=0`` (unless the user set it) and the process
affinity decides;
:func:`configure_threads` creates the pool with as many workers as the process may run on
(its affinity; a later ``config_threadpool`` can use fewer workers than the pool has, never
more: a pool created for 1 thread stayed at 1 after asking for 2) and then calls
``runtime.config_threadpool(1, n)`` (mode 1 = TVM's default "big cores" mode) to use ``n`` of
them, so any later change takes effect. The pool is per process: ranks running as threads of
one process share it. It also bounds the workers' idle spin (``TVM_THREAD_POOL_SPIN_COUNT``,
:data:`backends.tvm.schedules.threads.POOL_SPIN_COUNT`, unless the user set it).
"""

from __future__ import annotations

import bisect
import os
import threading
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import onnx

from partitioner.core.comm_ops import OPS, CommOp, Communicator, execute
from partitioner.core.errors import BackendError, InputError, PartitionerError, RunFailed
from partitioner.core.machine import usable_cores as _usable_cores

from . import contention, device_comm, fallback
from .lift_step_constants import TRANSFORM, step_constant_inputs
from .lower import KEEP_FUNC, PACKED_PREFIX, comm_table
from .weight_params import bind_weights, main_weight_params

#: rule 5: remember which outputs alias an input buffer after the first call (module constant;
#: off: every output checked on every call)
CACHE_OUTPUT_ALIASING = True
#: rule 9: an input given as a tensor frees the persistent input buffer an earlier array filled
#: (module constant; off: kept). For callers that give an input as a tensor from some call on (the
#: pipeline runner's weights after the first update): the buffer is dead from then on. Measured,
#: the zoo mlp 4x1024's TVM last stage (``benchmarks/pipeline_stage_memory.py``): 32 MiB of such
#: buffers (its ``FB``, ``FBt`` and ``P`` programs' weights, ``U``'s state), freed after step 1;
#: no buffer is made again after step 1 (mlp and resnet stages, 4 steps). Under MPI, alone
#: (``benchmarks/train_step.py --models mlp --backend tvm --paired-env
#: PARTITIONER_TVM_RELEASE_PASSED_BUFFERS=0 --configs "2 ranks pipeline 1f1b x8 (MPI)" --rounds 2
#: --steps 6``, load 1.7-2.3): ranks 103.5 / 144.5 and 103.4 / 141.0 MiB with it, 111.5 / 158.7 and
#: 111.6 / 160.7 without; rank CPU per step 162.2 / 152.3 ms with, 154.4 / 154.4 without (the first
#: pair ran first in the run; nothing per call changes after step 1).
#: The environment's ``PARTITIONER_TVM_RELEASE_PASSED_BUFFERS=0`` turns it off, in MPI ranks too
RELEASE_PASSED_BUFFERS = os.environ.get("PARTITIONER_TVM_RELEASE_PASSED_BUFFERS", "1") == "1"
#: rule 10: the lean per-call path for programs without comm ops, fallback segments or lifted step
#: constants (module constant, read at load; off: every call takes the general path). The
#: environment's ``PARTITIONER_TVM_FAST_CALL_PATH=0`` turns it off, in MPI ranks too
FAST_CALL_PATH = os.environ.get("PARTITIONER_TVM_FAST_CALL_PATH", "1") == "1"

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
        if _threads is None:
            # TVM sizes its pool once, from TVM_NUM_THREADS, when it is first created, and a later
            # config_threadpool can only use fewer workers than that: create it with as many
            # workers as this process may run on, then use ``threads`` of them (measured: a pool
            # created for 1 thread stayed at 1 thread after asking for 2)
            os.environ["TVM_NUM_THREADS"] = str(max(threads, _usable_cores()))
        os.environ.setdefault("TVM_BIND_THREADS", "0")  # keep the affinity the worker chose
        from .schedules.threads import POOL_SPIN_COUNT, SPIN_ENV

        os.environ.setdefault(SPIN_ENV, str(POOL_SPIN_COUNT))  # idle workers sleep soon (threads.py)
        import tvm

        config = tvm.get_global_func("runtime.config_threadpool", allow_missing=True)
        if config is not None:
            config(1, threads)
        _threads = threads


def _set_pool_threads(n: int) -> None:
    import tvm

    tvm.get_global_func("runtime.config_threadpool")(1, n)


def _contention_guard() -> contention.ContentionGuard:
    """The calling thread's guard (backends/tvm/contention.py; TVM's pool is per calling thread)."""
    guard = getattr(_local, "guard", None)
    if guard is None:
        guard = _local.guard = contention.ContentionGuard(_set_pool_threads)
    return guard


def host_view(t: Any) -> np.ndarray:
    """A numpy view of the CPU TVM tensor ``t``; a copy (``Tensor.numpy()``, an ml_dtypes array)
    for the dtypes numpy's DLPack import lacks (bfloat16, float8, sub-byte: "Unsupported dtype in
    DLTensor"), so comm ops and ONNX Runtime segments take every dtype the library can hold."""
    try:
        return np.from_dlpack(t)
    except (RuntimeError, BufferError, TypeError, ValueError):
        return t.numpy()


def _write(out: Any, value: np.ndarray) -> None:
    if out.device.dlpack_device_type() == 1:
        try:
            dst = np.from_dlpack(out)
        except (RuntimeError, BufferError, TypeError, ValueError):  # bfloat16, float8: copy in
            if tuple(int(d) for d in out.shape) != tuple(value.shape):
                raise RunFailed(f"comm op result has shape {list(value.shape)}, the library expects "
                                f"{[int(d) for d in out.shape]}") from None
            out.copyfrom(np.ascontiguousarray(value))
            return
        if dst.shape != value.shape:
            raise RunFailed(f"comm op result has shape {list(value.shape)}, the library expects {list(dst.shape)}")
        np.copyto(dst, value, casting="same_kind")
    else:
        out.copyfrom(np.asarray(value, dtype=out.dtype, order="C"))


def _dlpack_ok(t: Any) -> bool:
    return str(t.dtype) not in ("bfloat16",) and not str(t.dtype).startswith(("float8", "float4", "int4", "uint4"))


def _handler(op_type: str):
    has_out = op_type != "Send"

    def run_comm(*args: Any) -> None:
        ctx = getattr(_local, "ctx", None)
        if ctx is None:
            raise RunFailed(f"{PACKED_PREFIX}{op_type} called outside TvmRankExecutable.run (no communicator bound)")
        comm, ops, on_cpu = ctx
        try:
            if has_out:
                op: CommOp = ops[int(args[-2])]
                out = args[-1]
                if op_type == "Recv" and on_cpu and hasattr(comm, "recv_into") and _dlpack_ok(out):
                    comm.recv_into(int(op.attrs["peer"]), op.tag, np.from_dlpack(out))
                    return
                tensors = args[:-2]
            else:
                op = ops[int(args[-1])]
                tensors = args[:-1]
            if not on_cpu:  # GPU tensors: NCCL, or staged through host memory (device_comm.py)
                device_comm.run_on_device(op, tensors, out if has_out else None, comm)
                return
            arrays = [host_view(t) for t in tensors]
            if not has_out:  # see rule 3: the storage may be reused while the Isend is in flight
                arrays = [np.array(a, copy=True) for a in arrays]
            results = execute(op, arrays, comm)
            if has_out:
                _write(out, results[0])
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
        from tvm.runtime.vm import VirtualMachine  # not tvm.relax: a runtime-only TVM has no compiler

        configure_threads(threads)
        register_comm_functions()
        fallback.register()  # before the VM is created: it resolves packed functions when it loads
        self.path = Path(path)
        if not self.path.is_file():
            raise BackendError(f"{self.path}: rank library not found; build it first (partitioner compile)")
        load_device_runtimes()
        try:
            lib = tvm.runtime.load_module(str(self.path))
        except Exception as e:
            raise BackendError(f"{self.path}: TVM cannot load this library ({str(e).strip().splitlines()[-1] if str(e).strip() else e}); rebuild it with this TVM version") from None
        self.device = tvm.cuda(cuda_device_index()) if _has_cuda_code(lib) else tvm.cpu(0)
        self._vm = VirtualMachine(lib, self.device)
        self._main = self._vm["main"]
        # weights built as parameters (backends/tvm/weight_params.py): mapped from rank<i>.data
        self._weights = bind_weights(program, self.path.parent, main_weight_params(self._vm), self.device)
        init_names = {t.name for t in program.graph.initializer}
        self.inputs = tuple(v.name for v in program.graph.input if v.name not in init_names)
        self.outputs = tuple(v.name for v in program.graph.output)
        self.comm_ops = comm_table(program)
        self._ort_sessions = fallback.load_sessions(program, self.path, threads=threads)
        self._on_cpu = self.device.dlpack_device_type() == 1
        self._guarded = self._on_cpu and not self.comm_ops and not self._ort_sessions  # rule 7
        self._in_bufs: list[tuple[Any, np.ndarray] | None] = [None] * len(self.inputs)
        self._in_src: list[np.ndarray | None] = [None] * len(self.inputs)  # rule 5: the read-only array copied
        self.reuse_readonly_inputs = False
        self.vm_s = 0.0
        self._refilled = False  # rule 8: a step-constant buffer was filled on this call
        self._transform = _function(self._vm, TRANSFORM)
        self._constants = len(step_constant_inputs(program)) if self._transform is not None else 0
        self._lifted: list[Any] | None = None
        self._spans: tuple[list[int], list[int]] | None = None  # rule 5: the input buffers' byte ranges
        self._aliased: list[bool] | None = None  # rule 5: per output, whether it aliased an input buffer
        self._passed: tuple[int, ...] = ()  # rule 9: the inputs given as tensors on this call
        self.cache_aliasing = CACHE_OUTPUT_ALIASING  # rule 5 (read when loaded, as pipeline_stages --baseline sets it)
        self.keep_output_tensors = False  # rule 9
        self.output_tensors: dict[str, Any] = {}
        # rule 10: decided once; the per-call conditions are checked in run
        self.fast_path = FAST_CALL_PATH and self._on_cpu and not self.comm_ops and not self._ort_sessions \
            and not self._constants
        self._tensor_type = tvm.runtime.Tensor
        self._array_item = tvm.get_global_func("ffi.ArrayGetItem")

    def _input_buffers(self, feeds: dict[str, np.ndarray]) -> list[Any]:
        """Fill (creating on first use) one persistent TVM tensor per input; see rule 5. (The loop
        reads its attributes once: about 200 inputs a call on the resnet's pipeline stages.)"""
        import tvm

        args, passed = [], []
        tensor_type, bufs, src = self._tensor_type, self._in_bufs, self._in_src
        first_constant = len(self.inputs) - self._constants  # rule 8: the step constants are last
        refilled, reuse = self._refilled, self.reuse_readonly_inputs
        for i, name in enumerate(self.inputs):
            x = feeds[name]
            if isinstance(x, tensor_type):  # rule 9: an earlier call's output, as it is
                passed.append(i)
                if RELEASE_PASSED_BUFFERS and bufs[i] is not None:  # rule 9: not read again
                    bufs[i] = None
                    self._spans = self._aliased = None
                if i >= first_constant:  # rule 8: a step constant's lifted transforms rerun only for another tensor
                    refilled = refilled or x is not src[i]
                    src[i] = x
                else:
                    src[i] = None
                args.append(x)
                continue
            buf = bufs[i]
            if buf is None or buf[1].shape != x.shape or buf[1].dtype != x.dtype:
                t = tvm.runtime.empty(x.shape, str(x.dtype), self.device)
                try:
                    view = np.from_dlpack(t)
                except (RuntimeError, BufferError, TypeError, ValueError):
                    view = None  # bfloat16/float8/int4: numpy's DLPack import lacks the dtype
                buf = (t, view)
                bufs[i], src[i] = buf, None
                self._spans = self._aliased = None
                if view is None:
                    bufs[i] = None  # no view to reuse: a fresh tensor per call
                    t.copyfrom(np.asarray(x, order="C"))
                    refilled = True
                    args.append(t)
                    continue
            if x is not src[i]:
                np.copyto(buf[1], x)
                refilled = refilled or i >= first_constant
                src[i] = x if reuse and isinstance(x, np.ndarray) and not x.flags.writeable else None
            args.append(buf[0])
        self._refilled = refilled
        if tuple(passed) != self._passed:  # rule 5: which buffers an output can alias changed
            self._passed, self._aliased = tuple(passed), None
        return args

    def _in_input_buffer(self, arr: np.ndarray) -> bool:
        """Rule 5: whether ``arr``'s bytes overlap a persistent input buffer (one bisection over
        the buffers' sorted, disjoint byte ranges: the pairwise ``np.may_share_memory`` over every
        output and input cost the resnet's first pipeline stage about 5600 Python checks a call)."""
        if not arr.nbytes:
            return False
        if self._spans is None:
            spans = sorted((b[1].ctypes.data, b[1].ctypes.data + b[1].nbytes) for b in self._in_bufs
                           if b is not None and b[1].nbytes)
            self._spans = ([a for a, _ in spans], [e for _, e in spans])
        starts, ends = self._spans
        lo, hi = _byte_bounds(arr)
        k = bisect.bisect_left(starts, hi) - 1  # the last buffer that starts before arr ends
        return k >= 0 and ends[k] > lo

    def _lift(self, args: list[Any]) -> list[Any]:
        """Rule 8: ``main``'s arguments, the step constants replaced by their lifted transforms."""
        if not self._constants:
            return args
        k = len(args) - self._constants
        if self._lifted is None or self._refilled:
            self._lifted = None  # the old values are not alive beside the new ones
            self._lifted = list(self._transform(list(args[k:])))
        return [*args[:k], *self._lifted]

    def release_step_constants(self) -> None:
        """Rule 8: drop the lifted transforms' results (the next call computes them again)."""
        self._lifted = None

    def run(self, feeds: dict[str, np.ndarray], comm: Communicator) -> dict[str, np.ndarray]:
        if self.fast_path and self._aliased is not None and self.cache_aliasing and not self._passed \
                and not self.keep_output_tensors and not self.reuse_readonly_inputs:  # rule 10
            out = self._run_fast(feeds, comm)
            if out is not None:
                return out
        import tvm

        try:
            self._refilled = not self._on_cpu
            if self._on_cpu:
                args = self._input_buffers(feeds)
            else:
                args = [tvm.runtime.tensor(np.asarray(feeds[n], order="C"), self.device) for n in self.inputs]
        except KeyError:
            missing = [n for n in self.inputs if n not in feeds]
            raise InputError(f"{self.path.name}: missing input(s) {', '.join(missing)}; expected {', '.join(self.inputs)}") from None
        _local.ctx = (comm, self.comm_ops, self._on_cpu)
        _local.error = None
        fallback.bind(self._ort_sessions)  # rule 6
        guard = _contention_guard() if self._guarded else None  # rule 7
        watch = guard.before(_threads or 1) if guard is not None else None
        t0 = time.perf_counter()
        try:
            res = self._main(*self._lift(args), *self._weights)
        except Exception as e:
            err = getattr(_local, "error", None) or fallback.last_error()
            if isinstance(err, PartitionerError):
                raise err from None
            if err is not None:
                raise RunFailed(f"rank {getattr(comm, 'rank', '?')}: comm op failed in {self.path.name}: {type(err).__name__}: {err}") from err
            raise self._failed(e, comm) from e
        finally:
            self.vm_s += time.perf_counter() - t0
            _local.ctx = None
            _local.error = None
            fallback.bind(None)
        if guard is not None:
            guard.after(watch)
        values = [res] if isinstance(res, tvm.runtime.Tensor) else res[0:len(res)]  # a slice: one list, no iterator
        if not self._on_cpu:
            return {name: _output_array(v, copy=True) for name, v in zip(self.outputs, values)}
        return self._host_outputs(values)

    def _failed(self, e: Exception, comm: Communicator) -> RunFailed:
        return RunFailed(f"rank {getattr(comm, 'rank', '?')}: {self.path.name} failed: "
                         f"{str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__}")

    def _run_fast(self, feeds: dict[str, np.ndarray], comm: Communicator) -> dict[str, np.ndarray] | None:
        """Rule 10: the call on the lean path, or None (nothing run) when it needs the general one."""
        bufs, src, args = self._in_bufs, self._in_src, []
        for i, name in enumerate(self.inputs):
            x, buf = feeds.get(name), bufs[i]
            if buf is None or x.__class__ is not np.ndarray:
                return None  # a new buffer, a tensor feed, a missing input: the general path
            view = buf[1]
            if x.shape != view.shape or x.dtype != view.dtype:
                return None  # a new shape or dtype: the general path makes a new buffer
            if x is not src[i]:  # as rule 5 (a leftover read-only source is not copied again)
                view[...] = x  # np.copyto for one dtype, ~0.1 us less
                src[i] = None
            args.append(buf[0])
        guard = _contention_guard() if self._guarded else None  # rule 7
        watch = guard.before(_threads or 1) if guard is not None else None
        t0 = time.perf_counter()
        try:
            res = self._main(*args, *self._weights)
        except Exception as e:  # no comm op or fallback segment: the VM's own error
            raise self._failed(e, comm) from e
        finally:
            self.vm_s += time.perf_counter() - t0
        if guard is not None:
            guard.after(watch)
        tensor, item = self._tensor_type, self._array_item
        if isinstance(res, tensor):
            values: Sequence[Any] = (res,)
        else:  # one FFI call per output; no list comprehension frame for the one-output case
            values = (item(res, 0),) if len(self.outputs) == 1 else [item(res, k) for k in range(len(self.outputs))]
        out = {}
        for name, v, aliased in zip(self.outputs, values, self._aliased):
            try:
                arr = np.from_dlpack(v) if isinstance(v, tensor) else _output_array(v)
            except (RuntimeError, BufferError, TypeError, ValueError):
                arr = _output_array(v)  # a dtype numpy's DLPack import lacks: a copy
            out[name] = arr.copy() if aliased else arr  # rule 5
        if self.output_tensors:
            self.output_tensors = {}
        return out

    def _host_outputs(self, values: list[Any]) -> dict[str, np.ndarray]:
        """Rules 5 and 9 on the CPU: each output a zero-copy view, copied when it aliases an input
        buffer (checked on the first call only with ``CACHE_OUTPUT_ALIASING``)."""
        import tvm

        out = {}
        self.output_tensors = {}
        known = self._aliased if self.cache_aliasing else None
        aliased = known if known is not None else []
        for k, (name, v) in enumerate(zip(self.outputs, values)):
            is_tensor = isinstance(v, tvm.runtime.Tensor)
            try:
                arr = np.from_dlpack(v) if is_tensor else _output_array(v)
            except (RuntimeError, BufferError, TypeError, ValueError):
                arr = _output_array(v)  # a dtype numpy's DLPack import lacks: a copy
            # an output that is an input buffer, or a view of one (Flatten/Reshape of an input
            # lower to views sharing its storage), is overwritten by the next call: rule 5
            if known is None:
                aliased.append(is_tensor and self._in_input_buffer(arr))
            if aliased[k]:
                arr = arr.copy()
            elif self.keep_output_tensors and is_tensor:  # rule 9
                self.output_tensors[name] = v
            out[name] = arr
        self._aliased = aliased
        return out


def _byte_bounds(arr: np.ndarray) -> tuple[int, int]:
    """First and one-past-last byte ``arr`` can touch (as ``np.may_share_memory`` bounds it)."""
    lo = hi = arr.ctypes.data
    for n, stride in zip(arr.shape, arr.strides):
        if stride < 0:
            lo += (n - 1) * stride
        else:
            hi += (n - 1) * stride
    return lo, hi + arr.itemsize


def _function(vm: Any, name: str) -> Any:
    """The VM's function ``name``, or None when the library has none."""
    try:
        return vm[name]
    except Exception:  # noqa: BLE001 - TVM raises its own error for a missing function
        return None


def _output_array(v: Any, *, copy: bool = False) -> np.ndarray:
    """A VM result as numpy: a zero-copy DLPack view when numpy knows the dtype, else a copy via
    ``Tensor.numpy()`` (bfloat16, float8, int4: ml_dtypes arrays); a static ``Shape`` result
    (R.shape_of of a Shape op folded at compile time) becomes an int64 vector."""
    import tvm

    if not isinstance(v, tvm.runtime.Tensor):
        try:
            return np.array([int(d) for d in v], dtype=np.int64)
        except TypeError:
            raise RunFailed(f"library returned a {type(v).__name__}, not a tensor; expected a tensor output") from None
    if not copy:
        try:
            return np.from_dlpack(v)
        except (RuntimeError, BufferError, TypeError, ValueError):
            pass  # a dtype numpy's DLPack import lacks
    return v.numpy()


LOCAL_RANK_ENV = "PARTITIONER_LOCAL_RANK"  # set by the worker: this rank's index on its host


def cuda_device_index() -> int:
    """The GPU of this rank: local rank modulo the visible GPU count (ranks of one host share
    its GPUs round-robin; see backends/cuda_devices.py rule 3)."""
    from backends.cuda_devices import device_index, visible_gpus

    return device_index(int(os.environ.get(LOCAL_RANK_ENV, "0") or 0), len(visible_gpus()))


def load_device_runtimes() -> None:
    """A runtime-only TVM (``TVM_USE_RUNTIME_LIB=1``, or no ``libtvm_compiler``: what a deployment
    needs) loads no device runtime when imported. Load the CUDA one here, before a library is: it
    registers the loader of the library's CUDA kernels. On a machine without CUDA it does not
    load, and a CPU library needs none (a CUDA library then fails to load with TVM's message)."""
    global _device_runtimes_loaded
    import tvm

    if _device_runtimes_loaded or not getattr(tvm, "_RUNTIME_ONLY", False):
        return
    _device_runtimes_loaded = True
    if tvm.get_global_func("device_api.cuda", allow_missing=True) is not None:
        return
    from tvm.base import _LOADED_LIBS
    from tvm_ffi.libinfo import load_lib_ctypes

    try:
        _LOADED_LIBS["tvm_runtime_cuda"] = load_lib_ctypes(
            package="tvm", target_name="tvm_runtime_cuda", mode="RTLD_LOCAL",
            extra_lib_paths=[Path(_LOADED_LIBS["tvm_runtime"]._name).resolve().parent])
    except (OSError, FileNotFoundError, RuntimeError):
        return
    from backends.cuda_devices import visible_gpus

    from .cuda_toolchain import register_load_time_compiler

    gpus = visible_gpus()
    if gpus:  # the library's CUDA C is compiled as it loads (cuda_toolchain rule 4)
        gpu = gpus[cuda_device_index() % len(gpus)]
        register_load_time_compiler(f"sm_{gpu.major}{gpu.minor}")


_device_runtimes_loaded = False


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
