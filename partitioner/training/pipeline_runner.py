"""One pipeline stage's rank: its programs built once, its state resident, the schedule run.

:class:`PipelineRunner` is the pipeline counterpart of
:class:`~partitioner.training.runner.StepRunner`: ``step(data, labels)`` takes the *global* batch
(every stage rank sees it; stage 0 reads the data, the last stage the labels), cuts it into the
plan's micro-batches and runs the stage's schedule (:mod:`partitioner.training.pipeline` rules
2-5). It returns the global mean loss on every stage (the last stage broadcasts it). A stage with a
deferred weight-gradient program (pipeline rule 10) keeps what it reads from each micro-batch it
covers (every one, or the last ``w_tail``: those run the stage's ``fused_tail`` program) and runs
it once, after the last micro-batch, on those values concatenated.

Its state arrays (and rule 9's prepared values) are read-only and replaced, never written, so a
TVM stage program copies each weight into its input buffer once per step, not once per
micro-batch (``reuse_readonly_inputs``, :mod:`backends.tvm.executable` rule 5); with
``WEIGHT_TENSORS`` it copies none after the first step (it reads the update program's output
tensors), and with ``STASH_TENSORS`` ``B`` reads ``F``'s stashed outputs as they are.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import numpy_helper

from partitioner.core.errors import UsageError
from partitioner.training.pipeline import PipelinePlan, merged, schedule_order, stage_state_names, tag
from partitioner.training import moved_wgrad
from partitioner.training.split_cut import join_state, split_state

#: a stage's ``B`` reads its stashed activations as ``F``'s own TVM output tensors, not copied into
#: its input buffers (``backends.tvm.executable`` rule 9; module constant, off: copied per call).
#: On by default (session 13): the zoo resnet's TVM stage 0 (batch 16, 8 micro-batches of 2
#: images, 96 stashed values, 6.1 MB a micro-batch) filled ``B``'s input buffers in 9.6 ms a step
#: with the copies and 2.7 without, its ``B`` calls 176.7 -> 168.7 ms a step, the VM's own time
#: unchanged (161.5 / 160.3 ms: reading ``F``'s tensors is no slower than reading the copies); 10
#: rounds, toggled on one runner, thread CPU, load 10. Session 12's step-level pair (335.6 ms with
#: it, 305.1 without, load 8) was within the step's noise, which is larger than this 7 ms.
#: The environment's ``PARTITIONER_TRAIN_STASH_TENSORS=0`` turns it off, in MPI ranks too
STASH_TENSORS = os.environ.get("PARTITIONER_TRAIN_STASH_TENSORS", "1") == "1"
#: a TVM stage's programs read its weights and prepared values as the TVM tensors that produced
#: them (the update program's and the prepare program's outputs), not copied into each program's
#: input buffers once a step (``backends.tvm.executable`` rule 9; module constant, off: copied).
#: For TVM stages, whose weights change every step: the zoo resnet's TVM stage 0 alone (8 paired
#: rounds toggled on one runner, thread CPU, load 10.7) filled its programs' input buffers in 9.4
#: ms a step with the copies and 3.5 without, its step 257.1 -> 244.8 ms. The environment's
#: ``PARTITIONER_TRAIN_WEIGHT_TENSORS=0`` turns it off, in MPI ranks too
WEIGHT_TENSORS = os.environ.get("PARTITIONER_TRAIN_WEIGHT_TENSORS", "1") == "1"
#: a TVM stage program's lifted step constants (``backends.tvm.executable`` rule 8: its weights'
#: transposed and packed copies) are dropped after the program's last call of the step, not kept
#: until its first call of the next (module constant; off: kept). They are computed again on that
#: call anyway (the update replaces the weights), so this costs no time; it saves the memory
#: while the stage's other programs run (the zoo mlp 4x1024's last stage: its ``FB`` and ``FBt``
#: programs lift 16 MiB each, alive together and through ``W`` and ``U`` without it). Measured with
#: executable.RELEASE_PASSED_BUFFERS (``benchmarks/pipeline_stage_memory.py --model mlp --stage 1
#: --steps 8``, 3 alternating runs each, load 1.8-2.1): peak after 8 steps 142.0 / 146.1 / 141.9 MiB
#: with both, 160.2 / 165.9 / 162.3 without; thread CPU per step (median of steps 2-8) 137.2 /
#: 140.7 / 143.1 ms with, 139.7 / 143.6 / 145.8 without. Under MPI, alone (``benchmarks/train_step.py
#: --models mlp --backend tvm --paired-env PARTITIONER_TRAIN_RELEASE_STEP_CONSTANTS=0 --configs "2
#: ranks pipeline 1f1b x8 (MPI)" --rounds 2 --steps 6``, load 1.9-2.3): the last rank 148.5 / 149.2
#: MiB with it, 160.9 / 160.6 without; steps 243.9 / 245.2 ms with, 250.8 / 249.3 without. The environment's
#: ``PARTITIONER_TRAIN_RELEASE_STEP_CONSTANTS=0`` turns it off, in MPI ranks too
RELEASE_STEP_CONSTANTS = os.environ.get("PARTITIONER_TRAIN_RELEASE_STEP_CONSTANTS", "1") == "1"
#: ONNX Runtime pipeline stages: the sessions' memory pattern and the planner's buffer reuse
#: (``SessionOptions.enable_mem_pattern`` / ``enable_mem_reuse``), on (ORT's defaults), unlike
#: 1-rank and data ranks (``runner.MEMORY_PATTERN``, ``runner.MEMORY_REUSE``): cost rule 3's
#: pipeline terms (``PIPELINE_GRADIENT_COPIES``, the stash in flight) were measured with them.
#: Off (``PARTITIONER_TRAIN_PIPELINE_MEMORY_PATTERN=0``), measured in session 32 (``benchmarks/
#: train_step.py --paired-env ... --configs "2 ranks pipeline 1f1b x8 (MPI)" --rounds 3``, medians
#: of the rounds, on / off): bert 76.5 / 74.6 ms a step (off faster in 3 of 3 rounds), peak per
#: rank 60 / 52 -> 59 / 47 MiB; mlp 94.0 / 90.0 and 89.1 / 88.8 ms (two runs), 73 / 68 -> 68 / 68;
#: resnet 462.0 / 458.7 and 433.8 / 454.3 ms, 154 / 225 -> 148 / 225. Time within noise, peaks a
#: little lower, but no rule fitted the stages' peaks without them (docs/training.md, session 32)
PIPELINE_MEMORY_PATTERN = os.environ.get("PARTITIONER_TRAIN_PIPELINE_MEMORY_PATTERN", "1") == "1"
#: TVM stages sum their weight gradients over the micro-batches inside the per-micro-batch programs
#: (:func:`accumulating`: ``W.grad = W.grad.acc + g``), not in numpy after each call; the update
#: reads the sum as the last call's output tensor (module constant; off: ``_send_back``'s
#: ``np.add``; pipeline rule 13). Measured (session 16, docs/training.md, load 5-9; each stage alone,
#: ``benchmarks/pipeline_stages.py --stage N --baseline ...ACCUMULATE_IN_PROGRAM=False``, thread CPU,
#: median paired difference): resnet stage 0 -9.5 ms a step (on faster in 9 of 12 rounds), mlp
#: stage 0 -34.0 ms (12 of 15), mlp stage 1 +0.6 ms (7 of 15); under MPI (2 ranks 1F1B x8, 2 paired
#: rounds) the step was faster in one round of two for both models, and the peak memory a rank lower
#: in every round (resnet's last rank 343-349 MiB against 408-411: the update's ``.grad`` input
#: buffers are freed, rule 9 of ``backends.tvm.executable``). The environment's
#: ``PARTITIONER_TRAIN_ACCUMULATE_IN_PROGRAM=0`` turns it off, in MPI ranks too
ACCUMULATE_IN_PROGRAM = os.environ.get("PARTITIONER_TRAIN_ACCUMULATE_IN_PROGRAM", "1") == "1"
#: :func:`accumulating` adds the sum so far to the weight gradient's MatMul / Gemm product, before
#: the reshapes to the weight's shape (TVM can fuse an add into the product's epilogue, not across
#: a reshape); off: after them, on the ``W.grad`` output (module constant)
ACCUMULATE_AT_PRODUCT = True
#: :func:`accumulating`'s names: the running-sum input of ``W.grad`` and the micro-batch's own gradient
ACC_SUFFIX = ".acc"
MICRO_SUFFIX = ".micro"
GATHER_TAG = 30000
LOSS_TAG = 29999
REPLICA_TAG = 26000


def _specs(program: onnx.ModelProto | None) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """Shape and dtype of every input and output of ``program``."""
    if program is None:
        return {}
    out = {}
    for v in list(program.graph.input) + list(program.graph.output):
        t = v.type.tensor_type
        out[v.name] = (tuple(d.dim_value for d in t.shape.dim), onnx.helper.tensor_dtype_to_np_dtype(t.elem_type))
    return out


def accumulating(program: onnx.ModelProto, weights: Sequence[str]) -> tuple[onnx.ModelProto, dict[str, str]]:
    """``ACCUMULATE_IN_PROGRAM``: a copy of ``program`` whose output ``W.grad`` (each weight ``W``
    it gives a gradient of, made by a node) is ``Add(W.grad.micro, W.grad.acc)``: the node that made
    it now makes ``W.grad.micro``, and ``W.grad.acc`` is a new input of the output's type, placed
    before the program's step constants (``backends.tvm.lift_step_constants`` rule 1 wants them
    last). Returns the program and its running-sum inputs (weight -> input name); ``program``
    itself and ``{}`` when it outputs no such gradient."""
    from backends.tvm.lift_step_constants import keep_step_constants_last, marked_step_constants

    g = program.graph
    made = {o for n in g.node for o in n.output}
    outs = {o.name: o for o in g.output}
    acc = {w: f"{w}.grad{ACC_SUFFIX}" for w in weights if f"{w}.grad" in outs and f"{w}.grad" in made}
    if not acc:
        return program, {}
    constants = set(marked_step_constants(program))
    prog = onnx.ModelProto()
    prog.CopyFrom(program)
    g = prog.graph
    micro = {f"{w}.grad": f"{w}.grad{MICRO_SUFFIX}" for w in acc}
    for n in g.node:
        n.input[:] = [micro.get(i, i) for i in n.input]
        n.output[:] = [micro.get(o, o) for o in n.output]
    new_inputs, adds = [], []
    for w, name in acc.items():
        grad = outs[f"{w}.grad"]
        vi = onnx.ValueInfoProto()
        vi.CopyFrom(grad)
        vi.name = name
        new_inputs.append(vi)
        at = _product(g, micro[grad.name]) if ACCUMULATE_AT_PRODUCT else None
        if at is not None:  # Add(product, Reshape(acc)) in the product's shape; the reshapes after it read the sum
            value, shape = at
            summed, view = f"{value}{ACC_SUFFIX}", f"{name}.view"
            for n in g.node:
                n.input[:] = [summed if i == value else i for i in n.input]
            g.initializer.append(numpy_helper.from_array(np.array(shape, np.int64), f"{name}.shape"))
            adds += [onnx.helper.make_node("Reshape", [name, f"{name}.shape"], [view], name=f"{view}.reshape"),
                     onnx.helper.make_node("Add", [value, view], [summed], name=f"{summed}.accumulate")]
            g.node.append(onnx.helper.make_node("Identity", [micro[grad.name]], [grad.name],
                                                name=f"{grad.name}.accumulated"))
            continue
        mid = onnx.ValueInfoProto()
        mid.CopyFrom(grad)
        mid.name = micro[grad.name]
        g.value_info.append(mid)
        g.node.append(onnx.helper.make_node("Add", [mid.name, name], [grad.name], name=f"{grad.name}.accumulate"))
    _insert_after_producers(g, adds)
    inputs = list(g.input)
    at = next((k for k, v in enumerate(inputs) if v.name in constants), len(inputs))
    del g.input[:]
    g.input.extend(inputs[:at] + new_inputs + inputs[at:])
    keep_step_constants_last(prog)
    return prog, acc


def _product(g: onnx.GraphProto, value: str) -> tuple[str, list[int]] | None:
    """``ACCUMULATE_AT_PRODUCT``: the value behind ``value``'s chain of Identity / Reshape nodes
    (each read by the next one only) when a MatMul or Gemm makes it, with its static shape; else
    None."""
    prod = {o: n for n in g.node for o in n.output}
    uses: dict[str, int] = {}
    for n in g.node:
        for i in n.input:
            uses[i] = uses.get(i, 0) + 1
    outs = {o.name for o in g.output}
    n = prod.get(value)
    while n is not None and n.op_type in ("Identity", "Reshape"):
        value = n.input[0]
        if uses.get(value, 0) != 1 or value in outs:
            return None
        n = prod.get(value)
    if n is None or n.op_type not in ("MatMul", "Gemm"):
        return None
    info = next((v for v in list(g.value_info) + list(g.output) if v.name == value), None)
    dims = info.type.tensor_type.shape.dim if info is not None else []
    if not dims or any(not d.HasField("dim_value") for d in dims):
        return None
    return value, [d.dim_value for d in dims]


def _insert_after_producers(g: onnx.GraphProto, adds: list[onnx.NodeProto]) -> None:
    """Each Reshape / Add pair of ``adds`` placed right after the node making the Add's first input
    (the graph stays in topological order)."""
    nodes = list(g.node)
    for k in range(0, len(adds), 2):
        reshape, add = adds[k], adds[k + 1]
        at = next(j for j, n in enumerate(nodes) if add.input[0] in n.output)
        nodes[at + 1:at + 1] = [reshape, add]
    del g.node[:]
    g.node.extend(nodes)


def _frozen(a: np.ndarray) -> np.ndarray:
    """``a`` made read-only: the runner never writes into its state (each update and BN step
    replaces the arrays), which lets a TVM executable skip re-copying an unchanged weight."""
    a.flags.writeable = False
    return a


def executable(program: onnx.ModelProto, backend: str, workdir: Path | None, threads: int) -> Any:
    """The program on ``backend`` (an ORT session set, or a TVM library built into ``workdir``)."""
    if backend == "onnxruntime":
        from backends.onnxruntime import RankExecutable
        from partitioner.training.runner import SHARED_ARENA

        return RankExecutable(program, threads=threads, shared_arena=SHARED_ARENA,
                              memory_pattern=PIPELINE_MEMORY_PATTERN, memory_reuse=PIPELINE_MEMORY_PATTERN)
    if backend != "tvm":
        raise UsageError(f"unknown backend {backend!r}; choose onnxruntime or tvm")
    from backends.tvm.build import build_one
    from backends.tvm.executable import TvmRankExecutable
    from backends.tvm.target import target_dict

    folder = workdir if workdir is not None else Path(tempfile.mkdtemp(prefix="partitioner-pipe-"))
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{program.graph.name}.so"
    build_one(program, path, target_dict(None), {"threads": threads})  # 1: no parallel loops (threads.py)
    return TvmRankExecutable(program, path, threads=threads)


class PipelineRunner:
    """Stage ``stage`` of ``plan`` on world rank ``ranks[stage]`` (see the module docstring)."""

    global_batch = True  # the training loop gives every stage rank the whole batch

    def __init__(self, plan: PipelinePlan, stage: int, *, comm: Any, ranks: Sequence[int] | None = None,
                 backend: str = "onnxruntime", workdir: str | os.PathLike[str] | None = None, threads: int = 1,
                 state: Mapping[str, np.ndarray] | None = None, replica: int = 0,
                 replica_group: Sequence[int] | None = None) -> None:
        self.plan = plan
        self.stage = plan.stages[stage]
        self.ranks = list(ranks) if ranks is not None else list(range(plan.num_stages))
        # hybrid (data x pipeline): this rank is stage ``stage`` of pipeline replica ``replica``;
        # ``replica_group`` = the ranks holding this stage in every replica (gradient AllReduce)
        self.replica = replica
        self.replica_group = list(replica_group) if replica_group is not None else [self.ranks[stage]]
        self.comm = comm
        src = split_state(plan.parts, state) if state is not None else self.stage.initial  # rule 11
        self.state = {n: _frozen(np.array(src[n], copy=True)) for n in stage_state_names(self.stage)}
        folder = Path(workdir) / f"stage{stage}" if workdir is not None else None
        st = self.stage
        self._exe, self._sums = _stage_executables(st, backend, folder, threads)
        self._tensors: dict[str, Any] = {}  # WEIGHT_TENSORS: state / prepared value -> its TVM tensor
        self._stash_tensors: dict[int, dict[str, Any]] = {}  # STASH_TENSORS: micro-batch -> F's tensors
        self._spec = {**_specs(st.forward), **_specs(st.fused), **_specs(st.backward), **_specs(st.update)}
        self._w_stash: dict[int, dict[str, np.ndarray]] = {}  # rule 10: what W reads, per micro-batch
        self._hoisted: dict[str, np.ndarray] = {}  # rule 9: the prepare program's outputs, this step
        self.peak_stash = 0
        self.steps = 0
        # rule 8: a recomputing B reruns the forward, BN statistics included
        self._b_bn = sorted({a for a, _ in st.bn_state} & {i.name for i in st.backward.graph.input}
                            if st.backward is not None else set())

    # one step ----------------------------------------------------------------------------------
    def step(self, data: Mapping[str, np.ndarray], labels: np.ndarray) -> float:
        """One step of the global batch ``data`` / ``labels``; returns the global mean loss."""
        plan, st = self.plan, self.stage
        if len(self.replica_group) > 1:  # hybrid: this replica's rows of the global batch
            rows = slice(self.replica * plan.batch, (self.replica + 1) * plan.batch)
            data, labels = {k: v[rows] for k, v in data.items()}, labels[rows]
        acc: dict[str, np.ndarray] = {}  # the first micro-batch's gradients, then summed in place
        if "P" in self._exe:  # rule 9: weight-only values, once per step
            self._hoisted = {k: _frozen(v) for k, v in self._exe["P"].run(self._state_feeds(st.weights),
                                                                          self.comm).items()}
            self._keep_tensors("P", {k: k for k in self._hoisted})
        stash: dict[int, dict[str, np.ndarray]] = {}
        losses: list[float] = []
        order = list(schedule_order(plan.schedule, st.index, plan.num_stages, plan.micro_batches, plan.extra_warmup))
        last = {(self._fused_kind(m) if kind == "FB" else kind): call for call, (kind, m) in enumerate(order)}
        for call, (kind, m) in enumerate(order):
            _release_done(self._exe, last, call)
            sl = slice(m * plan.micro_batch, (m + 1) * plan.micro_batch)
            if kind == "B":
                out = self._backward(m, stash.pop(m), acc)
            else:
                feeds = self._forward_feeds(m, data, sl)
                if kind == "FB":
                    feeds[plan.labels] = labels[sl]
                    feeds.update(self._sums.feeds(self._fused_kind(m), acc))
                    out = self._exe[self._fused_kind(m)].run(feeds, self.comm)
                    losses.append(float(out["loss"]))
                else:
                    out = self._exe["F"].run(feeds, self.comm)
                self._keep_for_weight_grad(m, feeds, out)
                if kind == "F":
                    for c, v in st.send:
                        self.comm.send(np.ascontiguousarray(out[v]), self.ranks[c], tag(plan, m, v, False))
                    stash[m] = {v: (out[v] if v in out else feeds[v]) for v in st.stash}
                    kept = getattr(self._exe["F"], "output_tensors", {})
                    self._stash_tensors[m] = {v: kept[v] for v in st.stash if v in kept}
                    self.peak_stash = max(self.peak_stash, len(stash))
                for a, b in st.bn_state:
                    self.state[a] = out[b]  # a fresh array of the backend's (no copy per step)
                if kind == "F":
                    continue
            self._send_back(m, out, acc, "B" if kind == "B" else self._fused_kind(m))
        del out  # the last program's gradient outputs are in ``acc`` now: not alive during the update
        _release_done(self._exe, last, len(order))
        self._weight_grad(acc)
        moved_wgrad.join(self.stage.moved, acc, self.state, self.comm, self.ranks)
        for k in self._hoisted:  # the prepared values are not alive during the update
            self._tensors.pop(k, None)
        if hasattr(self._exe.get("P"), "output_tensors"):
            self._exe["P"].output_tensors = {}
        self._hoisted = {}
        self._update(acc)
        self.steps += 1
        return self._global_loss(losses)

    def _forward_feeds(self, m: int, data: Mapping[str, np.ndarray], sl: slice) -> dict[str, np.ndarray]:
        st, plan = self.stage, self.plan
        feeds = {d: np.ascontiguousarray(data[d][sl]) for d in st.data}
        for src, v in st.recv:
            shape, dtype = self._spec[v]
            feeds[v] = self.comm.recv(self.ranks[src], tag(plan, m, v, False), shape, dtype)
        feeds.update(self._state_feeds(st.weights))
        feeds.update({a: self.state[a] for a, _ in st.bn_state})
        feeds.update(self._hoisted_feeds())
        return feeds

    def _backward(self, m: int, stashed: dict[str, np.ndarray], acc: Mapping[str, np.ndarray]
                  ) -> dict[str, np.ndarray]:
        """Rule 2's ``B``: the stash, the weights and the gradients of every value sent (summed
        over the stages that read it)."""
        st, plan = self.stage, self.plan
        feeds = dict(stashed)
        feeds.update(self._state_feeds(st.weights))
        feeds.update({a: self.state[a] for a in self._b_bn})
        feeds.update(self._hoisted_feeds())
        for c, v in st.send:
            key = f"{v}.grad_out"
            if not self._is_float(v):
                continue
            shape, dtype = self._spec[v]
            g = self.comm.recv(self.ranks[c], tag(plan, m, v, True), shape, dtype)
            feeds[key] = feeds[key] + g if key in feeds else g
        if st.moved is not None and not st.moved.giver:  # pipeline rule 12: the moved dy columns
            shape, dtype = self._spec[st.moved.seed]
            feeds[st.moved.seed] = self.comm.recv(self.ranks[st.moved.peer], tag(plan, m, st.moved.seed, True),
                                                  shape, dtype)
        out = self._exe["B"].run({**feeds, **self._stash_tensors.pop(m, {}), **self._sums.feeds("B", acc)}, self.comm)
        self._keep_for_weight_grad(m, feeds, out)
        return out

    def _fused_kind(self, m: int) -> str:
        """Rule 10's tail: the last ``w_tail`` micro-batches run the program without the deferred
        weight gradients (``FBt``), the others the full one."""
        return "FBt" if "FBt" in self._exe and m >= self.plan.micro_batches - self.stage.w_tail else "FB"

    def _keep_for_weight_grad(self, m: int, *parts: Mapping[str, np.ndarray]) -> None:
        """Rule 10: the values of micro-batch ``m`` the deferred weight-gradient program reads
        (only the last ``w_tail`` micro-batches')."""
        covered = m >= self.plan.micro_batches - self.stage.w_tail
        keep = self._w_stash.setdefault(m, {}) if self.stage.w_stash and covered else None
        if keep is None:
            return
        for part in parts:
            keep.update({v: part[v] for v in self.stage.w_stash if v in part and v not in keep})

    def _weight_grad(self, acc: dict[str, np.ndarray]) -> None:
        """Rule 10: one call for the deferred weight gradients over the micro-batches it covers
        (the sum, as the accumulation gives; added to the other micro-batches' sum with the
        tail), their values concatenated on their batch axes."""
        if "W" not in self._exe:
            return
        st, ms = self.stage, sorted(self._w_stash)
        feeds = {v: np.concatenate([self._w_stash[m][v] for m in ms], axis=st.w_axes[v]) for v in st.w_stash}
        self._w_stash.clear()
        feeds.update(self._state_feeds(st.weights))
        feeds.update({a: self.state[a] for a, _ in st.bn_state})
        feeds.update(self._hoisted_feeds())
        out = self._exe["W"].run(feeds, self.comm)
        _release_done(self._exe, {"W": 0}, 1)
        del feeds
        for w in st.weights:
            g = out.get(f"{w}.grad")
            if g is not None and w in acc and acc[w].flags.writeable:  # the tail: the earlier micro-batches' sum
                np.add(acc[w], g, out=acc[w])
            elif g is not None and w in acc:
                acc[w] = acc[w] + g
            elif g is not None:
                acc[w] = g

    def _keep_tensors(self, kind: str, names: Mapping[str, str]) -> None:
        """``WEIGHT_TENSORS``: remember program ``kind``'s output tensors behind the state or
        prepared values ``names`` (value -> output); a value without one is fed as its array."""
        kept = getattr(self._exe[kind], "output_tensors", {})
        for a, b in names.items():
            if b in kept:
                self._tensors[a] = kept[b]
            else:
                self._tensors.pop(a, None)

    def _state_feeds(self, names: Any) -> dict[str, Any]:
        return {n: self._tensors.get(n, self.state[n]) for n in names}

    def _hoisted_feeds(self) -> dict[str, Any]:
        return {k: self._tensors.get(k, v) for k, v in self._hoisted.items()}

    def _is_float(self, v: str) -> bool:
        return np.issubdtype(self._spec[v][1], np.floating)

    def _send_back(self, m: int, out: Mapping[str, np.ndarray], acc: dict[str, np.ndarray], kind: str) -> None:
        st = self.stage
        summed = self._sums.inputs.get(kind, {})  # ACCUMULATE_IN_PROGRAM: these outputs are the sums
        kept = getattr(self._exe[kind], "output_tensors", {}) if summed else {}
        for src, v in st.recv:
            if v in st.grad_in:
                self.comm.send(np.ascontiguousarray(out[f"{v}.grad_in"]), self.ranks[src], tag(self.plan, m, v, True))
        if st.moved is not None and st.moved.giver:  # pipeline rule 12: dy's moved columns
            seed = np.ascontiguousarray(out[st.moved.seed])
            self.comm.send(seed, self.ranks[st.moved.peer], tag(self.plan, m, st.moved.seed, True))
        for w in st.weights + ([st.moved.grad] if st.moved is not None and not st.moved.giver else []):
            g = out.get(w if st.moved is not None and w == st.moved.grad else f"{w}.grad")
            if g is None:  # rule 10: a deferred weight gradient (the whole-batch program gives it)
                continue
            if w in summed:  # the program added the sum so far
                acc[w] = g
                self._sums.keep(w, kept.get(f"{w}.grad"), g)
                continue
            if w not in acc:
                acc[w] = g if g.flags.writeable else g.copy()
            elif acc[w].flags.writeable:
                np.add(acc[w], g, out=acc[w])
            else:  # a program's read-only sum
                acc[w] = acc[w] + g

    def _update(self, acc: dict[str, np.ndarray]) -> None:
        """Rule 4: the optimizer on the mean of the micro-batches' gradients."""
        st = self.stage
        replicas = len(self.replica_group)
        for i, w in enumerate(st.weights if replicas > 1 else ()):  # hybrid: sum over the replicas
            acc[w] = self.comm.allreduce(acc[w], self.replica_group, "sum", REPLICA_TAG + i)
        scale = np.array(1.0 / (self.plan.micro_batches * replicas), dtype=self._spec["grad.scale"][1])
        sums = self._sums.take(acc)  # the unchanged sums' tensors
        feeds = {"grad.scale": scale, **self._state_feeds(a for a, _ in st.update_pairs),
                 **{f"{w}.grad": sums.get(w, acc[w]) for w in st.weights}}
        acc.clear()
        del sums
        out = self._exe["U"].run(feeds, self.comm)
        del feeds
        for a, b in st.update_pairs:
            self.state[a] = _frozen(out[b])  # the backend's fresh output array: no copy per step
        self._keep_tensors("U", dict(st.update_pairs))
        if hasattr(self.comm, "flush"):
            self.comm.flush()  # every activation / gradient send of this step has completed

    def _global_loss(self, losses: list[float]) -> float:
        last = self.plan.num_stages - 1
        if self.plan.num_stages == 1:
            return float(np.mean(losses))
        mine = np.array([np.mean(losses)], dtype=np.float64) if self.stage.index == last else None
        loss = self.comm.broadcast(mine, self.ranks, self.ranks[last], LOSS_TAG)
        if len(self.replica_group) > 1:  # hybrid: the mean over the replicas
            loss = self.comm.allreduce(loss, self.replica_group, "sum", LOSS_TAG - 1) / len(self.replica_group)
        return float(loss[0])

    # state -------------------------------------------------------------------------------------
    def gather_state(self, runners: Sequence[PipelineRunner]) -> dict[str, np.ndarray]:
        """Every stage's state (collective on MPI ranks); :func:`gathered_state`."""
        return gathered_state(runners)

    def weights(self) -> dict[str, np.ndarray]:
        """This stage's weights and BN statistics."""
        names = set(self.stage.weights) | {a for a, _ in self.stage.bn_state}
        return {n: self.state[n] for n in names}


class InProgramSums:
    """``ACCUMULATE_IN_PROGRAM``: a stage's programs rewritten by :func:`accumulating` (``programs``
    is changed in place) and the running sums passed from one call to the next: each weight's sum
    as the last call's output tensor, zeros (a tensor made once) on the step's first call."""

    def __init__(self, programs: dict[str, onnx.ModelProto], weights: Sequence[str], on: bool) -> None:
        self.inputs: dict[str, dict[str, str]] = {}  # program kind -> weight -> its running-sum input
        for kind in ("B", "FB", "FBt") if on else ():
            if kind in programs:
                programs[kind], names = accumulating(programs[kind], weights)
                if names:
                    self.inputs[kind] = names
        specs = [_specs(p) for p in programs.values()]
        self._zero = {w: _zero_tensor(next(s[f"{w}.grad"] for s in specs if f"{w}.grad" in s))
                      for names in self.inputs.values() for w in names}
        self._kept: dict[str, tuple[Any, np.ndarray]] = {}  # weight -> (the running sum's tensor, its array)

    def feeds(self, kind: str, acc: Mapping[str, np.ndarray]) -> dict[str, Any]:
        """Program ``kind``'s running-sum inputs: the sum so far (the last call's output tensor,
        else its array), zeros on the step's first call."""
        feeds = {}
        for w, name in self.inputs.get(kind, {}).items():
            kept = self._kept.get(w)
            feeds[name] = kept[0] if kept is not None else acc[w] if w in acc else self._zero[w]
        return feeds

    def keep(self, w: str, tensor: Any, array: np.ndarray) -> None:
        """Weight ``w``'s sum after a call: its output tensor (None: not kept as one) and array."""
        if tensor is not None:
            self._kept[w] = (tensor, array)
        else:
            self._kept.pop(w, None)

    def take(self, acc: Mapping[str, np.ndarray]) -> dict[str, Any]:
        """The step's end: the tensors of the sums ``acc`` still holds unchanged; forgets them all."""
        sums = {w: t for w, (t, a) in self._kept.items() if acc.get(w) is a}
        self._kept.clear()
        return sums


def _stage_executables(st: Any, backend: str, folder: Path | None, threads: int) -> tuple[dict[str, Any], InProgramSums]:
    """The stage's programs built (``ACCUMULATE_IN_PROGRAM``'s rewrite first) with the output
    tensors each one keeps: program kind -> executable, and the running sums' bookkeeping."""
    programs = {kind: prog for kind, prog in (("F", st.forward), ("B", st.backward), ("FB", st.fused),
                                              ("U", st.update), ("P", st.prepare), ("W", st.weight_grad),
                                              ("FBt", st.fused_tail)) if prog is not None}
    sums = InProgramSums(programs, st.weights, ACCUMULATE_IN_PROGRAM and backend == "tvm")
    exe = {kind: executable(prog, backend, folder, threads) for kind, prog in programs.items()}
    for e in exe.values():  # a weight is copied into a TVM input buffer once per step (executable rule 5)
        if hasattr(e, "reuse_readonly_inputs"):
            e.reuse_readonly_inputs = True
    keep = (["F"] if STASH_TENSORS else []) + (["U", "P"] if WEIGHT_TENSORS else [])
    for kind in keep:
        if hasattr(exe.get(kind), "keep_output_tensors"):
            exe[kind].keep_output_tensors = True
    for kind in sums.inputs:  # the running sums go from one call to the next as tensors
        exe[kind].keep_output_tensors = True
    return exe, sums


def _zero_tensor(spec: tuple[tuple[int, ...], np.dtype]) -> Any:
    """``ACCUMULATE_IN_PROGRAM``: the running sum of a step's first call, a CPU TVM tensor of
    zeros made once (fed as a tensor: no copy into an input buffer per step)."""
    import tvm

    shape, dtype = spec
    return tvm.runtime.tensor(np.zeros(shape, dtype), tvm.cpu(0))


def _release_done(exes: Mapping[str, Any], last: dict[str, int], call: int) -> None:
    """``RELEASE_STEP_CONSTANTS``: before call ``call`` of the step, drop the lifted step constants
    of the programs whose last call (``last``: program -> its last call's index) has run; ``last``
    loses them."""
    for kind in [k for k, i in last.items() if i < call] if RELEASE_STEP_CONSTANTS else ():
        del last[kind]
        release = getattr(exes[kind], "release_step_constants", None)
        if release is not None:
            release()


def gathered_state(runners: Sequence[PipelineRunner]) -> dict[str, np.ndarray]:
    """Every stage's state in one dict (a 1-rank step's state; pipeline rule 6). With all stages
    in this process it is a merge; with one stage per MPI rank, the first stage's rank receives
    the others' state (call it on every rank; the others get their own state back)."""
    if len(runners) > 1:  # every rank in this process: replica 0's stages hold the state
        return join_state(runners[0].plan.parts, merged([r.state for r in runners if r.replica == 0]))
    me = runners[0]
    if me.replica != 0:  # replicas hold the same state; replica 0's stages gather it
        return dict(me.state)
    i = 0
    if me.stage.index != 0:
        for i, name in enumerate(sorted(me.state)):
            me.comm.send(np.ascontiguousarray(me.state[name]), me.ranks[0], GATHER_TAG + i)
        if hasattr(me.comm, "flush"):
            me.comm.flush()
        return dict(me.state)
    parts = [dict(me.state)]
    for other in me.plan.stages[1:]:
        part = {}
        for i, name in enumerate(sorted(stage_state_names(other))):
            init = other.initial[name]
            part[name] = me.comm.recv(me.ranks[other.index], GATHER_TAG + i, init.shape, init.dtype)
        parts.append(part)
    return join_state(me.plan.parts, merged(parts))


def pipeline_runners(model: Any, loss: str, optimizer: Any, *, batch: int, devices: int, schedule: str,
                     micro_batches: int, trainable: Sequence[str] | None, backend: str, comm: Any, out: Path | None,
                     threads: int, state: Mapping[str, np.ndarray] | None,
                     stages: int | None = None, memory_limit: float | None = None
                     ) -> tuple[list[int], list[PipelineRunner]]:
    """The training loop's runners for ``--strategy pipeline`` (``stages = devices``) or ``hybrid``
    (``devices / stages`` data-parallel replicas of a ``stages``-stage pipeline; rank
    ``d * stages + s`` is stage s of replica d): on an MPI rank (``comm``) that rank's runner
    only, else every rank as a thread's runner over an in-process communicator."""
    from partitioner.training.pipeline import build_pipeline

    stages = stages or devices
    if stages < 2 or devices % stages:
        raise UsageError(f"--stages {stages}: a pipeline needs at least 2 stages, and --devices {devices} must be a "
                         "multiple of it")
    replicas = devices // stages
    if batch % replicas:
        raise UsageError(f"--batch {batch} does not split evenly over {replicas} pipeline replicas")
    plan = build_pipeline(model, loss, optimizer, batch=batch // replicas, stages=stages, micro_batches=micro_batches,
                          schedule=schedule, trainable=trainable, memory_limit=memory_limit, backend=backend,
                          comm=comm, ranks=range(devices))

    def runner(rank: int, c: Any, work: Path | None) -> PipelineRunner:
        d, s = divmod(rank, stages)
        return PipelineRunner(plan, s, comm=c, ranks=[d * stages + k for k in range(stages)], replica=d,
                              replica_group=[e * stages + s for e in range(replicas)], workdir=work,
                              backend=backend, threads=threads, state=state)

    if comm is not None:
        mine = runner(comm.rank, comm, out / f"rank{comm.rank}" if out is not None else None)
        for st in plan.stages:  # this rank holds its own stage's state only; the rest: shapes for the gather
            st.initial = {k: np.broadcast_to(np.zeros((), v.dtype), v.shape) for k, v in st.initial.items()}
        return [comm.rank], [mine]
    from partitioner.runtime.comm_local import LocalWorld

    world = LocalWorld(devices)
    return list(range(devices)), [runner(r, world.communicator(r), out / f"rank{r}" if out is not None else None)
                                  for r in range(devices)]
