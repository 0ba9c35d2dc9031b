"""One weight product split by output columns across a pipeline cut, to balance the stages.

A pipeline cut falls between nodes, so two stages can differ by up to one layer's work. The zoo
mlp (4 x 1024 at batch 1024, 2 stages, 128-row micro-batches) has one even cut: stage 0 runs
five GEMMs per micro-batch (its first layer computes no input gradient), the last six plus the
loss; measured on ONNX Runtime, each stage alone, 139 against 166 ms of CPU per step. The last
stage sets the 1F1B step, so about a sixth of one of its layers belongs on stage 0.

Rules:

1. What is split: the first node after the cut between the last two stages, when it is a
   ``MatMul`` with a 2-D initializer weight ``[K, N]`` or a ``Gemm`` (no ``transA``) with a 2-D
   weight and a bias of ``N`` elements or none, and every weight it reads is trainable. It
   becomes two products over the weight's first ``n`` and last ``N - n`` output columns
   (``<w>.part0`` / ``<w>.part1``, the bias likewise) and a ``Concat`` on the last axis. Every
   output element is the same dot product as before; the input's gradient is the sum of the two
   parts' (float summation order only).
2. Where: the new cut runs right after the first part, so the stage before the last runs it (it
   sends its output along with the input the second part reads; the autodiff sums the input's
   gradient over the two stages, pipeline rule 2). The later stages' node indices move by two.
3. How much: from the measured node seconds of the cut (``measured_cut``; none, no split): the
   stage before the last ``t0``, the last ``t1``, the product's forward + backward ``p``; the
   part moved is ``n = N (t1 - t0) / (2 p)`` (both stages at ``(t0 + t1) / 2``), rounded down to
   a multiple of :data:`COLUMN_STEP`; nothing when that is under one step (the last stage is not
   the slower, or by less than a step's work) or more than half the columns. The product's
   backward scales with its columns (its weight and input gradients are ``n``-wide products too).
4. State: the stages hold the parts' state (``<w>.part0``, ``<w>.part0.m``, ...);
   :func:`split_state` cuts a 1-rank state into them (``--resume``, a start state) and
   :func:`join_state` concatenates them back, so a gathered checkpoint keeps the 1-rank names
   (pipeline rule 6).
5. Not with ``--memory-limit`` or recompute (the stage DP's memory split is over the unsplit
   graph), nor for one micro-batch.

6. Off by default. Measured on the zoo mlp (ONNX Runtime, ``benchmarks/pipeline_schedule.py
   --model mlp --rounds 11 --baseline partitioner.training.split_cut.SPLIT_ACROSS_CUT=False`` with
   ``PARTITIONER_TRAIN_SPLIT_COLUMNS`` set: each stage alone, thread CPU per call, the 1F1B x8 step
   replayed with free messages, split / unsplit interleaved; load 8.3-8.8 from other sessions):
   64 columns moved: stages 174.2 / 173.5 ms of CPU per step (unsplit 162.0 / 188.3), replayed
   step 195.7 against 203.1 ms; 96 columns: 207.7 against 208.7; 128: 215.4 against 217.4 (5
   rounds: 256 columns 185.4 against 184.8, the stages inverted, 170.4 / 146.6). The split's
   two narrower products and the ``Concat`` cost about what they move (the stages' CPU sum stays
   within 1%), and stage 0's last backward grows with its part, so balancing the stages' CPU
   shortens the replayed step by 0-4%. Rule 3's estimate from the 1-rank profile (256 columns:
   it prices the last stage 1.25-1.38x stage 0, where the stages alone measure 1.09-1.19x)
   overshoots; a better one would time the stage programs themselves. On TVM (7 rounds, load
   10.3-10.8, ``--baseline partitioner.training.split_cut.COLUMNS=0``) 128 columns balanced the
   stages (154.3 / 155.9 against 133.3 / 159.7 ms) but cost stage 0 21 ms for 4 off the last
   (TVM's narrow products run slower), the step 173.7 against 166.2 ms. The 2-rank MPI steps
   (``train_step.py --models mlp --paired-env PARTITIONER_TRAIN_SPLIT_COLUMNS=64 --configs "2
   ranks pipeline 1f1b x8 (MPI)" --rounds 3 --steps 8``, ONNX Runtime, load 8.3-13) measured
   970.6 ms unsplit against 987.5 split (medians; rounds 757-1158 ms, a quiet step is about
   225): the load, not the split.

Knobs: :data:`SPLIT_ACROSS_CUT` (module constant, off; ``PARTITIONER_TRAIN_SPLIT_CUT=1`` turns it on
in MPI ranks too), :data:`COLUMNS` (``PARTITIONER_TRAIN_SPLIT_COLUMNS=N``: split N columns, for a
paired ``train_step.py --paired-env`` measurement).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import onnx
import onnx_ir as ir
from onnx import helper, numpy_helper

#: rules 1-4 on (off, measured: see rule 6; ``PARTITIONER_TRAIN_SPLIT_CUT=1`` turns it on in MPI ranks too)
SPLIT_ACROSS_CUT = os.environ.get("PARTITIONER_TRAIN_SPLIT_CUT", "0") == "1"
#: rule 3: the moved columns are a multiple of this
COLUMN_STEP = 16
#: rule 3 overridden: move this many columns, split on even with the knob off (0: rule 3's estimate;
#: ``PARTITIONER_TRAIN_SPLIT_COLUMNS``, for measuring the step against the split's size)
COLUMNS = int(os.environ.get("PARTITIONER_TRAIN_SPLIT_COLUMNS", "0"))


@dataclass(frozen=True)
class Split:
    """Rule 1's split of node ``index`` (named ``node``): its first ``columns`` output columns."""

    index: int
    node: str
    columns: int


def choose(graph: ir.Graph, ends: Sequence[int], seconds: np.ndarray, trainable: Sequence[str]) -> Split | None:
    """Rules 1 and 3: the split that balances the last two stages, or None."""
    if not (SPLIT_ACROSS_CUT or COLUMNS > 0) or len(ends) < 2:
        return None
    nodes = list(graph)
    i = ends[-2] + 1
    n_cols = _columns(nodes[i], graph, set(trainable)) if i < len(nodes) else None
    if n_cols is None:
        return None
    start = ends[-3] + 1 if len(ends) > 2 else 0
    t0, t1 = float(np.sum(seconds[start:i])), float(np.sum(seconds[i:ends[-1] + 1]))
    p = float(seconds[i])
    if p <= 0:
        return None
    n = int(n_cols * (t1 - t0) / (2 * p)) // COLUMN_STEP * COLUMN_STEP if COLUMNS <= 0 else COLUMNS
    if n < COLUMN_STEP or 2 * n > n_cols:
        return None
    return Split(i, nodes[i].name or nodes[i].outputs[0].name, n)


def _columns(node: ir.Node, graph: ir.Graph, trainable: set[str]) -> int | None:
    """Rule 1: the product's output columns ``N`` when it can be split, else None."""
    inits = graph.initializers
    if node.op_type not in ("MatMul", "Gemm") or len(node.inputs) < 2 or node.inputs[1] is None:
        return None
    w = node.inputs[1]
    attrs = {k: a.value for k, a in node.attributes.items()}
    if w.name not in inits or w.name not in trainable or w.shape is None or len(w.shape) != 2:
        return None
    if node.op_type == "Gemm" and (attrs.get("transA", 0) or attrs.get("alpha", 1.0) != 1.0
                                   or attrs.get("beta", 1.0) != 1.0):
        return None
    n = int(w.shape[0] if attrs.get("transB", 0) else w.shape[1])
    bias = node.inputs[2] if len(node.inputs) > 2 else None
    if bias is not None and (bias.name not in inits or bias.name not in trainable or bias.shape is None
                             or [int(d) for d in bias.shape] != [n]):
        return None
    return n


def apply(model: ir.Model, split: Split) -> ir.Model:
    """Rule 1's rewrite of ``model`` (any batch: the node is found by name)."""
    proto = ir.serde.serialize_model(model)
    g = proto.graph
    i = next(k for k, n in enumerate(g.node) if (n.name or n.output[0]) == split.node)
    node = g.node[i]
    trans_b = any(a.name == "transB" and a.i for a in node.attribute)
    inits = {t.name: t for t in g.initializer}
    names = [[], []]
    for pos, name in enumerate(node.input[1:3], start=1):
        if not name:
            continue
        arr = numpy_helper.to_array(inits[name])
        axis = 0 if pos == 1 and trans_b else arr.ndim - 1
        for k, part in enumerate(np.split(arr, [split.columns], axis=axis)):
            names[k].append(f"{name}.part{k}")
            g.initializer.append(numpy_helper.from_array(np.ascontiguousarray(part), f"{name}.part{k}"))
        g.initializer.remove(inits[name])
    out = node.output[0]
    info = {v.name: v for v in list(g.value_info) + list(g.output)}[out]
    dims = [d.dim_value for d in info.type.tensor_type.shape.dim]
    parts = []
    for k, cols in enumerate((split.columns, dims[-1] - split.columns)):
        part = onnx.NodeProto()
        part.CopyFrom(node)
        del part.input[:]
        part.input.extend([node.input[0]] + names[k])
        part.output[0] = f"{out}.part{k}"
        part.name = f"{split.node}.part{k}"
        parts.append(part)
        g.value_info.append(helper.make_tensor_value_info(part.output[0], info.type.tensor_type.elem_type,
                                                          dims[:-1] + [cols]))
    concat = helper.make_node("Concat", [p.output[0] for p in parts], [out], name=f"{split.node}.concat", axis=-1)
    del g.node[i]
    for k, n in enumerate(parts + [concat]):
        g.node.insert(i + k, n)
    return ir.serde.deserialize_model(proto)


def shifted(ends: Sequence[int], split: Split) -> list[int]:
    """Rule 2: the cut after the first part; later stages' ends move by the two new nodes."""
    return list(ends[:-2]) + [split.index] + [e + 2 for e in ends[-1:]]


def parts_of(model: ir.Model, split: Split) -> dict[str, tuple[str, int, int]]:
    """Rule 4: each part's weight name -> (the original name, the axis it was cut on, part0's width)."""
    node = next(n for n in model.graph if n.name == f"{split.node}.part0")
    trans_b = node.attributes.get("transB") is not None and node.attributes["transB"].value
    out = {}
    for pos, v in enumerate(node.inputs[1:3], start=1):
        if v is None:
            continue
        orig = v.name[:-len(".part0")]
        axis = 0 if pos == 1 and trans_b else len(v.shape) - 1
        out.update({f"{orig}.part{k}": (orig, axis, split.columns) for k in (0, 1)})
    return out


def renamed(trainable: Sequence[str], parts: Mapping[str, tuple[str, int, int]]) -> list[str]:
    """The trainable names with each split weight replaced by its parts."""
    by_orig: dict[str, list[str]] = {}
    for p, (orig, _, _) in parts.items():
        by_orig.setdefault(orig, []).append(p)
    return [q for w in trainable for q in by_orig.get(w, [w])]


def _owner(name: str, originals: Sequence[str]) -> tuple[str, str] | None:
    """(original weight, state suffix) when ``name`` is the state of a split weight."""
    for o in originals:
        if name == o or name.startswith(o + "."):
            return o, name[len(o):]
    return None


def split_state(parts: Mapping[str, tuple[str, int, int]], state: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Rule 4: a state with 1-rank names cut into the parts' state."""
    if not parts:
        return dict(state)
    originals = sorted({o for o, _, _ in parts.values()}, key=len, reverse=True)
    axes = {o: (a, c) for o, a, c in parts.values()}
    out = {}
    for name, arr in state.items():
        hit = _owner(name, originals)
        if hit is None or np.ndim(arr) == 0:
            out[name] = arr
            continue
        o, suffix = hit
        axis, columns = axes[o]
        for k, piece in enumerate(np.split(np.asarray(arr), [columns], axis=axis)):
            out[f"{o}.part{k}{suffix}"] = np.ascontiguousarray(piece)
    return out


def join_state(parts: Mapping[str, tuple[str, int, int]], state: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Rule 4: the parts' state concatenated back under the 1-rank names."""
    if not parts:
        return dict(state)
    part0 = sorted((p for p in parts if p.endswith(".part0")), key=len, reverse=True)
    out, pending = {}, {}
    for name, arr in state.items():
        hit = _owner(name, part0) or _owner(name, [p[:-1] + "1" for p in part0])
        if hit is None:
            out[name] = arr
            continue
        p, suffix = hit
        orig, axis, _ = parts[p]
        pending.setdefault((orig, suffix, axis), {})[p.endswith("1")] = arr
    for (orig, suffix, axis), halves in pending.items():
        out[orig + suffix] = np.concatenate([halves[False], halves[True]], axis=axis)
    return out
