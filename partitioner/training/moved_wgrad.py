"""Weight-gradient columns moved across the last pipeline cut: balance without moving forward work.

A cut falls between nodes, so the zoo mlp's (4 layers 1024 wide, batch 1024, 2 stages, 1F1B x8)
stages stay 5:6 GEMMs per micro-batch: stage 0 runs its two forward GEMMs, its second layer's
input and weight gradients and its first layer's weight gradient (no input gradient); the last
stage two forward GEMMs, two input and two weight gradients, and the loss. The last stage is the
slower one and sets the 1F1B step. :mod:`~partitioner.training.split_cut` (rule 11, off) moves
forward columns across the cut and pays a ``Concat`` and narrower products for about what it
moves. Here only a weight gradient moves: the last stage's first product ``y = x W`` (``x`` the
value received from the stage before) has the weight gradient ``dW = x^T dy``; that stage
already computes ``dy`` for ``x``'s gradient, and the stage before already holds ``x`` (it sent
it). So the last stage computes the first ``n`` output columns of ``dW`` from ``dy[:, :n]`` and
sends ``dy[:, n:]`` back beside ``x``'s gradient; the stage before computes ``x^T dy[:, n:]`` in
its ``B`` and accumulates it; once per step, before the update, it sends that sum to the last
stage, which joins the two column blocks into ``W``'s gradient. No forward work and no state
move: the weight and its optimizer state stay on the last stage under their 1-rank names.

Rules:

1. Which product: the first weight (in the last stage's order) whose gradient is a ``MatMul`` or
   ``Gemm`` of two inputs, one of them a value the stage receives from the stage before (or its
   ``Transpose``), the other the output gradient ``dy``, in a form where ``dy``'s last axis
   indexes one axis of ``dW``: ``MatMul(x^T, dy)`` or ``Gemm(x, dy, transB=0)`` (columns, axis 1),
   ``Gemm(dy, x, transA=1)`` (a ``[out, in]`` weight, rows, axis 0). Any other form: nothing moves.
2. How much: ``n_moved`` = :data:`MOVED_COLUMNS` (rounded down to a multiple of 16; the
   environment's ``PARTITIONER_TRAIN_MOVE_WGRAD_COLUMNS`` sets it, 0 turns the rule off), else
   ``dy``'s width x :data:`MOVED_FRACTION`: the stage before's share. For the zoo mlp the two
   stages differ by about one GEMM per micro-batch (replayed, each stage alone: 162 / 188 ms of
   CPU per step on ONNX Runtime, a 1024-column weight gradient about 28 ms of it), so half a
   weight gradient balances them.
3. Where it runs: every micro-batch's ``dy[:, n:]`` is an output of the last stage's per
   micro-batch program (``fused`` and, with deferred_wgrad rule 7's tail, ``fused_tail``); its
   own ``dW[:, :n]`` stays wherever the gradient was (``fused``, or the deferred ``weight_grad``
   program). The stage before receives it in ``B`` (after ``x``'s gradient) and stashes ``x``
   from its ``F``: one more stashed value per in-flight micro-batch.
4. When: 2 or more stages, the cut's stage before not recomputing (rule 8: its ``B`` would
   recompute ``x``), no split product (split_cut rule 11) and at least 16 columns each side.
   Both stages must run the same plan (built by the same code from the same settings, as every
   pipeline plan is).

5. Why it is off: on 2 stages, 1F1B runs stage 0's ``F(m)`` after its ``B(m-2)``, so the last
   stage's ``FB(m)`` waits for the chain ``FB(m-2)``, a message, ``B(m-2)``, ``F(m)``, a message:
   two micro-batches take ``max(2 FB, FB + B + F + messages)``. Moving work from ``FB`` to ``B``
   lowers ``2 FB`` but not ``FB + B + F`` (it grows: the moved columns cost stage 0 more than
   they save the last stage), so the gain is at most the unmoved plan's slack ``2 FB - (FB + B +
   F)`` less the two messages' latency and the ranks' jitter: about 4 ms per two micro-batches
   from the replayed ONNX Runtime calls (``FB`` 26.2, ``B + F`` 20.8 ms unmoved; 24.0 and 24.3
   moved). The replay's free messages keep it (it gains); the loaded machine's MPI jitter ate it
   (measured, paired: no gain). Rule 6 gives it that slack.
6. With the slack (session 14): when columns move on a 1F1B plan without a memory limit, the
   stages before the last run at least :data:`WARMUP_WHEN_MOVED` extra warm-up forwards
   (``PipelinePlan.extra_warmup``, pipeline rule 5: one more stash on stage 0, which the cost
   model and the memory DP read from the plan). Then the last stage's ``FB(m)`` waits for the
   chain through ``F(m)`` after ``B(m-3)``: three micro-batches take ``max(3 FB, FB + B + F +
   messages)``, the last stage's own work, which the moved columns shorten. Measured on TVM (the
   zoo mlp 4x1024, batch 1024, 1F1B x8, 2 MPI ranks; ``benchmarks/pipeline_mpi_timers.py``, the
   step replayed from each rank's median calls in thread CPU, 4 paired rounds, load 8-15):
   median 148.1 ms with neither, 143.3 moved alone, 145.1 the warm-up alone, 139.1 both (each
   round both shorter than neither by 2-9%; with the CPU between the calls, rounds 2-4: 7.8%
   and 5.0% shorter, 0.3% longer; docs/training.md, session 14). Per call (thread
   CPU): the last stage's ``FB`` 16.1 -> 15.0
   ms, its ``W`` 11.6 -> 9.0, stage 0's ``B`` 8.3 -> 10.1; both ranks then do about 128 ms of
   calls a step (115 and 138 before).

Knobs: :data:`MOVE_BY_BACKEND` (TVM on; ONNX Runtime off: with its extra warm-up, session 13's
3 wall-clock pairs under MPI at load 5 showed no gain, and it was not replayed this way), :data:`MOVE_WEIGHT_GRADIENT` (the
environment's ``PARTITIONER_TRAIN_MOVE_WGRAD=1`` / ``=0`` forces it on / off for every backend,
in MPI ranks too; unset: the table) and :data:`WARMUP_WHEN_MOVED` (rule 6; 0 turns it off).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
from onnx import helper

from backends.tvm.lift_step_constants import keep_step_constants_last

#: rules 1-4 per backend (off: the last stage computes its first product's whole weight
#: gradient). TVM on (session 14, with rule 6: the zoo mlp's
#: 1F1B x8 step replayed in thread CPU from the MPI ranks' calls, 148.1 -> 139.1 ms, rule 6). ONNX Runtime off: the replayed zoo mlp
#: step (pipeline_schedule.py, paired) got 1.5-6% shorter in each of 2 runs, the paired MPI steps
#: did not (rule 5; session 13, before its extra warm-up). A backend not listed: off
MOVE_BY_BACKEND: dict[str, bool] = {"onnxruntime": False, "tvm": True}
_ENV_MOVE = os.environ.get("PARTITIONER_TRAIN_MOVE_WGRAD")
#: True / False: rules 1-4 on / off for every backend (``PARTITIONER_TRAIN_MOVE_WGRAD=1`` / ``=0``,
#: in MPI ranks too); None: :data:`MOVE_BY_BACKEND` decides
MOVE_WEIGHT_GRADIENT: bool | None = None if _ENV_MOVE in (None, "") else _ENV_MOVE == "1"
#: rule 6: the extra warm-up forwards a 1F1B plan with moved columns runs at least (0: off)
WARMUP_WHEN_MOVED = 1
#: rule 2: the share of the output columns the stage before computes
MOVED_FRACTION = 0.5
#: rule 2: a fixed column count instead (None: the fraction)
MOVED_COLUMNS = (int(os.environ["PARTITIONER_TRAIN_MOVE_WGRAD_COLUMNS"])
                 if os.environ.get("PARTITIONER_TRAIN_MOVE_WGRAD_COLUMNS") else None)
#: the per-step sum's message tag (the per-micro-batch ``dy`` columns use the plan's tags)
SUM_TAG = 28000
_ALIGN = 16


@dataclass
class Moved:
    """What one side of the cut does (rule 3): ``giver`` is the last stage (it sends ``seed`` per
    micro-batch and receives the sum), the taker the stage before (``x`` stashed, ``grad`` its sum)."""

    weight: str
    seed: str  # dy[:, n:] per micro-batch
    grad: str  # the taker's B output: x^T dy[:, n:]
    x: str
    axis: int  # dW's axis the columns index
    kept: int  # n: the columns the last stage keeps
    peer: int  # the other stage's index
    giver: bool


def _producer(g: onnx.GraphProto, name: str) -> onnx.NodeProto | None:
    for n in g.node:
        if name in n.output:
            return n
    return None


def _source(g: onnx.GraphProto, name: str) -> onnx.NodeProto | None:
    """The node making ``name``, through ``Identity`` nodes."""
    node = _producer(g, name)
    while node is not None and node.op_type == "Identity":
        node = _producer(g, node.input[0])
    return node


def _attr(node: onnx.NodeProto, name: str) -> int:
    return next((a.i for a in node.attribute if a.name == name), 0)


def _form(g: onnx.GraphProto, node: onnx.NodeProto, received: set[str]) -> tuple[int, int] | None:
    """Rule 1: (which input is ``dy``, ``dW``'s axis) when ``node`` is ``x^T dy`` in a supported form."""
    if node.op_type not in ("MatMul", "Gemm") or len(node.input) != 2:
        return None

    def is_x(v: str) -> bool:
        p = _producer(g, v)
        if p is None or p.op_type != "Transpose" or p.input[0] not in received:
            return v in received
        return list(next((a.ints for a in p.attribute if a.name == "perm"), [1, 0])) == [1, 0]

    ta, tb = _attr(node, "transA"), _attr(node, "transB")
    if node.op_type == "MatMul" and is_x(node.input[0]) and _producer(g, node.input[0]) is not None:
        return 1, 1  # MatMul(Transpose(x), dy)
    if node.op_type == "Gemm" and node.input[0] in received and ta == 1 and tb == 0:
        return 1, 1  # Gemm(x, dy, transA=1)
    if node.op_type == "Gemm" and node.input[1] in received and ta == 1 and tb == 0:
        return 0, 0  # Gemm(dy, x, transA=1): [out, in]
    return None


def _find(prog: onnx.ModelProto, weights: list[str], received: set[str]):
    g = prog.graph
    outs = {o.name for o in g.output}
    for w in weights:
        if f"{w}.grad" not in outs:
            continue
        node = _source(g, f"{w}.grad")
        form = _form(g, node, received) if node is not None else None
        if form is not None:
            return w, node, form
    return None


def _width(g: onnx.GraphProto, name: str) -> int | None:
    """``name``'s last dimension in ``g`` (None when unknown)."""
    for vi in list(g.value_info) + list(g.input) + list(g.output):
        if vi.name == name:
            dims = vi.type.tensor_type.shape.dim
            return dims[-1].dim_value if dims and dims[-1].dim_value > 0 else None
    return None


def _moved_count(width: int) -> int:
    n = MOVED_COLUMNS if MOVED_COLUMNS is not None else int(width * MOVED_FRACTION)
    n = n // _ALIGN * _ALIGN
    return n if _ALIGN <= n <= width - _ALIGN else 0


def _ints(g: onnx.GraphProto, name: str, values: list[int]) -> str:
    g.initializer.append(onnx.numpy_helper.from_array(np.array(values, dtype=np.int64), name))
    return name


def _slice(g: onnx.GraphProto, dy: str, lo: int, hi: int, out: str, at: int) -> None:
    """``out = dy[..., lo:hi]`` inserted before node ``at`` (keeps the topological order)."""
    s, e, a = (_ints(g, f"{out}.{k}", [v]) for k, v in (("starts", lo), ("ends", hi), ("axes", -1)))
    g.node.insert(at, helper.make_node("Slice", [dy, s, e, a], [out], name=f"{out}.slice"))


def _keep_columns(prog: onnx.ModelProto, w: str, dy: str, kept: int, axis: int) -> None:
    """Rule 3 on the program computing ``dW``: its product reads ``dy[:, :n]``, ``dW`` is ``n`` wide."""
    g = prog.graph
    node = _source(g, f"{w}.grad")
    at = list(g.node).index(node)
    part = f"{w}.grad.kept_dy"
    _slice(g, dy, 0, kept, part, at)
    node.input[list(node.input).index(dy)] = part
    chain = {f"{w}.grad"}
    p = _producer(g, f"{w}.grad")
    while p is not None and p is not node:
        chain.update(p.output)
        p = _producer(g, p.input[0])
    chain.update(node.output)
    for vi in list(g.value_info):
        if vi.name in chain:
            g.value_info.remove(vi)
    for o in g.output:
        if o.name == f"{w}.grad":
            o.type.tensor_type.shape.dim[axis].dim_value = kept


def _emit_seed(prog: onnx.ModelProto, dy: str, kept: int, width: int, seed: str, dtype: int,
               rows: int) -> None:
    """Rule 3: the per-micro-batch program also outputs ``dy[:, n:]``."""
    g = prog.graph
    at = next(i for i, n in enumerate(g.node) if dy in n.output) + 1
    _slice(g, dy, kept, width, seed, at)
    g.output.append(helper.make_tensor_value_info(seed, dtype, [rows, width - kept]))


def _take(prog: onnx.ModelProto, stage_g: onnx.GraphProto, node: onnx.NodeProto, dy_in: int, x: str,
          m: Moved, dtype: int, shape: list[int], out_shape: list[int]) -> None:
    """Rule 3 on the stage before's ``B``: inputs ``x`` and the seed, output ``x^T seed``."""
    g = prog.graph
    have = {i.name for i in g.input}
    rows = shape[0]
    if x not in have:
        g.input.append(helper.make_tensor_value_info(x, dtype, [rows, _width(stage_g, x)]))
    g.input.append(helper.make_tensor_value_info(m.seed, dtype, [rows, shape[1]]))
    if node.op_type == "MatMul":  # MatMul(Transpose(x), dy): one Gemm, no transposed copy of x
        g.node.append(helper.make_node("Gemm", [x, m.seed], [m.grad], name=m.grad, transA=1))
    else:
        inputs = list(node.input)
        inputs[dy_in] = m.seed
        ints = {a.name: a.i for a in node.attribute if a.type == onnx.AttributeProto.INT}
        g.node.append(helper.make_node("Gemm", inputs, [m.grad], name=m.grad, **ints))
    g.output.append(helper.make_tensor_value_info(m.grad, dtype, out_shape))
    keep_step_constants_last(prog)  # the new inputs go before the stage's step constants (hoist rule 7)


def enabled(backend: str | None) -> bool:
    """Rules 1-4 for a plan of ``backend`` (:data:`MOVE_WEIGHT_GRADIENT`, else the table)."""
    if MOVE_WEIGHT_GRADIENT is not None:
        return MOVE_WEIGHT_GRADIENT
    return MOVE_BY_BACKEND.get(backend or "onnxruntime", False)


def apply(plan: Any, backend: str | None = None, memory_limit: float | None = None) -> None:
    """Rules 1-4 on a built plan's last cut (in place): the stages' programs and ``Stage.moved``;
    rule 6's extra warm-up when columns moved."""
    if not enabled(backend) or plan.num_stages < 2 or plan.recompute or plan.parts:
        return
    _move(plan)
    if plan.stages[-1].moved is not None and plan.schedule == "1f1b" and memory_limit is None:
        plan.extra_warmup = max(plan.extra_warmup, WARMUP_WHEN_MOVED)


def _move(plan: Any) -> None:
    """Rules 1-4 (see :func:`apply`)."""
    last, before = plan.stages[-1], plan.stages[-2]
    received = {v for s, v in last.recv if s == before.index}
    progs = [p for p in (last.fused, last.weight_grad) if p is not None]
    found = next(((p, f) for p in progs if (f := _find(p, last.weights, received)) is not None), None)
    if found is None or before.backward is None or before.forward is None:
        return
    prog, (w, node, (dy_in, axis)) = found
    dy = node.input[dy_in]
    x_in = node.input[1 - dy_in]
    xp = _producer(prog.graph, x_in)
    x = xp.input[0] if xp is not None and xp.op_type == "Transpose" else x_in
    width = _width(prog.graph, dy)
    moved = _moved_count(width) if width else 0
    per_mb = [p for p in (last.fused, last.fused_tail) if p is not None]
    if not moved or x not in {o.name for o in before.forward.graph.output} or not all(
            any(dy in n.output for n in p.graph.node) for p in per_mb):
        return
    kept = width - moved
    out = next(vi.type.tensor_type for vi in prog.graph.output if vi.name == f"{w}.grad")
    out_shape = [d.dim_value for d in out.shape.dim]
    out_shape[axis] = moved
    seed, grad = f"{w}.grad.moved_dy", f"{w}.grad.moved"
    _take(before.backward, prog.graph, node, dy_in, x, Moved(w, seed, grad, x, axis, kept, last.index, False),
          out.elem_type, [plan.micro_batch, moved], out_shape)
    for p in progs:
        if f"{w}.grad" in {o.name for o in p.graph.output}:
            _keep_columns(p, w, dy, kept, axis)
    for p in per_mb:
        _emit_seed(p, dy, kept, width, seed, out.elem_type, plan.micro_batch)
    if x not in before.stash:
        before.stash.append(x)
    plan.value_ids.setdefault(seed, len(plan.value_ids))
    last.moved = Moved(w, seed, grad, x, axis, kept, before.index, True)
    before.moved = Moved(w, seed, grad, x, axis, kept, last.index, False)
    for p in [before.backward, *progs, *per_mb]:
        onnx.checker.check_model(p)


def join(m: Any, acc: dict[str, np.ndarray], state: dict[str, np.ndarray], comm: Any, ranks: Any) -> None:
    """Rule 12, once per step (``m`` is the stage's ``Stage.moved``, None when it takes no part):
    the stage before sends its weight-gradient columns' sum, the last stage joins them to its own
    columns in ``acc``."""
    if m is None:
        return
    if not m.giver:
        comm.send(np.ascontiguousarray(acc.pop(m.grad)), ranks[m.peer], SUM_TAG)
        return
    full = list(state[m.weight].shape)
    shape = full[:m.axis] + [full[m.axis] - m.kept] + full[m.axis + 1:]
    theirs = comm.recv(ranks[m.peer], SUM_TAG, tuple(shape), acc[m.weight].dtype)
    acc[m.weight] = np.concatenate([acc[m.weight], theirs], axis=m.axis)
