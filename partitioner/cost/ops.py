"""Per-operator cost: FLOPs, bytes moved and depth (COST_MODEL.md, "Work and depth").

Rules (one multiply-add = 2 FLOPs; sizes come from the static shapes and dtypes on the IR values):

1. Conv: 2·N·C_out·H′·W′·(C_in/group)·K_y·K_x, plus N·C_out·H′·W′ when there is a bias.
   ConvTranspose: 2·N·C_in·H·W·(C_out/group)·K_y·K_x (each input pixel scatters one kernel),
   plus the output size when there is a bias.
2. MatMul (batched, broadcast, 1-D operands): 2·|Y|·K, i.e. 2MKN per matrix product.
   Gemm: 2MKN (transA/transB honoured) plus M·N when C is given.
3. Elementwise ops: a fixed number of FLOPs per output element (1 for Relu/Add/..., more for
   Sigmoid/Tanh/Erf/Gelu, see ``_UNARY_FLOPS``); variadic Sum/Max/Min/Mean: (k−1) per element.
   BatchNormalization (inference): 2 per element (scale and shift after folding the stats).
   Softmax 5, LayerNormalization 8 per element; pools: one per window element; reductions: one
   per input element.
4. Bytes: every input and output is read/written once (weights included). Views (Reshape,
   Flatten, Squeeze, Unsqueeze, and the inference no-ops Identity and Dropout) cost nothing.
   Slice and Gather read only what they copy. Nodes in the ``partitioner.comm`` domain cost
   nothing here: communication is costed by :mod:`partitioner.cost.comm`.
5. Depth (survey, Table 4): elementwise 1; fully connected/MatMul ⌈log₂K⌉; convolution
   ⌈log₂(C_in/g)⌉+⌈log₂K_y⌉+⌈log₂K_x⌉; pooling ⌈log₂K_x⌉+⌈log₂K_y⌉; batch norm ⌈log₂N⌉;
   softmax/layer norm/reductions ⌈log₂L⌉ of the normalised (reduced) extent. Every computing op
   has depth ≥ 1; views and comm ops have depth 0.
6. Unknown ops fall back to "read every input, write every output, depth 1, no FLOPs".

Work W (survey §2.5): :attr:`OpCost.work` is the FLOP count for ops that compute, and the number
of elements touched (read + written) for pure data-movement ops whose FLOP count is zero
(Concat, Transpose, Gather, Pad, ...), so that copies still add to W.

Values whose shape is not fully static count as zero elements: run shape inference first.

Op classes (:func:`op_class`), which select a device's per-class efficiency
(``Device.efficiency_by_class``): ``gemm`` (MatMul, Gemm, Einsum), ``conv`` (Conv with one
group, ConvTranspose), ``depthwise_conv`` (Conv with more than one group), ``elementwise``
(unary, binary and variadic elementwise ops, Where, BatchNormalization), ``norm`` (Softmax,
LogSoftmax, LayerNormalization, Instance/GroupNormalization, LRN), ``reduction`` (Reduce*,
ArgMax/ArgMin), ``pool`` (Max/Average/Lp pools and their global forms), ``data_movement``
(views, copies, Gather, Slice, Resize) and ``other`` (comm ops, unknown ops).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import onnx_ir as ir

from partitioner.core import op_classes as _oc

COMM_DOMAIN = "partitioner.comm"


@dataclass(frozen=True)
class OpCost:
    """Cost of one operator execution. ``elements`` = elements read + written (for W)."""

    flops: float
    bytes_read: float
    bytes_written: float
    depth: float
    elements: float = 0.0
    #: convolutions only: the output pixels per image (ConvTranspose: its input's), the column
    #: count of the per-image GEMM a CPU backend runs them as (0 otherwise; roofline rule 6)
    columns: float = 0.0
    #: a training step's node on a co-running rank (:mod:`partitioner.cost.training` rule 12):
    #: (bytes, reuse distance in bytes) of each input last touched more than the op's own bytes
    #: before; roofline rule 8 prices each such read at the working set of its distance
    reuse: tuple[tuple[float, float], ...] = ()

    @property
    def bytes(self) -> float:
        return self.bytes_read + self.bytes_written

    @property
    def work(self) -> float:
        """W of this op: FLOPs if it computes, else elements touched (memory-bound copies)."""
        return self.flops if self.flops > 0 else self.elements

    def __add__(self, other: OpCost) -> OpCost:
        """Sequential composition: sums everything, depths add along a chain."""
        return OpCost(self.flops + other.flops, self.bytes_read + other.bytes_read,
                      self.bytes_written + other.bytes_written, self.depth + other.depth,
                      self.elements + other.elements)


ZERO = OpCost(0.0, 0.0, 0.0, 0.0, 0.0)


def static_shape(value: ir.Value | None) -> tuple[int, ...] | None:
    """The value's dims as ints, or None when missing or not fully static."""
    if value is None:
        return None
    shape = value.shape
    if shape is None:
        return None
    dims = shape.dims
    for d in dims:
        if d.__class__ is not int:
            return None
    return dims  # type: ignore[return-value]


def numel(value: ir.Value | None) -> int:
    dims = static_shape(value)
    if dims is None:
        return 0
    return math.prod(dims)


_ITEMSIZE: dict[ir.DataType, float] = {}


def itemsize(value: ir.Value | None) -> float:
    """Bytes per element (4 when the dtype is unknown, 8 for types without a bit width)."""
    dt = value.dtype if value is not None else None
    if dt is None:
        return 4.0
    size = _ITEMSIZE.get(dt)
    if size is None:
        try:
            size = dt.itemsize
        except TypeError:  # STRING and other types without a bit width
            size = 8.0
        _ITEMSIZE[dt] = size
    return size


def nbytes(value: ir.Value | None) -> float:
    return numel(value) * itemsize(value)


def _clog2(x: float) -> int:
    return math.ceil(math.log2(x)) if x > 1 else 0


def _io(node: ir.Node) -> tuple[float, float, float]:
    """(bytes read, bytes written, elements touched) for every input and output."""
    r = w = e = 0.0
    for v in node.inputs:
        if v is not None:
            n = numel(v)
            if n:
                e += n
                r += n * itemsize(v)
    for v in node.outputs:
        n = numel(v)
        if n:
            e += n
            w += n * itemsize(v)
    return r, w, e


def _cost(node: ir.Node, flops: float, depth: float) -> OpCost:
    r, w, e = _io(node)
    return OpCost(float(flops), r, w, float(depth), e)


def _out(node: ir.Node, i: int = 0) -> ir.Value | None:
    return node.outputs[i] if len(node.outputs) > i else None


def _in(node: ir.Node, i: int) -> ir.Value | None:
    return node.inputs[i] if len(node.inputs) > i else None


# ---- per-op rules --------------------------------------------------------------------------

def _conv(node: ir.Node) -> OpCost:
    y, w = static_shape(_out(node)), static_shape(_in(node, 1))
    if y is None or w is None or len(y) < 2:
        return _fallback(node)
    n, cout, spatial = y[0], y[1], math.prod(y[2:])
    cin_g, kernel = w[1], w[2:]  # the weight's dim 1 is C_in/group
    out_elems = n * cout * spatial
    flops = 2 * out_elems * cin_g * math.prod(kernel)
    if _in(node, 2) is not None:
        flops += out_elems
    depth = _clog2(cin_g) + sum(_clog2(k) for k in kernel)
    return replace(_cost(node, flops, max(1, depth)), columns=float(spatial))


def _conv_transpose(node: ir.Node) -> OpCost:
    x, w, y = static_shape(_in(node, 0)), static_shape(_in(node, 1)), static_shape(_out(node))
    if x is None or w is None or y is None or len(x) < 2:
        return _fallback(node)
    group = node.attributes.get_int("group", 1)
    n, cin, in_spatial = x[0], x[1], math.prod(x[2:])
    cout_g, kernel = w[1], w[2:]
    flops = 2 * n * cin * in_spatial * cout_g * math.prod(kernel)
    if _in(node, 2) is not None:
        flops += math.prod(y)
    depth = _clog2(cin / group) + sum(_clog2(k) for k in kernel)
    return replace(_cost(node, flops, max(1, depth)), columns=float(in_spatial))


def _matmul(node: ir.Node) -> OpCost:
    a, y = static_shape(_in(node, 0)), static_shape(_out(node))
    if a is None or y is None or len(a) == 0:
        return _fallback(node)
    k = a[-1]
    flops = 2 * math.prod(y) * k
    return _cost(node, flops, max(1, _clog2(k)))


def _gemm(node: ir.Node) -> OpCost:
    a, b = static_shape(_in(node, 0)), static_shape(_in(node, 1))
    if a is None or b is None or len(a) != 2 or len(b) != 2:
        return _fallback(node)
    m, k = (a[1], a[0]) if node.attributes.get_int("transA", 0) else (a[0], a[1])
    n = b[0] if node.attributes.get_int("transB", 0) else b[1]
    flops = 2 * m * k * n
    if _in(node, 2) is not None:
        flops += m * n
    return _cost(node, flops, max(1, _clog2(k)))


# FLOPs per output element of elementwise ops (rough, documented: transcendental ≈ 4–8).
_UNARY_FLOPS: dict[str, float] = {
    "Relu": 1, "LeakyRelu": 2, "PRelu": 2, "Abs": 1, "Neg": 1, "Sign": 1, "Floor": 1, "Ceil": 1,
    "Round": 1, "Not": 1, "Reciprocal": 1, "Sqrt": 1, "Clip": 2, "Exp": 4, "Log": 4,
    "Sigmoid": 4, "HardSigmoid": 3, "HardSwish": 4, "Tanh": 4, "Erf": 8, "Gelu": 8, "Elu": 4,
    "Selu": 5, "Softplus": 4, "Softsign": 3, "Mish": 10, "Sin": 4, "Cos": 4, "IsNaN": 1,
    "IsInf": 1, "Celu": 4, "ThresholdedRelu": 1, "Swish": 5,
}
_BINARY, _VARIADIC, _VIEWS, _FREE, _COPIES = _oc.BINARY, _oc.VARIADIC, _oc.COST_VIEWS, _oc.FREE, _oc.COPIES
_REDUCES = _oc.REDUCTIONS | _oc.ARG_REDUCTIONS


def _unary(node: ir.Node) -> OpCost:
    return _cost(node, _UNARY_FLOPS.get(node.op_type, 1) * numel(_out(node)), 1)


def _binary(node: ir.Node) -> OpCost:
    return _cost(node, numel(_out(node)), 1)


def _variadic(node: ir.Node) -> OpCost:
    k = sum(1 for v in node.inputs if v is not None)
    return _cost(node, max(1, k - 1) * numel(_out(node)), max(1, _clog2(k)))


def _where(node: ir.Node) -> OpCost:
    return _cost(node, numel(_out(node)), 1)


def _batchnorm(node: ir.Node) -> OpCost:
    x = static_shape(_in(node, 0))
    n = x[0] if x else 1
    return _cost(node, 2 * numel(_out(node)), max(1, _clog2(n)))


def _axis_extent(node: ir.Node, default_axis: int, to_end: bool) -> int:
    x = static_shape(_in(node, 0))
    if not x:
        return 1
    axis = node.attributes.get_int("axis", default_axis)
    axis = axis + len(x) if axis < 0 else axis
    axis = min(max(axis, 0), len(x) - 1)
    return math.prod(x[axis:]) if to_end else x[axis]


def _softmax(node: ir.Node) -> OpCost:
    ext = _axis_extent(node, -1, to_end=False)
    return _cost(node, 5 * numel(_out(node)), max(1, _clog2(ext)))


def _layernorm(node: ir.Node) -> OpCost:
    ext = _axis_extent(node, -1, to_end=True)
    return _cost(node, 8 * numel(_in(node, 0)), max(1, _clog2(ext)))


def _norm_channels(node: ir.Node) -> OpCost:  # InstanceNormalization, GroupNormalization
    x = static_shape(_in(node, 0))
    ext = math.prod(x[2:]) if x and len(x) > 2 else 1
    return _cost(node, 8 * numel(_in(node, 0)), max(1, _clog2(ext)))


def _pool(node: ir.Node) -> OpCost:
    kernel = node.attributes.get_ints("kernel_shape", None) or ()
    window = math.prod(kernel) if kernel else 1
    return _cost(node, numel(_out(node)) * window, max(1, sum(_clog2(k) for k in kernel)))


def _global_pool(node: ir.Node) -> OpCost:
    x = static_shape(_in(node, 0))
    spatial = x[2:] if x and len(x) > 2 else ()
    return _cost(node, numel(_in(node, 0)), max(1, sum(_clog2(k) for k in spatial)))


def _lrn(node: ir.Node) -> OpCost:
    size = node.attributes.get_int("size", 5)
    return _cost(node, (2 * size + 5) * numel(_out(node)), 1 + _clog2(size))


def _reduce(node: ir.Node) -> OpCost:
    x, y = numel(_in(node, 0)), numel(_out(node))
    extent = x / y if y else 1
    return _cost(node, x, max(1, _clog2(extent)))


def _resize(node: ir.Node) -> OpCost:
    mode = node.attributes.get_string("mode", "nearest")
    per = {"nearest": 0, "linear": 8, "cubic": 32}.get(mode, 8)
    return _cost(node, per * numel(_out(node)), 1)


def _gather_slice(node: ir.Node) -> OpCost:
    """Reads only what it copies (plus index tensors), writes the output."""
    out = _out(node)
    w = nbytes(out)
    idx = sum(nbytes(v) for v in list(node.inputs)[1:] if v is not None)
    n = numel(out)
    return OpCost(0.0, w + idx, w, 1.0, 2.0 * n)


def _copy(node: ir.Node) -> OpCost:
    return _cost(node, 0, 1)


def _fallback(node: ir.Node) -> OpCost:
    return _cost(node, 0, 1)


_RULES = {
    "Conv": _conv, "ConvTranspose": _conv_transpose, "MatMul": _matmul, "Gemm": _gemm,
    "BatchNormalization": _batchnorm, "Softmax": _softmax, "LogSoftmax": _softmax,
    "LayerNormalization": _layernorm, "InstanceNormalization": _norm_channels,
    "GroupNormalization": _norm_channels, "MaxPool": _pool, "AveragePool": _pool,
    "LpPool": _pool, "GlobalAveragePool": _global_pool, "GlobalMaxPool": _global_pool,
    "LRN": _lrn, "Resize": _resize, "Upsample": _resize, "Where": _where,
    "Gather": _gather_slice, "GatherElements": _gather_slice, "Slice": _gather_slice,
}
for _op in _UNARY_FLOPS:
    _RULES[_op] = _unary
for _op in _BINARY:
    _RULES[_op] = _binary
for _op in _VARIADIC:
    _RULES[_op] = _variadic
for _op in _COPIES:
    _RULES[_op] = _copy
for _op in _REDUCES:
    _RULES[_op] = _reduce


_CLASS_OF: dict[str, str] = {"MatMul": "gemm", "Gemm": "gemm", "Einsum": "gemm", "ConvTranspose": "conv",
                             "BatchNormalization": "elementwise", "Where": "elementwise",
                             "Softmax": "norm", "LogSoftmax": "norm", "LayerNormalization": "norm",
                             "InstanceNormalization": "norm", "GroupNormalization": "norm", "LRN": "norm",
                             "MaxPool": "pool", "AveragePool": "pool", "LpPool": "pool",
                             "GlobalAveragePool": "pool", "GlobalMaxPool": "pool", "GlobalLpPool": "pool",
                             "Gather": "data_movement", "GatherElements": "data_movement",
                             "Slice": "data_movement", "Resize": "data_movement", "Upsample": "data_movement"}
for _op in (*_UNARY_FLOPS, *_BINARY, *_VARIADIC):
    _CLASS_OF[_op] = "elementwise"
for _op in _REDUCES:
    _CLASS_OF[_op] = "reduction"
for _op in (*_COPIES, *_VIEWS, *_FREE):
    _CLASS_OF[_op] = "data_movement"


def op_class(node: ir.Node) -> str:
    """The op class of ``node`` (list in the module docstring); ``"other"`` when unknown."""
    if node.domain not in ("", "ai.onnx"):
        return "other"
    op = node.op_type
    if op == "Conv":
        return "depthwise_conv" if node.attributes.get_int("group", 1) > 1 else "conv"
    return _CLASS_OF.get(op, "other")


def op_cost(node: ir.Node) -> OpCost:
    """Cost of one execution of ``node`` (rules in the module docstring)."""
    if node.domain == COMM_DOMAIN:
        return ZERO
    op = node.op_type
    if node.domain in ("", "ai.onnx"):
        if op in _VIEWS or op in _FREE:
            return ZERO
        rule = _RULES.get(op)
        if rule is not None:
            return rule(node)
    return _fallback(node)
