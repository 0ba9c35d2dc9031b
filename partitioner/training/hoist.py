"""Weight-only work hoisted out of a pipeline stage's micro-batch loop (loop-invariant code motion).

A pipeline stage calls its ``F`` and ``B`` (or fused) programs once per micro-batch, with the same
weights every time: the update runs once per step, after the last micro-batch
(:mod:`partitioner.training.pipeline` rule 4). Whatever those programs compute from the weights
alone is therefore computed ``M`` times a step for one value.

Rules:

1. A node of a per-micro-batch program is *weight-only* when every input is one of the stage's
   trainable weights, a constant of the program (an initializer) or the output of a weight-only
   node, and at least one weight is among its ancestors (constant-only nodes are the backend's
   constant folding). Random ops (Dropout, Random*, Bernoulli) never are: each call draws anew.
   A node whose output the program returns stays (the program must still produce it).
2. The weight-only nodes of all per-micro-batch programs of a stage move into one ``prepare``
   program (its inputs: the weights they read; its outputs: the values the remaining nodes read),
   run once per step before the first micro-batch; the per-micro-batch programs take those
   values as inputs. Identical nodes (same op, inputs and attributes) across ``F``, ``B`` and
   the fused program share one output, named ``hoist.<k>``.
3. TVM plans only. TVM lowers ``Gemm(A, W, transB=1)`` to a transpose of ``W`` materialised on
   every call, then the matmul (measured, the zoo mlp 4x1024 at micro-batch 128, one thread:
   4 ms per 1024x1024 weight, 64 of the last stage's 217 ms of kernels per step, against about
   45 ms for the matmuls those transposes feed); such a Gemm with a weight ``W`` is first
   rewritten to ``Gemm(A, Transpose(W))``, so rule 1 hoists the transpose, as it does the
   explicit weight transposes of the backward's MatMul rule. ONNX Runtime reads a transposed
   operand in place (Gemm's attributes; its MatmulTransposeFusion folds the backward's
   ``Transpose(W)`` into the MatMul), so on its plans hoisting only adds a step-long buffer:
   measured, the mlp 2048 wide with Adam, last stage's peak +80 MB through the shared arena's
   growth for one 16 MiB hoisted transpose. ONNX Runtime plans hoist nothing.
4. Cost: each hoisted value is alive for the whole step (a weight-sized buffer per transposed
   weight), one more program call per step; the arithmetic is once per step instead of ``M``
   times. With ``M = 1`` nothing is hoisted (nothing to save).

Invariant: the per-micro-batch programs compute the same values as before (a transpose is
exact), so a hoisted pipeline step equals the unhoisted one bit for bit on the same backend.
"""

from __future__ import annotations

from collections.abc import Sequence

import onnx
from onnx import helper

#: rules 1-2 on (module constant; off: every program recomputes its weight-only nodes per micro-batch)
HOIST_WEIGHT_NODES = True
RANDOM_OPS = frozenset({"Dropout", "RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike",
                        "Bernoulli", "Multinomial"})
PREFIX = "hoist."


def _attr(node: onnx.NodeProto, name: str, default: int = 0) -> int:
    return next((a.i for a in node.attribute if a.name == name), default)


def _transpose_gemm_weights(model: onnx.ModelProto, weights: set[str]) -> None:
    """Rule 3: ``Gemm(A, W, transB=1)`` -> ``Gemm(A, Transpose(W), transB=0)`` for weights ``W``."""
    g = model.graph
    nodes: list[onnx.NodeProto] = []
    for n in g.node:
        if n.op_type == "Gemm" and len(n.input) > 1 and n.input[1] in weights and _attr(n, "transB"):
            t = f"{n.input[1]}.T.{len(nodes)}"
            nodes.append(helper.make_node("Transpose", [n.input[1]], [t], perm=[1, 0], name=f"{t}.node"))
            n.input[1] = t
            kept = [a for a in n.attribute if a.name != "transB"]
            del n.attribute[:]
            n.attribute.extend(kept)
        nodes.append(n)
    del g.node[:]
    g.node.extend(nodes)


def _signature(node: onnx.NodeProto, inputs: list[str]) -> tuple:
    return (node.op_type, node.domain, tuple(inputs),
            tuple(sorted((a.name, a.SerializeToString()) for a in node.attribute)))


class _Hoister:
    """Rules 1-2 over a stage's per-micro-batch programs, sharing one ``prepare`` program."""

    def __init__(self, weights: set[str]) -> None:
        self.weights = weights
        self.nodes: list[onnx.NodeProto] = []  # the prepare program's nodes, in order
        self.by_sig: dict[tuple, list[str]] = {}
        self.infos: dict[str, onnx.ValueInfoProto] = {}
        self.constants: dict[str, onnx.TensorProto] = {}
        self.read: list[str] = []  # weights the prepare program reads
        self.outputs: list[str] = []

    def program(self, model: onnx.ModelProto) -> onnx.ModelProto:
        """``model`` with its weight-only nodes taken out (their values become inputs)."""
        model = onnx.shape_inference.infer_shapes(model)
        g = model.graph
        inits = {t.name: t for t in g.initializer}
        infos = {vi.name: vi for vi in list(g.value_info) + list(g.input) + list(g.output)}
        returned = {o.name for o in g.output}
        rename: dict[str, str] = {}  # a hoisted value -> its prepare program name
        keep = []
        for n in g.node:
            ins = [rename.get(i, i) for i in n.input]
            if not self._weight_only(n, ins, inits, returned) or any(o not in infos for o in n.output):
                keep.append(n)
                continue
            sig = _signature(n, ins)
            if sig not in self.by_sig:
                outs = [f"{PREFIX}{len(self.infos) + k}" for k in range(len(n.output))]
                self.by_sig[sig] = outs
                node = helper.make_node(n.op_type, ins, outs, domain=n.domain or None, name=f"{outs[0]}.node")
                node.attribute.extend(n.attribute)
                self.nodes.append(node)
                for o, new in zip(n.output, outs):
                    self.infos[new] = _renamed(infos[o], new)
                for i in n.input:
                    if i in self.weights and i not in self.read:
                        self.read.append(i)
                        self.infos[i] = infos[i]
                    elif i in inits:
                        self.constants[i] = inits[i]
            rename.update(zip(n.output, self.by_sig[sig]))
        used = [v for v in dict.fromkeys(rename.values()) if any(v in [rename.get(i, i) for i in n.input]
                                                                for n in keep)]
        if not used:
            return model
        self.outputs.extend(v for v in used if v not in self.outputs)
        for n in keep:
            for k, i in enumerate(n.input):
                n.input[k] = rename.get(i, i)
        del g.node[:]
        g.node.extend(keep)
        read = {i for n in keep for i in n.input}
        kept_inputs = [vi for vi in g.input if vi.name in read or vi.name in returned]
        del g.input[:]
        g.input.extend(kept_inputs + [self.infos[v] for v in used])
        kept_inits = [t for t in g.initializer if t.name in read]
        del g.initializer[:]
        g.initializer.extend(kept_inits)
        return model

    def _weight_only(self, n: onnx.NodeProto, ins: list[str], inits: dict[str, onnx.TensorProto],
                     returned: set[str]) -> bool:
        if n.op_type in RANDOM_OPS or not n.output or any(o in returned for o in n.output):
            return False
        present = [i for i in ins if i]
        return bool(present) and all(i in self.weights or i in inits or i.startswith(PREFIX) for i in present) \
            and any(i in self.weights or i.startswith(PREFIX) for i in present)

    def prepare(self, name: str, opsets: Sequence[onnx.OperatorSetIdProto], ir_version: int) -> onnx.ModelProto | None:
        if not self.outputs:
            return None
        g = helper.make_graph(self.nodes, f"{name}.prepare", [self.infos[w] for w in self.read],
                              [self.infos[v] for v in self.outputs], list(self.constants.values()))
        used = {i for n in self.nodes for i in n.input}
        g.value_info.extend(self.infos[v] for v in self.infos
                            if v.startswith(PREFIX) and v not in self.outputs and v in used)
        return helper.make_model(g, opset_imports=list(opsets), ir_version=ir_version)


def _renamed(info: onnx.ValueInfoProto, name: str) -> onnx.ValueInfoProto:
    out = onnx.ValueInfoProto()
    out.CopyFrom(info)
    out.name = name
    return out


def hoist_stage_programs(name: str, programs: Sequence[onnx.ModelProto | None], weights: Sequence[str], *,
                         micro_batches: int, backend: str) -> tuple[list[onnx.ModelProto | None], onnx.ModelProto | None]:
    """Rules 1-3 on one stage: its per-micro-batch programs rewritten, and the ``prepare`` program
    ``<name>.prepare`` (None when nothing is hoisted, ``micro_batches`` is 1, ``backend`` is not
    TVM or :data:`HOIST_WEIGHT_NODES` is off)."""
    present = [p for p in programs if p is not None]
    if not HOIST_WEIGHT_NODES or backend != "tvm" or micro_batches < 2 or not present or not weights:
        return list(programs), None
    hoister = _Hoister(set(weights))
    out: list[onnx.ModelProto | None] = []
    for p in programs:
        if p is None:
            out.append(None)
            continue
        model = onnx.ModelProto()
        model.CopyFrom(p)
        _transpose_gemm_weights(model, hoister.weights)
        out.append(hoister.program(model))
    first = present[0]
    return out, hoister.prepare(name, first.opset_import, first.ir_version)
