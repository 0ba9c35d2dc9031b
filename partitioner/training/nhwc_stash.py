"""A TVM pipeline stage's stashed conv-side activations kept in NHWC between ``F`` and ``B``.

TVM's ConvertLayout runs every conv2d in NHWC (``backends/tvm/pipeline.py`` phase 2), so inside
a stage's ``F`` the activations around its convolutions are NHWC. A program's outputs keep the
ONNX model's layout, so every stashed 4-d activation ``F`` returns costs a ``transpose`` kernel
to NCHW on every call, and ``B``, converting its own convolutions, transposes it back (measured,
session 16, the zoo resnet-18's stage 0 at 2 images: 451 ``transpose`` calls a step against 71
in the 1-rank step, whose activations never leave its one program; 17 a call of ``F``).

Rules:

1. TVM plans only, stages before the last (the last runs one fused program: nothing stashed),
   not with recompute (pipeline rule 8: the stash is then only the stage's inputs). A stashed
   value is *rewritten* when ``F`` makes it (not a program input: the data and the received
   values come in NCHW), it is a 4-d float tensor, it is not a value the stage sends (the message
   keeps the model's layout), no deferred weight-gradient program reads it (pipeline rule 10's
   ``w_stash``, concatenated on its batch axis in the rank) and no op of :data:`LAYOUT_BOUND`
   reads it in ``B`` (the weight gradient's im2col pads and slices its input in NCHW: with that
   input NHWC, TVM fused the transpose into the im2col kernel, which ran 72.7 ms a step against
   58.5 for the NCHW one on the resnet's stage 0, more than all of ``F``'s transposes).
2. ``F`` returns ``<v>.nhwc = Transpose(v, [0, 2, 3, 1])`` in place of ``v``; ``B`` takes
   ``<v>.nhwc`` as its input and starts with ``v = Transpose(<v>.nhwc, [0, 3, 1, 2])``; the
   stage's ``stash`` names ``<v>.nhwc`` (same position). The ONNX programs compute the same
   values (two exact transposes); TVM's ConvertLayout turns each of those transposes into the
   identity against its own NHWC permute where the value is NHWC inside the program, and where a
   consumer in ``B`` stays NCHW (the weight gradient's im2col) the transpose fuses into that
   consumer's injective kernel.
3. Cost: none in memory (the same bytes, another order); the rank's runner passes stash values
   by name, so nothing else changes.
4. Measured (session 17, docs/training.md "Session 17 (the NHWC stash)"): on the zoo resnet's
   stage 0 at 2 images ``F``'s transpose kernels drop (681 -> 425 calls a step, 29.5 -> 14.7 ms)
   but ``B``'s grow more (425 -> 785 calls, layout 82.3 -> 99.1 ms): outside its convolutions
   ``B`` runs in NCHW (the BatchNormalization gradient's products and reductions, the im2col),
   so TVM transposes the NHWC stash back there, once per reading kernel. Kernels 460.8 against
   453.6 ms a step; stage 0 alone, paired, 16 rounds: on 409.8 / off 400.6 ms, off faster in 8
   (without rule 1's im2col condition: 422.1 / 419.7, on faster in 7). Hence off.

5. (session 18) A ``B`` op ``Transpose(v, [0, 2, 3, 1])`` (the NHWC im2col of a conv weight
   gradient, ``rules/linear.py`` rule "NHWC im2col") does not make ``v`` layout-bound: it reads
   ``v`` in NHWC, so it becomes ``Identity(<v>.nhwc)`` and the im2col reads the stash as ``F``
   wrote it.

Knob :data:`NHWC_STASH`, default off (env ``PARTITIONER_TRAIN_NHWC_STASH=1`` turns it on, in MPI
ranks too): see rule 4.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import onnx
from onnx import helper

if TYPE_CHECKING:
    from partitioner.training.pipeline import Stage

#: rules 1-2 on TVM plans (off: ``F`` returns its stash in the model's NCHW layout). Default OFF:
#: no paired win (rule 4); ``PARTITIONER_TRAIN_NHWC_STASH=1`` turns it on (in MPI ranks too)
NHWC_STASH = os.environ.get("PARTITIONER_TRAIN_NHWC_STASH", "0") == "1"
SUFFIX = ".nhwc"
#: rule 1: ``B`` ops that read a value in the model's layout whatever TVM does around them (the
#: weight gradient's im2col: Pad, Slice, then Concat / Reshape); a value one of them reads stays NCHW
LAYOUT_BOUND = frozenset({"Pad", "Slice", "Reshape", "Flatten", "Concat", "Gather", "Transpose", "Split"})
TO_NHWC = [0, 2, 3, 1]
TO_NCHW = [0, 3, 1, 2]


def _info(program: onnx.ModelProto, name: str) -> onnx.ValueInfoProto | None:
    g = program.graph
    return next((vi for vi in list(g.output) + list(g.value_info) + list(g.input) if vi.name == name), None)


def _float4d(info: onnx.ValueInfoProto | None) -> bool:
    if info is None:
        return False
    t = info.type.tensor_type
    return t.elem_type == onnx.TensorProto.FLOAT and len(t.shape.dim) == 4 \
        and all(d.HasField("dim_value") for d in t.shape.dim)


def _permuted(info: onnx.ValueInfoProto, name: str, perm: list[int]) -> onnx.ValueInfoProto:
    dims = [info.type.tensor_type.shape.dim[p].dim_value for p in perm]
    return helper.make_tensor_value_info(name, info.type.tensor_type.elem_type, dims)


def rewritten(stage: Stage) -> list[str]:
    """Rule 1: the stash values of ``stage`` (a :class:`~partitioner.training.pipeline.Stage`
    with its ``F`` and ``B``) that go NHWC."""
    fwd = stage.forward
    if fwd is None or stage.backward is None:
        return []
    f_inputs = {i.name for i in fwd.graph.input}
    made = {o for n in fwd.graph.node for o in n.output}
    sent = {v for _, v in stage.send} | {b for _, b in stage.bn_state}
    skip = f_inputs | sent | set(stage.w_stash)
    skip |= {i for n in stage.backward.graph.node if n.op_type in LAYOUT_BOUND and not _to_nhwc(n) for i in n.input}
    return [v for v in stage.stash if v in made and v not in skip
            and _float4d(_info(fwd, v))]


def apply(stage: Stage) -> list[str]:
    """Rule 2 on ``stage`` in place; returns the rewritten values' original names."""
    values = rewritten(stage)
    if not values:
        return []
    fwd, bwd = stage.forward, stage.backward
    outs = {o.name: k for k, o in enumerate(fwd.graph.output)}
    for v in values:
        info = _renamed(fwd.graph.output[outs[v]], v)  # a copy: the output entry is replaced below
        fwd.graph.node.append(helper.make_node("Transpose", [v], [v + SUFFIX], perm=TO_NHWC, name=f"{v}{SUFFIX}.node"))
        fwd.graph.output[outs[v]].CopyFrom(_permuted(info, v + SUFFIX, TO_NHWC))
        fwd.graph.value_info.append(info)
    b_inputs = {i.name: k for k, i in enumerate(bwd.graph.input)}
    front = []
    for v in values:
        info = bwd.graph.input[b_inputs[v]]
        nchw = _renamed(info, v)
        bwd.graph.input[b_inputs[v]].CopyFrom(_permuted(info, v + SUFFIX, TO_NHWC))
        bwd.graph.value_info.append(nchw)
        front.append(helper.make_node("Transpose", [v + SUFFIX], [v], perm=TO_NCHW, name=f"{v}{SUFFIX}.nchw.node"))
    names = set(values)
    nodes = front + [_folded(n, names) for n in bwd.graph.node]
    del bwd.graph.node[:]
    bwd.graph.node.extend(nodes)
    stage.stash = [v + SUFFIX if v in names else v for v in stage.stash]
    return values


def _to_nhwc(node: onnx.NodeProto) -> bool:
    """Rule 5: ``Transpose(v, [0, 2, 3, 1])`` (the NHWC im2col's first op, ``rules/linear.py``)."""
    return node.op_type == "Transpose" and any(a.name == "perm" and list(a.ints) == TO_NHWC for a in node.attribute)


def _folded(node: onnx.NodeProto, names: set[str]) -> onnx.NodeProto:
    """Rule 5: a ``B`` node ``Transpose(v, [0, 2, 3, 1])`` of a rewritten ``v`` becomes
    ``Identity(<v>.nhwc)`` (the two transposes cancel; TVM need not see through them)."""
    if not (_to_nhwc(node) and node.input[0] in names):
        return node
    return helper.make_node("Identity", [node.input[0] + SUFFIX], list(node.output), name=node.name)


def _renamed(info: onnx.ValueInfoProto, name: str) -> onnx.ValueInfoProto:
    out = onnx.ValueInfoProto()
    out.CopyFrom(info)
    out.name = name
    return out
