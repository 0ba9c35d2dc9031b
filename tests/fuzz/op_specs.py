"""The op-spec table the graph fuzzer draws from.

Each :class:`OpSpec` says which input shapes an operator accepts (``accepts``) and how to emit it
(``emit``): ``emit(draw, g, x)`` appends one or more nodes to the :class:`GraphBuilder` ``g``
that consume the value ``x`` (and possibly other earlier values), and returns the values it
produced. Every emitter computes the output shapes itself, so shapes are consistent by
construction; ``onnx.checker.check_model(full_check=True)`` (strict shape inference) confirms it.

Invariants kept by every emitter:
1. Axis 0 is the batch axis of the input. No op splits or concatenates axis 0; now and then
   (1 in 6) a Transpose moves it and a Reshape folds it into the rows ([B,S,F] -> [B*S,F]), as
   real models do, so the strategies must follow the batch or refuse.
2. Sizes stay small (every value has at most :data:`MAX_ELEMS_PER_SAMPLE` elements per sample).
3. Weights are seeded float32 scaled by ``1/sqrt(fan_in)``, so values stay O(1) through chains.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

Shape = tuple[int, ...]
MAX_ELEMS_PER_SAMPLE = 2048
OPSET = 17


@dataclass(frozen=True)
class Value:
    name: str
    shape: Shape


@dataclass
class GraphBuilder:
    """Accumulates nodes, initializers and values with their shapes (the fuzzer's ground truth)."""

    seed: int
    nodes: list[Any] = field(default_factory=list)
    initializers: list[Any] = field(default_factory=list)
    values: list[Value] = field(default_factory=list)
    reduction: int = 1  # the longest reduction (summed terms) any op performs: sets the tolerance
    _count: int = 0

    def __post_init__(self) -> None:
        self.rng = np.random.default_rng(self.seed)

    def fresh(self, prefix: str) -> str:
        self._count += 1
        return f"{prefix}{self._count}"

    def weight(self, shape: Shape, fan_in: int, *, positive: bool = False) -> str:
        arr = self.rng.standard_normal(shape).astype(np.float32) / np.float32(math.sqrt(max(1, fan_in)))
        if positive:
            arr = (1.0 + 0.1 * arr).astype(np.float32)
        return self.const(arr, "w")

    def const(self, arr: np.ndarray, prefix: str = "c") -> str:
        name = self.fresh(prefix)
        self.initializers.append(numpy_helper.from_array(arr, name))
        return name

    def node(self, op: str, inputs: list[str], out_shapes: list[Shape], **attrs: Any) -> list[Value]:
        outs = [Value(self.fresh(op.lower() + "_"), tuple(s)) for s in out_shapes]
        self.nodes.append(helper.make_node(op, inputs, [o.name for o in outs], name=self.fresh(op + "_n"), **attrs))
        self.values.extend(outs)
        return outs

    def note_reduction(self, n: int) -> None:
        self.reduction = max(self.reduction, int(n))


Draw = Callable[[Any], Any]


@dataclass(frozen=True)
class OpSpec:
    name: str
    accepts: Callable[[Shape], bool]
    emit: Callable[[Draw, GraphBuilder, Value], list[Value]]


def _size(shape: Shape) -> int:
    return int(np.prod(shape[1:])) if len(shape) > 1 else 1


def _small(shape: Shape) -> bool:
    return _size(shape) <= MAX_ELEMS_PER_SAMPLE


# ---- elementwise -------------------------------------------------------------------------------

def _unary(op: str) -> OpSpec:
    def emit(draw: Draw, g: GraphBuilder, x: Value) -> list[Value]:
        return g.node(op, [x.name], [x.shape])

    return OpSpec(op, lambda s: True, emit)


def _broadcast_shape(draw: Draw, shape: Shape) -> Shape:
    """A constant shape that broadcasts to ``shape`` (numpy rules, never larger)."""
    kind = draw(st.sampled_from(["scalar", "last", "trailing", "keepdims", "full"]))
    if kind == "full":  # a constant that carries the batch axis itself: a data split must slice it
        return tuple(shape)
    if kind == "scalar":
        return ()
    if kind == "last":
        return (shape[-1],)
    if kind == "trailing":
        k = draw(st.integers(1, len(shape) - 1)) if len(shape) > 1 else 1
        return tuple(shape[-k:])
    return (1,) + tuple(d if draw(st.booleans()) else 1 for d in shape[1:])


def _binary(op: str) -> OpSpec:
    def emit(draw: Draw, g: GraphBuilder, x: Value) -> list[Value]:
        # another activation that broadcasts to x (same shape, or 1 on some axes, e.g. a squeeze-
        # excitation [B,C,1,1] * [B,C,H,W]) makes a branch that joins: a DAG, not a chain
        same = [v for v in g.values if len(v.shape) == len(x.shape)
                and all(a == b or a == 1 for a, b in zip(v.shape, x.shape))]
        if same and draw(st.booleans()):
            other = draw(st.sampled_from(same)).name
            operands = [x.name, other] if draw(st.booleans()) else [other, x.name]
        else:
            bshape = _broadcast_shape(draw, x.shape)
            arr = g.rng.standard_normal(bshape).astype(np.float32)
            c = g.const(arr)
            operands = [x.name, c] if draw(st.booleans()) else [c, x.name]
        return g.node(op, operands, [x.shape])

    return OpSpec(op, lambda s: True, emit)


# ---- matmul family -----------------------------------------------------------------------------

def _matmul(draw: Draw, g: GraphBuilder, x: Value) -> list[Value]:
    k = x.shape[-1]
    if len(x.shape) >= 3 and draw(st.booleans()):
        # batched activation x activation: x @ x^T over the last two axes (attention-like)
        perm = list(range(len(x.shape)))
        perm[-1], perm[-2] = perm[-2], perm[-1]
        tshape = tuple(x.shape[p] for p in perm)
        (xt,) = g.node("Transpose", [x.name], [tshape], perm=perm)
        g.note_reduction(k)
        return [xt] + g.node("MatMul", [x.name, xt.name], [x.shape[:-1] + (x.shape[-2],)])
    n = draw(st.sampled_from([4, 6, 8, 12, 16]))
    w = g.weight((k, n), k)
    g.note_reduction(k)
    return g.node("MatMul", [x.name, w], [x.shape[:-1] + (n,)])


def _gemm(draw: Draw, g: GraphBuilder, x: Value) -> list[Value]:
    k = x.shape[1]
    n = draw(st.sampled_from([4, 6, 8, 12, 16]))
    trans_b = draw(st.integers(0, 1))
    w = g.weight((n, k) if trans_b else (k, n), k)
    inputs = [x.name, w]
    if draw(st.booleans()):
        inputs.append(g.const(g.rng.standard_normal((n,)).astype(np.float32) * np.float32(0.1), "bias"))
    alpha = draw(st.sampled_from([1.0, 0.5]))
    g.note_reduction(k)
    return g.node("Gemm", inputs, [(x.shape[0], n)], transB=trans_b, alpha=alpha)


# ---- convolution and pooling -------------------------------------------------------------------

def _out(size: int, k: int, s: int, p0: int, p1: int, d: int = 1) -> int:
    return (size + p0 + p1 - d * (k - 1) - 1) // s + 1


def _conv(draw: Draw, g: GraphBuilder, x: Value) -> list[Value]:
    b, c, h, w = x.shape
    groups = draw(st.sampled_from([gr for gr in (1, 2, c) if c % gr == 0]))
    m_choices = [m for m in (2, 4, 6, 8) if m % groups == 0] or [groups]
    m = draw(st.sampled_from(m_choices))
    kh = draw(st.sampled_from([1, 3] if min(h, w) >= 3 else [1]))
    kw = draw(st.sampled_from([1, kh] if min(h, w) >= 3 else [1]))
    stride = draw(st.sampled_from([1, 2] if min(h, w) >= 4 else [1]))
    pad = draw(st.integers(0, (kh - 1) // 2))
    padw = (kw - 1) // 2 if pad else 0
    pads = [pad, padw, pad, padw]
    oh, ow = _out(h, kh, stride, pad, pad), _out(w, kw, stride, padw, padw)
    if oh < 1 or ow < 1:
        return g.node("Relu", [x.name], [x.shape])
    fan_in = (c // groups) * kh * kw
    wt = g.weight((m, c // groups, kh, kw), fan_in)
    inputs = [x.name, wt]
    if draw(st.booleans()):
        inputs.append(g.const(g.rng.standard_normal((m,)).astype(np.float32) * np.float32(0.1), "bias"))
    g.note_reduction(fan_in)
    return g.node("Conv", inputs, [(b, m, oh, ow)], kernel_shape=[kh, kw], strides=[stride, stride],
                  pads=pads, group=groups)


def _pool(op: str) -> OpSpec:
    def emit(draw: Draw, g: GraphBuilder, x: Value) -> list[Value]:
        b, c, h, w = x.shape
        k = draw(st.sampled_from([2, 3] if min(h, w) >= 3 else [min(h, w)]))
        s = draw(st.sampled_from([1, 2]))
        p = draw(st.integers(0, (k - 1) // 2))
        oh, ow = _out(h, k, s, p, p), _out(w, k, s, p, p)
        attrs: dict[str, Any] = dict(kernel_shape=[k, k], strides=[s, s], pads=[p, p, p, p])
        if op == "AveragePool":
            attrs["count_include_pad"] = draw(st.integers(0, 1))
            g.note_reduction(k * k)
        return g.node(op, [x.name], [(b, c, oh, ow)], **attrs)

    return OpSpec(op, lambda s: len(s) == 4 and min(s[2:]) >= 2, emit)


def _global_avg(draw: Draw, g: GraphBuilder, x: Value) -> list[Value]:
    g.note_reduction(x.shape[2] * x.shape[3])
    return g.node("GlobalAveragePool", [x.name], [x.shape[:2] + (1, 1)])


# ---- shape ops ---------------------------------------------------------------------------------

def _factor_pairs(n: int) -> list[tuple[int, int]]:
    return [(a, n // a) for a in range(2, n) if n % a == 0]


def _reshape(draw: Draw, g: GraphBuilder, x: Value) -> list[Value]:
    rest = x.shape[1:]
    options: list[Shape] = [(int(np.prod(rest)),)]
    if len(rest) >= 2:
        options.append(rest[:-2] + (rest[-2] * rest[-1],))
    pairs = _factor_pairs(rest[-1])
    if pairs and len(rest) < 4:
        a, bb = draw(st.sampled_from(pairs))
        options.append(rest[:-1] + (a, bb))
    if len(rest) >= 1 and draw(st.integers(0, 5)) == 0:
        # fold the batch into the rows ([B, S, F] -> [B*S, F]), as transformer MLPs do
        out = (x.shape[0] * rest[0],) + tuple(rest[1:]) if len(rest) >= 2 else (x.shape[0] * rest[0],)
        shp = g.const(np.array([-1] + list(out[1:]), dtype=np.int64), "shape")
        return g.node("Reshape", [x.name, shp], [out])
    new_rest = draw(st.sampled_from(options))
    out = (x.shape[0],) + tuple(new_rest)
    # how the batch is spelled: literally, as 0 (copy), or as -1 (inferred)
    batch_spec = draw(st.sampled_from(["literal", "zero", "minus_one"]))
    spec = list(out)
    if batch_spec == "zero":
        spec[0] = 0
    elif batch_spec == "minus_one":
        spec[0] = -1
    elif len(spec) > 1 and draw(st.booleans()):
        spec[-1] = -1
    shp = g.const(np.array(spec, dtype=np.int64), "shape")
    return g.node("Reshape", [x.name, shp], [out])


def _transpose(draw: Draw, g: GraphBuilder, x: Value) -> list[Value]:
    if draw(st.integers(0, 5)) == 0:  # now and then the batch axis moves too
        perm = list(draw(st.permutations(range(len(x.shape)))))
        return g.node("Transpose", [x.name], [tuple(x.shape[p] for p in perm)], perm=perm)
    tail = list(range(1, len(x.shape)))
    perm = [0] + list(draw(st.permutations(tail)))
    return g.node("Transpose", [x.name], [tuple(x.shape[p] for p in perm)], perm=perm)


def _concat(draw: Draw, g: GraphBuilder, x: Value) -> list[Value]:
    axis = draw(st.integers(1, len(x.shape) - 1))
    partners = [v for v in g.values
                if len(v.shape) == len(x.shape) and all(a == b for i, (a, b) in enumerate(zip(v.shape, x.shape)) if i != axis)]
    other = draw(st.sampled_from(partners)) if partners else x
    out = list(x.shape)
    out[axis] += other.shape[axis]
    neg = draw(st.booleans())
    return g.node("Concat", [x.name, other.name], [tuple(out)], axis=axis - len(x.shape) if neg else axis)


def _split(draw: Draw, g: GraphBuilder, x: Value) -> list[Value]:
    axes = [a for a in range(1, len(x.shape)) if x.shape[a] >= 2]
    axis = draw(st.sampled_from(axes))
    n = x.shape[axis]
    if draw(st.booleans()) or n < 3:
        first = draw(st.integers(1, n - 1))
        sizes = [first, n - first]
        sp = g.const(np.array(sizes, dtype=np.int64), "split")
        outs = [x.shape[:axis] + (s,) + x.shape[axis + 1:] for s in sizes]
        return g.node("Split", [x.name, sp], outs, axis=axis)
    # equal parts (opset 17 has no num_outputs attribute, so the sizes are spelled out)
    parts = 2 if n % 2 == 0 else (3 if n % 3 == 0 else 1)
    if parts == 1:
        sizes = [1, n - 1]
    else:
        sizes = [n // parts] * parts
    sp = g.const(np.array(sizes, dtype=np.int64), "split")
    outs = [x.shape[:axis] + (s,) + x.shape[axis + 1:] for s in sizes]
    return g.node("Split", [x.name, sp], outs, axis=axis)


def _softmax(draw: Draw, g: GraphBuilder, x: Value) -> list[Value]:
    axis = draw(st.sampled_from([-1] + list(range(1, len(x.shape)))))
    g.note_reduction(x.shape[axis])
    return g.node("Softmax", [x.name], [x.shape], axis=axis)


def _layernorm(draw: Draw, g: GraphBuilder, x: Value) -> list[Value]:
    axis = draw(st.sampled_from([-1] + ([-2] if len(x.shape) >= 3 else [])))
    norm_shape = x.shape[axis:]
    scale = g.weight(norm_shape, 1, positive=True)
    inputs = [x.name, scale]
    if draw(st.booleans()):
        inputs.append(g.const(g.rng.standard_normal(norm_shape).astype(np.float32) * np.float32(0.1), "beta"))
    g.note_reduction(int(np.prod(norm_shape)))
    return g.node("LayerNormalization", inputs, [x.shape], axis=axis, epsilon=1e-5)


def _flatten(draw: Draw, g: GraphBuilder, x: Value) -> list[Value]:
    return g.node("Flatten", [x.name], [(x.shape[0], _size(x.shape))], axis=1)


OP_SPECS: tuple[OpSpec, ...] = (
    OpSpec("MatMul", lambda s: len(s) >= 2 and _small(s[:-1] + (16,)), _matmul),
    OpSpec("Gemm", lambda s: len(s) == 2, _gemm),
    OpSpec("Conv", lambda s: len(s) == 4, _conv),
    _unary("Relu"), _unary("Sigmoid"), _unary("Tanh"),
    _binary("Add"), _binary("Mul"), _binary("Sub"),
    OpSpec("Reshape", lambda s: len(s) >= 2, _reshape),
    OpSpec("Transpose", lambda s: len(s) >= 3, _transpose),
    OpSpec("Concat", lambda s: len(s) >= 2 and _size(s) * 2 <= MAX_ELEMS_PER_SAMPLE, _concat),
    OpSpec("Split", lambda s: len(s) >= 2 and any(d >= 2 for d in s[1:]), _split),
    OpSpec("Softmax", lambda s: len(s) >= 2, _softmax),
    OpSpec("LayerNormalization", lambda s: len(s) >= 2, _layernorm),
    _pool("MaxPool"), _pool("AveragePool"),
    OpSpec("GlobalAveragePool", lambda s: len(s) == 4, _global_avg),
    OpSpec("Flatten", lambda s: len(s) >= 3, _flatten),
)

OPS_BY_NAME = {spec.name: spec for spec in OP_SPECS}


def float_input(name: str, shape: Shape) -> Any:
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, list(shape))
