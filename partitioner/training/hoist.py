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
4. TVM plans only. A convolution's input gradient is ``ConvTranspose(dY, W)``; TVM's
   conv2d_transpose transforms ``W`` on every call and runs far below its conv2d (measured, the
   zoo resnet's last stage at micro-batch 2, one thread: ``fused_conv2d_transpose*`` 381 of 648
   ms of kernels per step, 10-15 ms a call for layer4's 3x3 512-channel ones, whose forward
   conv2d takes about 0.5 ms, plus a 5.5 ms ``transpose`` of the 9 MiB weight per call, 133 ms
   per step). With stride 1, dilation 1 and one group it equals
   ``Conv(dY, flip(transpose(W, [1, 0, 2, 3])), pads = k - 1 - p)``, so it is rewritten to that
   and rule 1 hoists the weight's transpose and flip. With equal strides ``s > 1`` (resnet's
   downsampling convs' input gradients: 3x3 pads 1 and 1x1 pads 0, output padding 1) it is
   rewritten to its *phase form* (knob :data:`STRIDED_CONV_TRANSPOSE_AS_CONV`): output row
   ``o = q*s + r`` sums ``dY[q + d] * W[r + pad - d*s]`` over the ``d`` with a tap, so one stride-1
   ``Conv(dY, W_phase)`` with ``C*s*s`` output channels (a 3x3 kernel at stride 2: 2x2 taps, 16
   multiply-adds per output quad against the 9 the ConvTranspose needs) followed by
   ``DepthToSpace(s, CRD)`` (and a Slice when the output is not a multiple of ``s``) computes it;
   ``W_phase`` is a Gather of ``W`` with zeros where a phase has no tap, weight-only, so rule 1
   hoists it. Measured (``benchmarks/strided_conv_transpose.py``, the six strided input gradients
   of the zoo resnet-18 at 64x64, one TVM program per form, 21 interleaved rounds, thread CPU
   medians, load 4.6-6.2): batch 16 conv2d_transpose 37.6 ms, phase form with its weight made in
   the program 23.5 ms, zero-inserted ``dY`` then a stride-1 Conv 26.9 ms (4x the multiply-adds);
   at batch 2 (a pipeline micro-batch) 8.2 / 13.5 / 7.8 ms: there TVM's per-call transpose of the
   weight to HWIO (ConvertLayout, a weight given as an input) costs more than the convolutions,
   which rule 5 removes in pipeline stages.
   A constant filter takes the same forms (knob :data:`CONSTANT_FILTERS`; TVM folds its weight
   preparation at build time): MaxPool's gradient scatters the routed gradient with a stride-2
   ConvTranspose of a one-hot constant (``training/rules/pooling.py``); the zoo resnet's stem
   pool at batch 16 (``[1024, 9, 16, 16]`` -> ``[1024, 1, 34, 34]``) ran 147.8 ms a step as TVM's
   conv2d_transpose, 21.9 ms in the phase form (9 interleaved calls, thread CPU, load 9.1).
5. TVM plans only. TVM's ConvertLayout gives every conv2d HWIO weights, so a Conv whose weight
   is a program input (a stage weight, or a value rules 1-4 hoist) gets a ``permute_dims`` of
   that weight on every call, in TVM's generic transpose kernel (measured, the hoisted phase-form
   weights of resnet's six strided input gradients at micro-batch 2: 12.2 of 15.5 ms of kernels
   per call). Such a Conv's weight ``V`` is rewritten to ``Transpose(Transpose(V, HWIO), OIHW)``:
   rule 1 hoists the inner one, and TVM cancels the outer one against its own HWIO permute (the
   same six: 4.6 ms of kernels per call, against 7.2 ms for conv2d_transpose).
7. TVM plans only. What no ONNX rewrite reaches, TVM's own weight-only kernels inside a program
   (the conv schedule's panel packing of a weight given as an input,
   ``schedules/contraction._pack_conv_weights``, and the transposes ConvertLayout wraps around
   it), runs on every call too (measured, the zoo resnet's last stage at micro-batch 2: 52 of 192
   ms of kernels per step re-packing conv weights). Each per-micro-batch program therefore names
   its stage weights and hoisted values as *step constants* (knob :data:`LIFT_STEP_CONSTANTS`;
   ``backends/tvm/lift_step_constants.py``): the build lifts every kernel computed from them
   alone into ``main_transform_params``, which the executable reruns only when one of them was
   copied in anew (once per step: the runner's weights are read-only, executable rule 8). Only
   values of at least :data:`LIFT_MIN_BYTES` (an L2) are named: a smaller weight packed right
   before its conv is read back from L2, while its lifted copy comes from memory on every call
   (the zoo resnet's stage 0, layer1-2 weights of 0.15-0.6 MiB, lifting all: 285.7 -> 312.2 ms
   per step in one paired run at load 3, 337.7 -> 308.5 in another at load 5; its last stage's
   layer3-4 weights of 2.4-9.4 MiB: 216.7 -> 213.0 and 207.9 -> 190.7). With the bound (one
   paired run, 5 rounds, load 3.6-3.0): 320.3 / 208.2 -> 295.6 / 191.4 ms against a 376.7 ms
   1-rank step (the 1F1B bound 1.05x -> 1.13x).
8. TVM plans only, with rule 7. A weight rule 7 lifts (at least :data:`LIFT_MIN_BYTES`, a stage
   weight the program reads) gets neither rule 5's HWIO pair nor rule 4's hoisted transpose and
   flip (stride 1; the phase form's gather is no permutation and stays hoisted) (knob
   :data:`LIFTED_WEIGHTS_IN_PACK`): its Conv reads the weight (or ``flip(W^T)`` computed in the
   program, its nodes named ``*.in_pack.node``, which rule 1 never hoists), so TVM's own OIHW -> HWIO
   permute (and the flip) fold into the weight's panel pack
   (``backends/tvm/fold_weight_packs.py``, the 1-rank step's ``fused_transpose_weight_prepack``)
   and rule 7 lifts that one pass. With rules 4-5 ``P`` transposed (and flipped) the weight and
   the lifted transform packed the result: two passes over each such weight a step (measured,
   session 16, the zoo resnet's stage 1 at 2 images: ``P`` 24-45 ms a step plus 12.6 ms of
   packs, against 15.3 ms for the same packs on the 1-rank step). Smaller weights keep rules
   4-5: their packs run per call, next to the conv, from the hoisted HWIO value. Measured
   (session 17, the zoo resnet at 2-image micro-batches, cut after layer3.0.conv1.relu, thread
   CPU; docs/training.md "Session 17 (lifted weights packed in one pass)"): stage 1 alone,
   paired against the knob off, 371.5 / 397.0 ms a step, median paired difference -22.9 ms,
   faster in 14 of 16 rounds (load 2.9 -> 5.3); its kernels: ``P`` 39.5 -> 7.3 ms a step, the
   lifted packs 27.6 -> 31.4. On by default.
6. Cost: each hoisted value is alive for the whole step (a weight-sized buffer per transposed
   weight), one more program call per step; the arithmetic is once per step instead of ``M``
   times. With ``M = 1`` nothing is hoisted (nothing to save).

Invariant: the per-micro-batch programs compute the same values as before: rules 1-3 move
exact transposes (bit for bit on the same backend), and so do rule 5's pairs; rule 4's Convs
sum the same products in another order (float rounding only; the tests hold the TVM step and
pipeline to ONNX Runtime's 1-rank step at rtol 1e-4).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np
import onnx
from onnx import helper, numpy_helper

from backends.tvm.lift_step_constants import mark_step_constants

#: rules 1-2 on (module constant; off: every program recomputes its weight-only nodes per micro-batch)
HOIST_WEIGHT_NODES = True
#: rule 5 (module constant; off: a stage's Conv weights are permuted to HWIO by TVM on every call)
HWIO_CONV_WEIGHTS = True
#: rule 7 (module constant; off: TVM packs a stage's conv weights inside the program on every call);
#: the environment's ``PARTITIONER_TRAIN_LIFT_STEP_CONSTANTS=0`` turns it off in MPI ranks too
LIFT_STEP_CONSTANTS = os.environ.get("PARTITIONER_TRAIN_LIFT_STEP_CONSTANTS", "1") != "0"
#: rule 7: only values of at least this many bytes (one core's L2, Zen 4: 1 MiB); 0: every one
LIFT_MIN_BYTES = 1 << 20
#: rule 4 on constant filters as well as weights (module constant; off: weights only)
CONSTANT_FILTERS = True
#: rule 4's phase form for strided ConvTransposes, used by 1-rank, data-parallel and pipeline TVM
#: steps (module constant; off: they stay TVM's conv2d_transpose)
STRIDED_CONV_TRANSPOSE_AS_CONV = True
RANDOM_OPS = frozenset({"Dropout", "RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike",
                        "Bernoulli", "Multinomial"})
PREFIX = "hoist."
STAYS = ".oihw.node"  # rule 5: the per-micro-batch transpose back, never hoisted
IN_PACK = ".in_pack.node"  # rule 8: a lifted weight's rule-4 transpose and flip, never hoisted
#: rule 8 (off: rules 4-5 hoist the transpose / flip of every weight, lifted or not, into ``P``);
#: the environment's ``PARTITIONER_TRAIN_LIFTED_WEIGHTS_IN_PACK=0`` turns it off in MPI ranks too
LIFTED_WEIGHTS_IN_PACK = os.environ.get("PARTITIONER_TRAIN_LIFTED_WEIGHTS_IN_PACK", "1") != "0"


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


def _ints(node: onnx.NodeProto, name: str) -> list[int] | None:
    return next((list(a.ints) for a in node.attribute if a.name == name), None)


def _plain_conv_transpose(n: onnx.NodeProto, w_shape: list[int]) -> bool:
    """Rule 4's cases: 2-d, dilation 1, one group, no output shape, explicit pads; stride 1 (no
    output padding), or equal strides s > 1 without a bias (rule 4's phase form)."""
    if len(w_shape) != 4 or _attr(n, "group", 1) != 1 or any(a.name in ("output_shape",) for a in n.attribute):
        return False
    if next((a.s for a in n.attribute if a.name == "auto_pad"), b"NOTSET") not in (b"NOTSET", b""):
        return False
    strides = _ints(n, "strides") or [1, 1]
    kernel = _ints(n, "kernel_shape") or w_shape[2:]
    if not all(v == 1 for v in (_ints(n, "dilations") or [1])) or kernel != w_shape[2:]:
        return False
    if strides == [1, 1]:
        return not any(_ints(n, "output_padding") or [])
    return STRIDED_CONV_TRANSPOSE_AS_CONV and strides[0] == strides[1] > 1 \
        and (len(n.input) < 3 or not n.input[2])


def _phase_taps(k: int, s: int, lo: int, hi: int, extra: int) -> tuple[list[list[int]], list[int], int] | None:
    """Rule 4's phase form along one axis of a stride-``s`` ConvTranspose (kernel ``k``, pads
    ``lo``/``hi``, output padding ``extra``): output ``o = q*s + r`` sums ``dY[q + d] W[r + lo - d*s]``
    over the ``d`` with a tap in ``[0, k)``. Returns, per phase ``r``, the kernel index of each
    conv tap ``d_min + j`` (``-1``: no tap, a zero), the Conv pads ``[-d_min, (Q - H) + d_max]``
    (``Q = ceil(H_out / s)``, ``Q - H`` does not depend on ``H``) and the rows to crop at the end
    (``Q*s - H_out``); None when a Conv pad would be negative."""
    d_min, d_max = -((k - 1 - lo) // s), (s - 1 + lo) // s
    q_minus_h = -(-(extra + k - lo - hi) // s) - 1
    pads = [-d_min, q_minus_h + d_max]
    if min(pads) < 0:
        return None
    taps = [[r + lo - d * s if 0 <= r + lo - d * s < k else -1 for d in range(d_min, d_max + 1)] for r in range(s)]
    return taps, pads, (-(extra + k - lo - hi - s)) % s


def _strided_as_conv(g: onnx.GraphProto, n: onnx.NodeProto, w_shape: list[int],
                     tag: str) -> list[onnx.NodeProto] | None:
    """Rule 4, stride ``s > 1``: the nodes of ``DepthToSpace(Conv(dY, W_phase), s)`` (cropped), or None.

    ``W_phase[(c, ry, rx), m, jy, jx] = W[m, c, ky(ry, jy), kx(rx, jx)]`` (0 where no tap) is one
    Gather of the flattened, zero-padded weight, then a Transpose and Reshape: weight-only, so
    rule 1 hoists it out of a pipeline stage's micro-batches."""
    m, c, kh, kw = w_shape
    s = (_ints(n, "strides") or [1, 1])[0]
    pads = _ints(n, "pads") or [0, 0, 0, 0]
    extra = _ints(n, "output_padding") or [0, 0]
    axes = [_phase_taps(k, s, pads[i], pads[i + 2], extra[i]) for i, k in enumerate((kh, kw))]
    if None in axes:
        return None
    (ty, py, cy), (tx, px, cx) = axes
    index = np.array([[[[a * kw + b if a >= 0 and b >= 0 else kh * kw for b in tx[rx]] for a in ty[ry]]
                       for rx in range(s)] for ry in range(s)], np.int64)  # [s, s, Ty, Tx]
    consts = {f"{tag}.flat": [m, c, kh * kw], f"{tag}.zero": [0, 0, 0, 0, 0, 1],
              f"{tag}.shape": [c * s * s, m, index.shape[2], index.shape[3]]}
    for name, vals in consts.items():
        g.initializer.append(helper.make_tensor(name, onnx.TensorProto.INT64, [len(vals)], vals))
    g.initializer.append(numpy_helper.from_array(index, f"{tag}.index"))
    w = n.input[1]
    out = [helper.make_node("Reshape", [w, f"{tag}.flat"], [f"{tag}.w3"], name=f"{tag}.w3.node"),
           helper.make_node("Pad", [f"{tag}.w3", f"{tag}.zero"], [f"{tag}.wz"], name=f"{tag}.wz.node"),
           helper.make_node("Gather", [f"{tag}.wz", f"{tag}.index"], [f"{tag}.w6"], axis=2, name=f"{tag}.w6.node"),
           helper.make_node("Transpose", [f"{tag}.w6"], [f"{tag}.wt"], perm=[1, 2, 3, 0, 4, 5], name=f"{tag}.wt.node"),
           helper.make_node("Reshape", [f"{tag}.wt", f"{tag}.shape"], [tag], name=f"{tag}.node"),
           helper.make_node("Conv", [n.input[0], tag], [f"{tag}.phases"], name=f"{n.name}.phases",
                            kernel_shape=list(index.shape[2:]), pads=[py[0], px[0], py[1], px[1]])]
    d2s = list(n.output) if not (cy or cx) else [f"{tag}.uncropped"]
    out.append(helper.make_node("DepthToSpace", [f"{tag}.phases"], d2s, blocksize=s, mode="CRD", name=n.name))
    if cy or cx:  # H_out is not a multiple of s: the last phase rows are past the output
        ends = f"{tag}.ends"
        g.initializer.extend([helper.make_tensor(f"{tag}.starts", onnx.TensorProto.INT64, [2], [0, 0]),
                              helper.make_tensor(ends, onnx.TensorProto.INT64, [2], [-cy or 2**62, -cx or 2**62]),
                              helper.make_tensor(f"{tag}.axes", onnx.TensorProto.INT64, [2], [2, 3])])
        out.append(helper.make_node("Slice", [d2s[0], f"{tag}.starts", ends, f"{tag}.axes"], list(n.output),
                                    name=f"{n.name}.crop"))
    return out


def conv_transpose_as_conv(model: onnx.ModelProto, weights: set[str], in_pack: frozenset[str] = frozenset()) -> None:
    """Rule 4: ``ConvTranspose(dY, W, pads=p)`` of a weight -> ``Conv(dY, flip(W^T), pads=k-1-p)``
    (stride 1) or its phase form (equal strides s > 1, :func:`_strided_as_conv`); for a weight of
    ``in_pack`` (rule 8) the stride-1 transpose and flip are named to stay in the program."""
    g = model.graph
    shapes = {vi.name: [d.dim_value for d in vi.type.tensor_type.shape.dim] for vi in g.input}
    if CONSTANT_FILTERS:  # rule 4 on constant filters too (MaxPool's gradient scatter)
        shapes.update({t.name: list(t.dims) for t in g.initializer})
        weights = set(weights) | {t.name for t in g.initializer}
    nodes: list[onnx.NodeProto] = []
    flip = None
    for n in g.node:
        w = n.input[1] if n.op_type == "ConvTranspose" and len(n.input) > 1 else ""
        if w not in weights or not _plain_conv_transpose(n, shapes[w]):
            nodes.append(n)
            continue
        if (_ints(n, "strides") or [1])[0] > 1:
            nodes.extend(_strided_as_conv(g, n, shapes[w], f"{w}.phase.{len(nodes)}") or [n])
            continue
        k = shapes[w][2:]
        pads = _ints(n, "pads") or [0, 0, 0, 0]
        conv_pads = [k[0] - 1 - pads[0], k[1] - 1 - pads[1], k[0] - 1 - pads[2], k[1] - 1 - pads[3]]
        if min(conv_pads) < 0:
            nodes.append(n)
            continue
        if flip is None:  # Slice(starts=-1, ends=-huge, steps=-1) on the kernel axes: the spatial flip
            flip = [f"{PREFIX}flip.{k}" for k in ("starts", "ends", "axes", "steps")]
            for name, vals in zip(flip, ([-1, -1], [-2**62, -2**62], [2, 3], [-1, -1])):
                g.initializer.append(helper.make_tensor(name, onnx.TensorProto.INT64, [2], vals))
        t = f"{w}.convT.{len(nodes)}"
        end = IN_PACK if w in in_pack else ".node"
        nodes.append(helper.make_node("Transpose", [w], [f"{t}.swap"], perm=[1, 0, 2, 3], name=f"{t}.swap{end}"))
        nodes.append(helper.make_node("Slice", [f"{t}.swap", *flip], [t], name=f"{t}{end}"))
        nodes.append(helper.make_node("Conv", [n.input[0], t, *n.input[2:]], list(n.output), name=n.name,
                                      kernel_shape=k, pads=conv_pads, strides=[1, 1], dilations=[1, 1], group=1))
    del g.node[:]
    g.node.extend(nodes)


def conv_weights_hwio(model: onnx.ModelProto, weights: set[str], in_pack: frozenset[str] = frozenset()) -> None:
    """Rule 5: ``Conv(x, V)`` with ``V`` weight-only -> ``Conv(x, Transpose(Transpose(V, HWIO), OIHW))``;
    not where ``V`` is a weight of ``in_pack`` or made from one by rule 8's nodes (rule 8)."""
    g = model.graph
    inits = {t.name for t in g.initializer}
    ranks = {vi.name: len(vi.type.tensor_type.shape.dim) for vi in g.input}
    derived = set(weights)  # rule 1's weight-only values, in program order
    packed = set(in_pack) | {o for n in g.node if n.name.endswith(IN_PACK) for o in n.output}
    nodes: list[onnx.NodeProto] = []
    for n in g.node:
        w = n.input[1] if n.op_type == "Conv" and len(n.input) > 1 else ""
        if w in derived and w not in packed and (len(_ints(n, "kernel_shape") or []) or ranks.get(w, 0) - 2) == 2:
            hwio = f"{w}.hwio.{len(nodes)}"
            nodes.append(helper.make_node("Transpose", [w], [hwio], perm=[2, 3, 1, 0], name=f"{hwio}.node"))
            nodes.append(helper.make_node("Transpose", [hwio], [f"{hwio}.oihw"], perm=[3, 2, 0, 1],
                                          name=f"{hwio}{STAYS}"))
            n.input[1] = f"{hwio}.oihw"
        present = [i for i in n.input if i]
        if n.op_type not in RANDOM_OPS and present and all(i in derived or i in inits for i in present) \
                and any(i in derived for i in present):
            derived.update(n.output)
        nodes.append(n)
    del g.node[:]
    g.node.extend(nodes)


def _bytes(info: onnx.ValueInfoProto) -> int:
    t = info.type.tensor_type
    return int(np.prod([d.dim_value for d in t.shape.dim])) * helper.tensor_dtype_to_np_dtype(t.elem_type).itemsize


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
        if n.op_type in RANDOM_OPS or not n.output or any(o in returned for o in n.output) \
                or n.name.endswith(STAYS) or n.name.endswith(IN_PACK):  # rules 5 and 8: TVM cancels / folds them
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


def _lifted_weights(programs: Sequence[onnx.ModelProto], weights: set[str]) -> frozenset[str]:
    """Rule 8: the stage weights rule 7 will lift (the programs' weight inputs of at least
    :data:`LIFT_MIN_BYTES`); empty with either knob off."""
    if not (LIFTED_WEIGHTS_IN_PACK and LIFT_STEP_CONSTANTS):
        return frozenset()
    return frozenset(v.name for p in programs for v in p.graph.input if v.name in weights and _bytes(v) >= LIFT_MIN_BYTES)


def hoist_stage_programs(name: str, programs: Sequence[onnx.ModelProto | None], weights: Sequence[str], *,
                         micro_batches: int, backend: str) -> tuple[list[onnx.ModelProto | None], onnx.ModelProto | None]:
    """Rules 1-5, 7 and 8 on one stage: its per-micro-batch programs rewritten, and the ``prepare`` program
    ``<name>.prepare`` (None when nothing is hoisted, ``micro_batches`` is 1, ``backend`` is not
    TVM or :data:`HOIST_WEIGHT_NODES` is off)."""
    present = [p for p in programs if p is not None]
    if not HOIST_WEIGHT_NODES or backend != "tvm" or micro_batches < 2 or not present or not weights:
        return list(programs), None
    hoister = _Hoister(set(weights))
    in_pack = _lifted_weights(present, hoister.weights)
    out: list[onnx.ModelProto | None] = []
    for p in programs:
        if p is None:
            out.append(None)
            continue
        model = onnx.ModelProto()
        model.CopyFrom(p)
        _transpose_gemm_weights(model, hoister.weights)
        conv_transpose_as_conv(model, hoister.weights, in_pack)
        if HWIO_CONV_WEIGHTS:
            conv_weights_hwio(model, hoister.weights, in_pack)
        model = hoister.program(model)
        if LIFT_STEP_CONSTANTS:  # rule 7
            mark_step_constants(model, [v.name for v in model.graph.input if _bytes(v) >= LIFT_MIN_BYTES
                                        and (v.name in hoister.weights or v.name.startswith(PREFIX))])
        out.append(model)
    first = present[0]
    return out, hoister.prepare(name, first.opset_import, first.ir_version)
