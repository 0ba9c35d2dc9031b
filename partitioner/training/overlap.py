"""A data-parallel rank's step with the gradient AllReduce overlapping the rest of the backward.

Rules:

1. The step program places each gradient bucket's AllReduce right after the node that finishes
   the bucket's last gradient (:mod:`partitioner.training.step` rule 5), so the program cut at its
   comm ops reads: forward + the backward up to bucket 0, AllReduce 0, the backward up to bucket
   1, AllReduce 1, ..., then the mean, split and optimizer.
2. :class:`OverlappedExecutable` runs the ONNX Runtime segments in program order on the calling
   thread and hands every AllReduce to one communication thread as soon as its input exists; a
   segment waits only for the AllReduce outputs it reads. ONNX Runtime and the communicators'
   blocking calls (mpi4py, the in-process queues) release the GIL, so the reduction of bucket b
   runs while the backward computes the next buckets' gradients.
3. Overlap is on for programs with more than one bucket (:class:`~partitioner.training.runner.StepRunner`):
   a single bucket's AllReduce follows the whole backward, so there is nothing to overlap and a
   thread hand-off would only add latency (``overlap=False``: every AllReduce runs inline).
4. The AllReduces run one at a time, in program order, on that one thread: every rank issues
   them in the same order (MPI's collective ordering), and the communicator is used by one
   thread at a time (the step has no other comm op).
5. ``timeline`` records, for the last step, each segment's and AllReduce's (kind, index,
   start, end) on the ``time.perf_counter`` clock, and each AllReduce's hand-off (``submit``):
   the tests check that bucket 0 is handed off before the backward's last segment starts. How
   much of the reduction really runs beside the backward depends on the cores free for the comm
   thread; measure it with ``train --bench`` on a quiet machine.
6. A run of consecutive AllReduce steps with one tag (a bucket rewritten by
   :func:`partitioner.training.buckets.unbucket`) is one collective over the list of its inputs
   (``comm.allreduce_list``, :mod:`partitioner.runtime.comm_mpi` rule 8; a communicator without
   it gets the concatenation AllReduced and split here).
7. TVM ranks (:class:`TvmBucketedExecutable`, for data-parallel ranks with
   :data:`partitioner.training.buckets.LIST_ALLREDUCE`): the TVM VM calls a comm op with one
   tensor, so a bucket run inside one library needs the concatenation and split. Instead the
   unbucketed program is cut at its comm ops (:func:`partitioner.core.segments.split_program`)
   and every compute segment is a library of its own: the backward's segments return the
   gradients, rule 6's list AllReduce reduces them *in place* (into the arrays the segment
   returned, fresh VM tensors: no allocation, no concatenation, no split, no copy into a comm
   op's output tensor; only when nothing else reads them or shares their memory,
   :meth:`TvmBucketedExecutable._writable`) and the next segment (the update) takes them as
   inputs. Rules 2-4 apply unchanged: with more than one bucket the AllReduce runs on the comm
   thread beside the next backward segment (the TVM VM call releases the GIL).
8. Cutting the step into libraries turns values that stayed inside one VM call into arrays
   between calls: the gradients, the forward activations a later backward segment reads (the
   zoo resnet at local batch 8: 24 MiB) and the weights every segment reads. A TVM library
   copies each input into a persistent buffer of its own (:mod:`backends.tvm.executable` rule
   5, for arrays of any alignment), so each segment's library (:func:`_segment_library`)
   passes every input that is already a writable, C-contiguous array on a
   :data:`VM_ALIGNMENT`-byte boundary (an earlier segment's outputs, the state the update
   returned: VM tensors) to the VM as it lies, through DLPack; only the others (the batch)
   are copied. The state a runner starts from (numpy's arrays, often off that boundary) is put on
   one first (:func:`vm_aligned`), so the first step copies no weight either: a library keeps
   the buffer it copied an input into for its life, so one first-step copy of every weight
   would stay resident (45 MiB per library that reads the weights, for the zoo resnet).
9. A segment whose every node is elementwise (:data:`ELEMENTWISE_OPS`) over values of one shape
   besides scalars (rank 0 or ``[1]``) is built over 1-D tensors (:func:`flat_elementwise`):
   each input of rank >= 2 goes in as a ``reshape(-1)`` view and each such output comes back as
   a view of its own shape, so no element moves and every element gets the same operations (the
   results are bit-identical). It is for the optimizer update of a data rank (the segment after
   the last AllReduce: ``Mul``/``Sub`` for SGD, ``Add``/``Div``/``Sqrt``/``Pow`` too for Adam, on
   every weight, gradient and slot): TVM's CPU kernel for an elementwise op loops over the
   tensor's own dims, and over a conv weight ``[O, I, 3, 3]`` its innermost loop has 3
   iterations (measured, one thread, SGD's ``W - g * lr``: ``[512, 512, 3, 3]`` x 2 11.2 ms,
   the same 4.7M elements as ``[4718592]`` 3.2 ms; the zoo resnet's 62 weights 27-33 ms, numpy's
   two passes 7 ms). A 2-D weight with a long last dim (the mlp) gains nothing and loses
   nothing. :data:`FLAT_ELEMENTWISE` (default on; ``$PARTITIONER_TRAIN_FLAT_UPDATE=0`` off).
   A 1-rank TVM step (no comm op) gets the same: it is cut where the optimizer's nodes begin
   (:func:`update_kind`, the ``training.forward_node`` tag ``optimizer``) into the forward and
   backward's library and the update's, so both sides of the data-parallel comparison run the
   same update kernels.
10. The step's last AllReduce run (a TVM data rank's one bucket: the zoo resnet's 45 MiB) asks
    the communicator to lend its results (:mod:`partitioner.runtime.comm_mpi` rule 11, for a
    communicator with ``lends_results``): the update segment reads the reduced gradients where
    the shared-memory AllReduce left them instead of from a copy (one read and one write of
    every gradient byte fewer per step). Those views are valid until the communicator's next
    AllReduce on the group, i.e. the next step's first bucket; the update has read them by
    then, and a step output among the run's results (the loss, when a bucket carries it) is
    copied. Earlier runs are not lent: a later run's call would reuse the window while the
    update has yet to read them. :data:`LEND_LAST_BUCKET` (default on;
    ``$PARTITIONER_TRAIN_LEND_LAST_BUCKET=0`` off).
11. Sharded update (ZeRO-1 within a node, :mod:`partitioner.training.sharded_update`): when the
    step's last segment is the optimizer update right after rule 10's lent run, each rank
    updates only the weights (and their optimizer state) whose gradients it reduced, in place in
    state the node's ranks share (:mod:`partitioner.runtime.comm_mpi` rule 12), and barriers; the
    next step reads the weights there. A rank does ``1/R`` of the update and no all-gather copy;
    the node holds one copy of the weights. For TVM data ranks on one node with a communicator
    that lends (MPI's shared window); otherwise, or when the update does not qualify
    (sharded_update rule 2), the full update library runs. :data:`SHARDED_UPDATE` (default
    **off**: three paired ``train_step.py`` runs on the loaded machine disagreed, see
    docs/training.md, session 15; ``$PARTITIONER_TRAIN_SHARDED_UPDATE=1`` on).
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from backends.onnxruntime import RankExecutable
from partitioner.core import comm_ops
from partitioner.core.segments import CommStep, Segment, split_program
from partitioner.training.buckets import bucket_runs


#: rule 8: TVM's kernels take their arguments on this alignment (the VM allocates so)
VM_ALIGNMENT = 64
#: rule 9: build an all-elementwise segment (a data rank's optimizer update) over 1-D tensors
FLAT_ELEMENTWISE = os.environ.get("PARTITIONER_TRAIN_FLAT_UPDATE", "1") != "0"
#: rule 10: the step's last bucket AllReduced into views of the communicator's window (no copy out)
LEND_LAST_BUCKET = os.environ.get("PARTITIONER_TRAIN_LEND_LAST_BUCKET", "1") != "0"
#: rule 11: each data rank updates only the weights whose gradients it reduced, in shared state
#: (off: no consistent paired win yet; 1 in the env: on)
SHARDED_UPDATE = os.environ.get("PARTITIONER_TRAIN_SHARDED_UPDATE", "0") == "1"
#: rule 9: the ops such a segment may hold (what :mod:`partitioner.training.optimizers` emits)
ELEMENTWISE_OPS = frozenset({"Add", "Sub", "Mul", "Div", "Sqrt", "Pow", "Neg", "Identity"})


class _BucketedSteps:
    """Rules 2-6 over ``self.steps`` (``(step, run)`` pairs: a segment and what runs it, or a
    comm step and None), ``self.outputs`` and ``self._segment``, for either backend."""

    steps: list[tuple[Any, Any]]
    outputs: Any

    def _bucketed(self, overlap: bool) -> None:
        self.overlap = overlap
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="allreduce") if overlap else None
        self.timeline: list[tuple[str, int, float, float]] = []
        tags = [s.op.tag if isinstance(s, CommStep) and s.op.op_type == "AllReduce" else None for s, _ in self.steps]
        self.runs = bucket_runs(tags)
        # rule 10: the last AllReduce run of the step (the bucket the update reads last)
        self._last_run = max((a for a, _ in self.runs if tags[a] is not None), default=-1)

    def _writable(self, run: int, env: Mapping[str, np.ndarray], names: list[str]) -> bool:
        """Whether AllReduce run ``run`` may write its results into its inputs (rule 7: TVM ranks;
        ONNX Runtime ranks keep rule 6's new arrays, in place is not tried there)."""
        return False

    def _comm(self, steps: list[CommStep], inputs: list[np.ndarray], comm: Any,
              in_place: bool = False, lend: bool = False) -> list[np.ndarray]:
        t0 = time.perf_counter()
        op = steps[0].op
        lend = lend and LEND_LAST_BUCKET and getattr(comm, "lends_results", False)
        if len(steps) == 1 and not in_place and not lend:
            out = comm_ops.execute(op, inputs, comm)
        elif hasattr(comm, "allreduce_list"):
            out = comm.allreduce_list(inputs, op.group, op.attrs["reduction"], op.tag,
                                      out=inputs if in_place else None, **({"lend": True} if lend else {}))
            if lend:  # rule 10: a step output must outlive the window's next use
                kept = set(self.outputs)
                names = [n for s in steps for n in s.outputs]
                out = [np.array(o) if n in kept and o is not x else o for o, n, x in zip(out, names, inputs)]
        else:  # rule 6 without a list collective: one AllReduce of the concatenation
            flat = comm.allreduce(np.concatenate([np.reshape(x, -1) for x in inputs]), op.group,
                                  op.attrs["reduction"], op.tag)
            ends = np.cumsum([np.size(x) for x in inputs])[:-1]
            out = [p.reshape(np.shape(x)) for p, x in zip(np.split(flat, ends), inputs)]
        self.timeline.append(("allreduce", steps[0].index, t0, time.perf_counter()))
        return out

    def run(self, feeds: Mapping[str, np.ndarray], comm: comm_ops.Communicator) -> dict[str, np.ndarray]:
        env: dict[str, np.ndarray] = dict(feeds)
        pending: dict[str, tuple[Future, int]] = {}
        self.timeline = []

        def need(names: Any) -> None:
            for n in names:
                if n in pending:
                    fut, k = pending.pop(n)
                    env[n] = fut.result()[k]  # re-raises the comm thread's error here

        try:
            for a, b in self.runs:
                step, run = self.steps[a]
                if not isinstance(step, CommStep):
                    need(step.inputs)
                    t0 = time.perf_counter()
                    env.update(zip(step.outputs, self._segment(step, run, env)))
                    self.timeline.append(("segment", step.index, t0, time.perf_counter()))
                    continue
                steps = [s for s, _ in self.steps[a:b]]
                names = [n for s in steps for n in s.inputs]
                need(names)
                outputs = [o for s in steps for o in s.outputs]
                if step.op.op_type == "AllReduce":
                    args = (steps, [env[i] for i in names], comm, self._writable(a, env, names), a == self._last_run)
                if step.op.op_type == "AllReduce" and self._pool is not None:
                    now = time.perf_counter()
                    self.timeline.append(("submit", step.index, now, now))
                    fut = self._pool.submit(self._comm, *args)
                    pending.update({o: (fut, k) for k, o in enumerate(outputs)})
                elif step.op.op_type == "AllReduce":
                    env.update(zip(outputs, self._comm(*args)))
                else:
                    env.update(zip(step.outputs, comm_ops.execute(step.op, [env.get(i) for i in step.op.inputs],
                                                                  comm)))
            need(list(pending))
        finally:
            for fut, _ in pending.values():
                fut.cancel()
        return {n: env[n] for n in self.outputs}


class OverlappedExecutable(_BucketedSteps, RankExecutable):
    """:class:`~backends.onnxruntime.RankExecutable` with rule 2's asynchronous AllReduce (the
    AllReduce ops of one program only: the steps' other comm ops run inline) and rule 6's bucket
    runs; ``overlap=False`` runs every AllReduce inline (rule 3)."""

    def __init__(self, *args: Any, overlap: bool = True, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._bucketed(overlap)


class TvmBucketedExecutable(_BucketedSteps):
    """Rule 7: a data-parallel TVM rank's program (its buckets unbucketed) as one TVM library per
    compute segment, the gradients AllReduced in place between them."""

    def __init__(self, program: onnx.ModelProto, workdir: Path | None, *, threads: int = 1,
                 overlap: bool = True, kind_of: Any = None) -> None:
        self.outputs = tuple(o.name for o in program.graph.output)
        segments, flat = _segments(program, kind_of)
        self._shapes = {k: f[1] for k, f in flat.items() if f is not None}  # rule 9: original shapes
        self.steps = [(s, _build_segment(flat[s.index][0] if flat[s.index] else s.model, workdir, threads)
                       if isinstance(s, Segment) else None) for s in segments]
        self._bucketed(overlap)
        self._in_place: dict[int, bool] = {}
        self._sharded = self._sharded_plan()  # rule 11 (SHARDED_UPDATE is read at each step)
        self._comm_now: Any = None

    def _sharded_plan(self) -> Any:
        """Rule 11's plan when the last step is a segment right after the last AllReduce run."""
        from partitioner.training.sharded_update import plan

        end = next((b for a, b in self.runs if a == self._last_run), -1)
        if end != len(self.steps) - 1 or not isinstance(self.steps[-1][0], Segment):
            return None
        comm_steps = [s for s, _ in self.steps[self._last_run:end]]
        return plan(self.steps[-1][0].model, [o for s in comm_steps for o in s.outputs], comm_steps[0].op.group)

    def run(self, feeds: Mapping[str, np.ndarray], comm: comm_ops.Communicator) -> dict[str, np.ndarray]:
        self._comm_now = comm  # rule 11's update needs the communicator
        return super().run(feeds, comm)

    def _writable(self, run: int, env: Mapping[str, np.ndarray], names: list[str]) -> bool:
        """Rule 7's guard, decided at the first step (the program and the VM's views are the
        same every step): in place only when no later step nor the step's outputs read an
        input of the run, no input is named twice, and no input shares memory with another
        value of the step (a TVM reshape may return a view of a tensor it returns too)."""
        if run not in self._in_place:
            end = next(b for a, b in self.runs if a == run)
            later = set(self.outputs).union(*(s.inputs for s, _ in self.steps[end:]))
            mine = [env[n] for n in names]
            others = [v for k, v in env.items() if k not in names and isinstance(v, np.ndarray)]
            self._in_place[run] = (len(set(names)) == len(names) and not later & set(names)
                                   and all(isinstance(x, np.ndarray) and x.flags.writeable for x in mine)
                                   and not any(np.may_share_memory(x, o) for x in mine for o in others))
        return self._in_place[run]

    def _segment(self, step: Any, run: Any, env: Mapping[str, np.ndarray]) -> list[np.ndarray]:
        if SHARDED_UPDATE and self._sharded is not None and step is self.steps[-1][0] \
                and hasattr(self._comm_now, "shared_arrays"):
            out = self._sharded.run(env, self._comm_now)  # rule 11 (None: a gradient was not lent)
            if out is not None:
                return [out[n] for n in step.outputs]
        shapes = self._shapes.get(step.index, {})  # rule 9: views in, views of the original shapes out
        out = run.run({n: np.reshape(env[n], -1) if n in shapes else env[n] for n in step.inputs}, None)
        return [np.reshape(out[n], shapes[n]) if n in shapes else out[n] for n in step.outputs]  # no comm op


def _segments(program: onnx.ModelProto, kind_of: Any) -> tuple[list[Any], dict[int, Any]]:
    """Rule 7's steps of ``program`` (its segments with outputs and its comm steps) and rule 9's
    flattened model (or None) per segment index."""
    segments = [s for s in split_program(program, kind_of) if not isinstance(s, Segment) or s.outputs]
    flat = {s.index: flat_elementwise(s.model) if FLAT_ELEMENTWISE else None
            for s in segments if isinstance(s, Segment)}
    return segments, flat


def segment_programs(program: onnx.ModelProto, kind_of: Any = None) -> list[onnx.ModelProto]:
    """The programs :class:`TvmBucketedExecutable` builds a library of (rules 7 and 9), in order."""
    segments, flat = _segments(program, kind_of)
    return [flat[s.index][0] if flat[s.index] else s.model for s in segments if isinstance(s, Segment)]


def vm_aligned(x: np.ndarray) -> np.ndarray:
    """Rule 8: ``x`` itself when a segment library takes it as it lies (C-contiguous, writable,
    on a :data:`VM_ALIGNMENT`-byte boundary), else a copy that is."""
    x = np.asarray(x)
    if x.flags.c_contiguous and x.flags.writeable and x.ctypes.data % VM_ALIGNMENT == 0:
        return x
    raw = np.empty(x.nbytes + VM_ALIGNMENT, np.uint8)
    start = -raw.ctypes.data % VM_ALIGNMENT
    out = raw[start:start + x.nbytes].view(x.dtype).reshape(x.shape)
    np.copyto(out, x)
    return out


def update_kind(node: onnx.NodeProto) -> str:
    """Rule 9's cut of a 1-rank step (:func:`partitioner.core.segments.split_program`'s
    ``kind_of``): ``update`` for the optimizer's nodes, ``compute`` for the others."""
    tag = next((p.value for p in node.metadata_props if p.key == "training.forward_node"), None)
    return "update" if tag == "optimizer" else "compute"


def flat_elementwise(model: onnx.ModelProto) -> tuple[onnx.ModelProto, dict[str, tuple[int, ...]]] | None:
    """Rule 9: ``model`` with every value of rank >= 2 declared 1-D, and those values' original
    shapes; None when a node is not in :data:`ELEMENTWISE_OPS`, a value's shape is unknown, a
    node mixes two shapes other than scalars (a broadcast: flattening would change it), an
    initializer has rank >= 2, or no value has rank >= 2 (nothing to gain)."""
    g = model.graph
    shapes: dict[str, tuple[int, ...] | None] = {}
    for vi in (*g.input, *g.output, *g.value_info):
        t = vi.type.tensor_type
        known = t.HasField("shape") and all(d.HasField("dim_value") for d in t.shape.dim)
        shapes[vi.name] = tuple(d.dim_value for d in t.shape.dim) if known else None
    shapes.update({t.name: tuple(t.dims) for t in g.initializer})

    def scalar(s: tuple[int, ...]) -> bool:
        return len(s) <= 1 and int(np.prod(s)) == 1

    for n in g.node:
        if n.op_type not in ELEMENTWISE_OPS or n.domain not in ("", "ai.onnx"):
            return None
        seen = {shapes.get(v) for v in (*n.input, *n.output) if v}
        if None in seen or len({s for s in seen if not scalar(s)}) > 1:
            return None
    changed = {k: s for k, s in shapes.items() if s is not None and len(s) >= 2}
    if not changed or any(t.name in changed for t in g.initializer):
        return None
    out = onnx.ModelProto()
    out.CopyFrom(model)
    for vi in (*out.graph.input, *out.graph.output, *out.graph.value_info):
        if vi.name in changed:
            dims = vi.type.tensor_type.shape.dim
            del dims[:]
            dims.add().dim_value = int(np.prod(changed[vi.name]))
    return out, changed  # type: ignore[return-value]


@functools.cache
def _segment_library() -> type:
    """Rule 8's library class (made on first use: importing the TVM backend loads TVM)."""
    from backends.tvm.executable import TvmRankExecutable

    class SegmentLibrary(TvmRankExecutable):
        """A segment's TVM library that takes VM-aligned arrays as they lie (rule 8)."""

        def _input_buffers(self, feeds: dict[str, np.ndarray]) -> list[Any]:
            import tvm

            args = []
            for i, name in enumerate(self.inputs):
                x = feeds[name]
                if (isinstance(x, np.ndarray) and x.size and x.flags.c_contiguous and x.flags.writeable
                        and x.dtype.kind in "fiub" and x.ctypes.data % VM_ALIGNMENT == 0):
                    args.append(tvm.runtime.from_dlpack(x))
                    continue
                buf = self._in_bufs[i]  # the others: a persistent buffer each (executable rule 5)
                if buf is None or buf[1].shape != x.shape or buf[1].dtype != x.dtype:
                    t = tvm.runtime.empty(x.shape, str(x.dtype), self.device)
                    buf = self._in_bufs[i] = (t, np.from_dlpack(t))
                np.copyto(buf[1], x)
                args.append(buf[0])
            return args

    return SegmentLibrary


def _build_segment(model: onnx.ModelProto, workdir: Path | None, threads: int) -> Any:
    """One segment's rule 8 library, built into ``workdir``."""
    import tempfile

    from backends.tvm.build import build_one
    from backends.tvm.target import target_dict

    folder = Path(workdir) if workdir is not None else Path(tempfile.mkdtemp(prefix="partitioner-train-"))
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{model.graph.name}.so"
    build_one(model, path, target_dict(None), {"threads": threads})  # 1: no parallel loops (threads.py)
    return _segment_library()(model, path, threads=threads)
