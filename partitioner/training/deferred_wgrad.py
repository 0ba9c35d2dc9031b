"""Deferred weight gradients for pipeline stages: one weight-gradient program over the whole batch.

A pipeline stage (:mod:`partitioner.training.pipeline` rule 2) used to compute its weight
gradients in every micro-batch's backward and sum them in the rank: ``M`` weight-sized outputs
and ``M - 1`` weight-sized additions per step, and ``M`` small GEMMs / convolutions per weight.
Measured on the zoo resnet-18 (64x64, batch 16, 2 stages, 1F1B x8 on ONNX Runtime, micro-batches
of 2 images, each stage alone, thread CPU): the last stage's weight-gradient-only kernels took
50 ms per step at micro-batch 2 against 19 ms for one call over the 16 images, and summing its
gradients 19 ms more. As zero-bubble pipelines do, each micro-batch now runs only the backward
that the next stage down the pipe waits for (its activations' gradients), and the weight
gradients run once per step, after the last micro-batch, over the stashed values of every
micro-batch concatenated.

Rules:

1. What is deferred: a weight's gradient nodes ``W`` = the ancestors of its ``<w>.grad`` output
   that are neither in the stage's forward program nor ancestors of what a micro-batch must
   produce (the gradients it sends back, the loss, the BN statistics, the gradient of every
   forward value: those feed earlier layers' gradients). The per-micro-batch backward is the
   rest (its nodes are exactly those ancestors).
2. When: the values ``W`` reads from a micro-batch (forward values, activation gradients, data,
   received values and gradient seeds) must each have exactly one *batch axis*: the axis whose
   length is ``M`` times longer in the stage built at the whole batch than at the micro-batch,
   every other axis equal. Then the whole-batch ``W`` over the micro-batches' values
   concatenated on that axis is the sum of the micro-batches' weight gradients (each is a sum
   over its samples; the loss's ``1 / micro-batch`` is already in the seeds), i.e. what the
   accumulation computed. A weight whose ``W`` reads a per-micro-batch value without a batch
   axis (a micro-batch statistic) keeps the per-micro-batch gradient and the sum (as before).
   The concatenation assumes the batch is the outermost factor of its axis (as every gradient
   rule's reshapes keep it: ``[N, ...]`` flattened row-major).
3. The whole-batch ``W`` program is cut from the same stage built at the whole batch (the
   builder names its nodes and values deterministically; a mismatch falls back to rule 2's
   per-micro-batch gradients for the whole stage).
4. Memory: the values ``W`` reads stay alive for all ``M`` micro-batches (GPipe's stash for
   those values), so a plan with ``--memory-limit`` or recompute does not defer (the memory DP
   counts 1F1B's ``S - s`` stashes).

5. Which stage: the last only. Its deferred program runs while the earlier stages drain (their
   last backwards), off the step's critical path; an earlier stage's would run after its own
   last backward, on it. Measured (zoo resnet ORT, every stage deferring, per-call CPU of each
   stage alone fed to a 1F1B simulation with free messages, load 7.9): 330.9 ms per step
   against 324.9 without deferral, though the stages' CPU fell (292 / 252 from 316 / 284 ms):
   stage 0's 94 ms whole-batch program (its 8x8-32x32 convolutions cost the same at 16 images
   as 8 times at 2) sat at the step's end.

   :data:`DEFER_EARLIER_STAGES` (off) defers every stage's.
6. Whether: ONNX Runtime plans only, and only when the last stage's weight gradients are
   small: every Conv / ConvTranspose / Gemm / MatMul with a weight there sums its gradient over
   at most :data:`DEFER_MAX_ROWS` rows per micro-batch (its output's elements per output
   channel: micro-batch x positions). Those run far below the GEMM rate and gain from the
   whole batch; bigger ones run as fast per micro-batch, and the whole-batch program only adds
   a tail after the last micro-batch. Measured (each stage alone, thread CPU per call, a 1F1B
   step simulated from the calls with free messages, paired on / off, load 4-7): the resnet's
   last stage (layer3.1.conv2 on, 2 images: 32 rows at 4x4, 8 at layer4's 2x2) 305.2 ->
   282.9 ms; the mlp (128 rows) 196.1 -> 215.4 ms on ONNX Runtime and 201.2 -> 211.4 on TVM;
   bert (4 x 64 = 256 rows) 206.4 -> 234.3 ms. Measured prices alone (the time each plan
   would take from rule 7's rows) did not separate them: the single-program profile misprices
   the split stages by about 20%, more than the margins. (:func:`~partitioner.training.pipeline.deferred_cut`;
   :data:`DEFER_ALWAYS` skips the choice.) TVM plans do not defer the whole batch's (only rule 7's tail): their cut is measured on ONNX Runtime, whose
   whole-batch prices misled it (measured_cut rule 7), and with rule 1's cut the zoo mlp's
   1F1B step simulated from its measured TVM calls went 201 -> 211 ms (its 128-row GEMMs run as
   fast as the whole batch's, so the deferred program only adds a tail).

7. The tail (zero-bubble's ZB-H1 on the last stage): where rule 6 finds the last stage's weight
   gradients too big to defer the whole batch's (the mlp's 128 rows, bert's 256; on ONNX Runtime
   and TVM plans; a TVM plan with small ones, the resnet's, keeps them per micro-batch as before:
   measured, each stage alone, its stage 0 is the slower, and the tail adds two TVM builds),
   the last stage defers those of its last ``K`` = :data:`DEFER_TAIL_MICRO_BATCHES` micro-batches
   only: micro-batches ``0 .. M-K-1`` run the full fused program (weight gradients accumulated,
   rule 4), the last ``K`` the program without them, so each sends its input gradient back
   without waiting for its weight gradients, and one ``W`` program built at ``K`` micro-batches
   (rules 2-3 with ``K`` for ``M``) runs after the last, added to the sum. In 1F1B and GPipe the
   earlier stages' last backwards wait on those input gradients, and stage ``S-2``'s last
   backward is the step's tail; ``W`` now runs beside it instead of before it. For 2 stages
   with per-micro-batch stage 0 backward ``b`` and last-stage weight gradients ``w``, the tail
   after the last stage's last weight-free program shrinks from ``K w + b`` (the ``K w`` in its
   programs before) to ``max(K w, b)``, i.e. by ``min(K w, b)``; ``K = 2`` fits the zoo mlp (the
   last stage's two weight-gradient GEMMs per micro-batch against stage 0's three GEMMs in its
   backward). Needs ``K >= 2`` (rule 2's batch axis) and ``M > K``; with ``M <= K`` rule 6
   decides alone.

Knobs: :data:`DEFER_WEIGHT_GRADIENTS` (module constant, on; off turns rule 7 off too),
:data:`DEFER_TAIL_MICRO_BATCHES` (2).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import onnx
import onnx_ir as ir

from partitioner.training.autodiff import is_float

#: rules 1-5 on (off: every micro-batch computes and accumulates its weight gradients); the
#: environment's ``PARTITIONER_TRAIN_DEFER_WGRAD=0`` turns it off in MPI ranks too (a paired
#: before/after: ``benchmarks/train_step.py --paired-env PARTITIONER_TRAIN_DEFER_WGRAD=0``)
DEFER_WEIGHT_GRADIENTS = os.environ.get("PARTITIONER_TRAIN_DEFER_WGRAD", "1") != "0"
#: rule 5: the stages before the last defer too (off: measured slower, see rule 5)
DEFER_EARLIER_STAGES = False
#: rule 6: defer whenever allowed, without pipeline.deferred_cut's choice (tests; off)
DEFER_ALWAYS = False
#: rule 6: the most rows per micro-batch a deferring stage's weight gradients sum over
DEFER_MAX_ROWS = 64
#: rule 7 (ZB-H1 tail): where the last stage does not defer every micro-batch's weight gradients,
#: it defers those of its last this-many micro-batches (0 or 1: off; ``PARTITIONER_TRAIN_DEFER_TAIL``)
DEFER_TAIL_MICRO_BATCHES = int(os.environ.get("PARTITIONER_TRAIN_DEFER_TAIL", "2"))
_PRODUCTS = ("Conv", "ConvTranspose", "Gemm", "MatMul")


@dataclass
class Deferral:
    """Rule 1's split of one stage program: per-micro-batch nodes and the whole-batch ``W``."""

    micro_nodes: set[int]  # node indices of the micro-batch program (forward excluded)
    program: onnx.ModelProto  # W at the whole batch
    stash: list[str]  # values W reads from each micro-batch
    axes: dict[str, int]  # rule 2: each stash value's batch axis
    deferred: list[str]  # the weights whose gradient W computes


def forward_activations(graph: ir.Graph) -> list[ir.Value]:
    """Rule 1: the float values of the stage's forward nodes (their gradients stay per micro-batch)."""
    return [v for n in graph for v in n.outputs if is_float(v)]


def activation_grads(grads: dict[str, ir.Value], activations: Sequence[ir.Value]) -> list[str]:
    """Names of the forward values' gradients that the backward computes (a zero constant is none)."""
    out = []
    for a in activations:
        g = grads.get(a.name)
        if g is not None and (g.producer() is not None or g.const_value is None):
            out.append(g.name)
    return list(dict.fromkeys(out))


def small_gradients(graph: ir.Graph, start: int) -> bool:
    """Rule 6: whether every weight product from node ``start`` on (the last stage) sums its
    weight gradient over at most :data:`DEFER_MAX_ROWS` rows per micro-batch."""
    rows = []
    for node in list(graph)[start:]:
        if node.op_type not in _PRODUCTS or not any(v is not None and v.name in graph.initializers
                                                    for v in node.inputs[1:2]):
            continue
        shape = node.outputs[0].shape
        if shape is None or not all(isinstance(d, int) for d in shape) or len(shape) < 2:
            return False
        dims = [int(d) for d in shape]
        channels = dims[1] if node.op_type.startswith("Conv") else dims[-1]
        rows.append(int(np.prod(dims)) // max(channels, 1))
    return bool(rows) and max(rows) <= DEFER_MAX_ROWS


def _shapes(model: onnx.ModelProto) -> dict[str, tuple[int, ...]]:
    g = model.graph
    return {v.name: tuple(d.dim_value for d in v.type.tensor_type.shape.dim)
            for v in list(g.value_info) + list(g.input) + list(g.output)}


def batch_axis(micro: tuple[int, ...] | None, whole: tuple[int, ...] | None, m: int) -> int | None:
    """Rule 2: the one axis that is ``m`` times longer at the whole batch, else None."""
    if micro is None or whole is None or len(micro) != len(whole) or m < 2:
        return None
    diff = [i for i, (a, b) in enumerate(zip(micro, whole)) if a != b]
    if len(diff) != 1 or whole[diff[0]] != m * micro[diff[0]] or micro[diff[0]] < 1:
        return None
    return diff[0]


def _ancestors(g: onnx.GraphProto, outputs: Sequence[str]) -> set[int]:
    from partitioner.training.pipeline import _ancestors as anc

    return anc(g, list(outputs))


def _reads(g: onnx.GraphProto, idx: set[int]) -> set[str]:
    made = {o for i in idx for o in g.node[i].output}
    return {x for i in idx for x in g.node[i].input if x and x not in made}


def split(full: onnx.ModelProto, whole: onnx.ModelProto, forward: set[int], act_grads: Sequence[str],
          weights: Sequence[str], per_step: set[str], micro_batches: int) -> Deferral | None:
    """Rules 1-3 on the stage program ``full`` (built at the micro-batch) and ``whole`` (the same
    stage at the whole batch); ``forward``: the node indices of the stage's forward program
    (empty for the last stage's fused program). None when no weight's gradient can be deferred."""
    g = full.graph
    inits = {t.name for t in g.initializer}
    wgrads = [f"{w}.grad" for w in weights]
    others = [o.name for o in g.output if o.name not in set(wgrads)]
    micro_s, whole_s = _shapes(full), _shapes(whole)
    kept: list[str] = []
    good = list(wgrads)
    for _ in range(len(wgrads) + 1):  # rule 2: move weights whose W reads a batch-less value
        micro = _ancestors(g, others + list(act_grads) + kept) - forward
        w_idx = _ancestors(g, good) - forward - micro
        bad = []
        for w in good:
            reads = _reads(g, _ancestors(g, [w]) & w_idx)
            if any(r not in per_step and r not in inits and batch_axis(micro_s.get(r), whole_s.get(r),
                                                                         micro_batches) is None for r in reads):
                bad.append(w)
        if not bad:
            break
        kept += bad
        good = [w for w in good if w not in bad]
    if not good:
        return None
    stash = sorted(r for r in _reads(g, w_idx) if r not in per_step and r not in inits)
    program = _whole_program(g, whole, w_idx, stash, per_step, good)
    if program is None:
        return None
    axes = {r: batch_axis(micro_s[r], whole_s[r], micro_batches) for r in stash}
    return Deferral(micro, program, stash, axes, [w[:-len(".grad")] for w in good])


def _whole_program(g: onnx.GraphProto, whole: onnx.ModelProto, w_idx: set[int], stash: list[str],
                   per_step: set[str], outputs: list[str]) -> onnx.ModelProto | None:
    """Rule 3: W's nodes taken from the whole-batch build (matched by their first output)."""
    from partitioner.training.pipeline import _subprogram

    firsts = {g.node[i].output[0] for i in w_idx}
    nodes = [n for n in whole.graph.node if n.output and n.output[0] in firsts]
    if len(nodes) != len(firsts):
        return None
    reads = _reads(whole.graph, {i for i, n in enumerate(whole.graph.node) if n.output and n.output[0] in firsts})
    inputs = stash + sorted(r for r in reads if r in per_step)
    known = {v.name for v in list(whole.graph.value_info) + list(whole.graph.input) + list(whole.graph.output)}
    inits = {t.name for t in whole.graph.initializer}
    if any(v not in known for v in inputs + outputs) or any(r not in known and r not in inits for r in reads):
        return None
    return _subprogram(whole, nodes, inputs, outputs, "W")
