"""Per-op rules: where a split axis goes when a node runs on equal chunks of its inputs.

``split_rule(view, node, in_axes, shards)`` is told, for each input, the axis it is split on
(None = whole) and returns ``(required_input_axes, output_axes)`` — every input laid out so that
each rank computes its chunk of the outputs with the unchanged op — or a one-line reason string
when the op cannot run chunk-wise on that axis (then the caller gathers, or gives up).

Rules (R = output rank; "a" the split axis):
1. Elementwise/broadcast ops: inputs are right-aligned; the split maps to one output axis; other
   inputs that are full-size on it are sliced too, size-1 (broadcast) ones stay whole.
2. Unary ops keep the axis. Softmax-like ops and LayerNormalization refuse a normalised axis.
3. Views: Transpose permutes, Reshape maps an axis whose chunks stay contiguous (the split dim
   is the leading dim of a merged/split group and divisible), Flatten/Squeeze/Unsqueeze shift.
4. Concat/Split/Slice/Gather/Reduce*/ArgMax/TopK/CumSum: fine when the op's own axis differs.
5. Conv/pools/norms over channels: batch axis 0 passes; BatchNorm/pools also pass channel axis 1
   (BatchNorm's per-channel parameters are sliced); spatial axes need halos (spatial strategy).
6. MatMul/Gemm: batch dims pass (A's rows, B's columns); the contracted axis is refused here
   (the tensor strategy turns it into a partial sum).
7. Ops that read shapes (Shape, Size) or are unknown are refused, naming the op.

Each rule is a small function registered for its op family with ``@split_rule_for("MatMul")``;
:func:`split_rule` does the checks common to all ops and dispatches. A rule registered with
``many=True`` accepts more than one split input; for the others that is refused before they run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence, Union

import numpy as np
import onnx_ir as ir

from partitioner.core import op_classes as _oc
from partitioner.core.model_view import ModelView, attr

Axes = list[Union[int, None]]
RuleResult = Union[tuple[Axes, Axes], str]

ELEMENTWISE, UNARY, SOFTMAX_LIKE, POOLS = _oc.ELEMENTWISE, _oc.UNARY, _oc.SOFTMAX_LIKE, _oc.POOLS
REDUCES, VIEWS = _oc.REDUCTIONS, _oc.SPLIT_VIEWS


def _norm(axis: int, rank: int) -> int:
    return axis + rank if axis < 0 else axis


def reshape_map(in_shape: Sequence[int], out_shape: Sequence[int], a: int, shards: int) -> int | None:
    """Output axis carrying input axis ``a`` split in ``shards`` contiguous chunks, or None.

    The chunks stay contiguous when input axis ``a`` and the output axis j lead the same group of
    elements (equal products before them) and both are divisible by ``shards``."""
    lead = int(np.prod(in_shape[:a], dtype=np.int64))
    acc = 1
    for j, d_out in enumerate(out_shape):
        if acc == lead and d_out != 1:
            d_in = in_shape[a]
            if d_in == d_out or (d_in % shards == 0 and d_out % shards == 0
                                 and (d_in % d_out == 0 or d_out % d_in == 0)):
                return j
            return None
        acc *= d_out
        if acc > lead:
            return None
    return None


def _int_list(view: ModelView, node: ir.Node, attr_name: str, input_index: int) -> list[int] | None:
    a = attr(node, attr_name)
    if a is not None:
        return [int(x) for x in a]
    if len(node.inputs) > input_index and node.inputs[input_index] is not None:
        c = view.const(node.inputs[input_index].name)
        if c is not None:
            return [int(x) for x in np.asarray(c).reshape(-1)]
    return None


@dataclass(frozen=True)
class SplitQuery:
    """One question to a rule: ``node`` runs on chunks of its inputs split as ``in_axes``."""

    view: ModelView
    node: ir.Node
    in_axes: Axes
    shards: int
    ins: list[str]
    outs: list[str]
    split: list[tuple[int, int]]  # (input index, axis) of every split input
    R: int  # the first output's rank

    @property
    def op(self) -> str:
        return self.node.op_type

    @property
    def i0(self) -> int:
        return self.split[0][0]

    @property
    def a0(self) -> int:
        return self.split[0][1]

    def refuse(self, why: str) -> str:
        """``node 'n' (Op) <why>``: the one-line reason the caller reports."""
        return f"node {self.node.name!r} ({self.op}) {why}"

    def same_all(self, axis: int | None) -> tuple[Axes, Axes]:
        """The first input split on ``axis``, the others whole; every output split on ``axis``."""
        return [axis if (i == 0) else None for i in range(len(self.ins))], [axis] * len(self.outs)

    def first_only(self, out: Axes) -> tuple[Axes, Axes]:
        """The first input split on its axis, the others whole; outputs as ``out``."""
        return [self.a0] + [None] * (len(self.ins) - 1), out

    def ints(self, attr_name: str, input_index: int) -> list[int] | None:
        return _int_list(self.view, self.node, attr_name, input_index)


Rule = Callable[[SplitQuery], RuleResult]
_RULES: dict[str, tuple[Rule, bool]] = {}


def split_rule_for(*ops: str, many: bool = False) -> Callable[[Rule], Rule]:
    """Register a rule for the op types ``ops`` (one op is registered once: the first wins)."""
    def register(fn: Rule) -> Rule:
        for op in ops:
            _RULES.setdefault(op, (fn, many))
        return fn
    return register


def split_rule(view: ModelView, node: ir.Node, in_axes: Axes, shards: int) -> RuleResult:
    """See the module docstring. ``in_axes`` aligns with ``node.inputs``."""
    op = node.op_type
    ins = view.node_inputs(node)
    outs = view.node_outputs(node)
    if node.domain not in ("", "ai.onnx"):
        return f"node {node.name!r}: no sharding rule for {node.domain}.{op}"
    split = [(i, a) for i, a in enumerate(in_axes) if a is not None and ins[i]]
    if not split:
        return [None] * len(ins), [None] * len(outs)
    q = SplitQuery(view, node, in_axes, shards, ins, outs, split, view.rank(outs[0]) if outs and outs[0] else 0)
    rule, many = _RULES.get(op, (None, False))
    if len(split) > 1 and not many:
        return f"node {node.name!r} ({op}): more than one input is split"
    if rule is None:
        return f"node {node.name!r}: no sharding rule for {op}"
    return rule(q)


# ---- rule 1: elementwise ---------------------------------------------------------------------

@split_rule_for(*sorted(ELEMENTWISE), "Expand", many=True)
def _elementwise(q: SplitQuery) -> RuleResult:
    view, R = q.view, q.R
    targets = {a + R - view.rank(q.ins[i]) for i, a in q.split}
    if len(targets) != 1:
        return f"node {q.node.name!r} ({q.op}): inputs split on different axes"
    o = targets.pop()
    req: Axes = []
    for i, name in enumerate(q.ins):
        if not name or (q.op == "Expand" and i == 1):
            req.append(None)
            continue
        r = view.rank(name)
        ax = o - (R - r)
        req.append(ax if ax >= 0 and view.shape(name)[ax] != 1 else None)
    return req, [o] * len(q.outs)


@split_rule_for("CastLike", many=True)
def _cast_like(q: SplitQuery) -> RuleResult:
    # input 1 gives only the element type: its split does not matter
    in_axes = q.in_axes
    return [in_axes[0], in_axes[1] if len(in_axes) > 1 else None], [in_axes[0]] * len(q.outs)


# ---- rule 2: unary, normalisations -----------------------------------------------------------

@split_rule_for(*sorted(UNARY))
def _unary(q: SplitQuery) -> RuleResult:
    if q.i0 != 0:
        return f"node {q.node.name!r} ({q.op}): a split parameter input"
    return q.same_all(q.a0)


@split_rule_for(*sorted(SOFTMAX_LIKE))
def _softmax(q: SplitQuery) -> RuleResult:
    ax = _norm(attr(q.node, "axis", -1), q.R)
    return q.refuse(f"normalises axis {ax}") if ax == q.a0 else q.same_all(q.a0)


@split_rule_for("LayerNormalization")
def _layer_norm(q: SplitQuery) -> RuleResult:
    ax = _norm(attr(q.node, "axis", -1), q.R)
    if q.a0 >= ax:
        return q.refuse(f"normalises axis {q.a0}")
    return q.first_only([q.a0] * len(q.outs))


@split_rule_for("BatchNormalization", "InstanceNormalization")
def _batch_norm(q: SplitQuery) -> RuleResult:
    a0, n_in, n_out = q.a0, len(q.ins), len(q.outs)
    if a0 == 0:
        return [0] + [None] * (n_in - 1), [0] + [None] * (n_out - 1)
    if a0 == 1:
        return [1] + [0] * (n_in - 1), [1] + [None] * (n_out - 1)
    if q.op == "BatchNormalization":  # inference: per-channel affine, spatial axes pass
        return [a0] + [None] * (n_in - 1), [a0] + [None] * (n_out - 1)
    return q.refuse(f"normalises over axis {a0}")


# ---- rule 5: conv and pools ------------------------------------------------------------------

@split_rule_for(*sorted(POOLS), "LRN")
def _pool(q: SplitQuery) -> RuleResult:
    if q.a0 == 0 or (q.a0 == 1 and q.op != "LRN"):
        return q.same_all(q.a0)
    return q.refuse(f"pools over spatial axis {q.a0}")


@split_rule_for("Conv", "ConvTranspose")
def _conv(q: SplitQuery) -> RuleResult:
    if q.a0 == 0 and q.i0 == 0:
        return [0] + [None] * (len(q.ins) - 1), [0]
    return q.refuse(f"mixes axis {q.a0} of input {q.i0}")


# ---- rule 6: contractions --------------------------------------------------------------------

def _matmul_target(q: SplitQuery, ra: int, rb: int) -> int | str:
    """The output axis every split input of a MatMul maps to, or the reason it has none."""
    targets = set()
    for i, a in q.split:
        r = ra if i == 0 else rb
        if i == 0 and r >= 2 and a == r - 1:
            return f"node {q.node.name!r} (MatMul) contracts axis {a} of its first input"
        if i == 1 and (a == r - 2 or r == 1):
            return f"node {q.node.name!r} (MatMul) contracts axis {a} of its second input"
        if i == 1 and a == r - 1:
            targets.add(q.R - 1)
        elif i == 0 and ra == 1:
            return f"node {q.node.name!r} (MatMul) contracts its 1-D first input"
        else:
            targets.add(a + q.R - r)
    if len(targets) != 1:
        return f"node {q.node.name!r} (MatMul): inputs split on different axes"
    return targets.pop()


@split_rule_for("MatMul", many=True)
def _matmul(q: SplitQuery) -> RuleResult:
    view, R = q.view, q.R
    ra, rb = view.rank(q.ins[0]), view.rank(q.ins[1])
    o = _matmul_target(q, ra, rb)
    if isinstance(o, str):
        return o
    req: Axes = []
    for i, name in enumerate(q.ins):
        r = ra if i == 0 else rb
        if o == R - 1:
            req.append(r - 1 if i == 1 else None)
        elif o == R - 2 and ra >= 2:
            req.append(ra - 2 if i == 0 else None)
        else:
            ax = o - (R - r)
            req.append(ax if ax >= 0 and ax < r - 2 and view.shape(name)[ax] != 1 else None)
    return req, [o]


@split_rule_for("Gemm")
def _gemm(q: SplitQuery) -> RuleResult:
    if q.i0 == 0 and q.a0 == (1 if attr(q.node, "transA", 0) else 0):
        return [q.a0 if i == 0 else None for i in range(len(q.ins))], [0]
    return q.refuse(f"contracts or splits axis {q.a0} of input {q.i0}")


# ---- rule 3: views ---------------------------------------------------------------------------

@split_rule_for("Transpose")
def _transpose(q: SplitQuery) -> RuleResult:
    rin = q.view.rank(q.ins[0])
    perm = list(attr(q.node, "perm", list(range(rin))[::-1]))
    return ([q.a0], [perm.index(q.a0)]) if q.i0 == 0 else f"node {q.node.name!r}: bad input"


@split_rule_for("Reshape")
def _reshape(q: SplitQuery) -> RuleResult:
    if q.i0 != 0:
        return f"node {q.node.name!r} (Reshape): split shape input"
    j = reshape_map(q.view.shape(q.ins[0]), q.view.shape(q.outs[0]), q.a0, q.shards)
    if j is None:
        return q.refuse(f"mixes split axis {q.a0} with other axes")
    return [q.a0, None], [j]


@split_rule_for("Flatten")
def _flatten(q: SplitQuery) -> RuleResult:
    f = _norm(attr(q.node, "axis", 1), q.view.rank(q.ins[0]))
    if q.a0 == 0 and f >= 1:
        return q.same_all(0)
    if q.a0 == f:
        return [q.a0], [1]
    return q.refuse(f"merges split axis {q.a0} into a larger axis")


@split_rule_for("Squeeze", "Unsqueeze")
def _squeeze(q: SplitQuery) -> RuleResult:
    rin, a0 = q.view.rank(q.ins[0]), q.a0
    axes = q.ints("axes", 1)
    if q.op == "Squeeze":
        if axes is None:
            axes = [i for i, d in enumerate(q.view.shape(q.ins[0])) if d == 1]
        axes = [_norm(x, rin) for x in axes]
        if a0 in axes:
            return q.refuse(f"removes split axis {a0}")
        o = a0 - sum(1 for x in axes if x < a0)
    else:
        if axes is None:
            return f"node {q.node.name!r} (Unsqueeze): axes are not constant"
        o = a0
        for x in sorted(_norm(x, q.R) for x in axes):
            if x <= o:
                o += 1
    return q.first_only([o])


# ---- rule 4: ops with an axis of their own ---------------------------------------------------

@split_rule_for("Concat", many=True)
def _concat(q: SplitQuery) -> RuleResult:
    c = _norm(attr(q.node, "axis", 0), q.R)
    axes = {a for _, a in q.split}
    if len(axes) != 1 or c in axes:
        return q.refuse(f"joins along split axis {c}")
    a = axes.pop()
    return [a if n else None for n in q.ins], [a]


@split_rule_for("Split")
def _split(q: SplitQuery) -> RuleResult:
    c = _norm(attr(q.node, "axis", 0), q.view.rank(q.ins[0]))
    if c == q.a0 or q.i0 != 0:
        return q.refuse(f"splits along split axis {c}")
    return q.first_only([q.a0] * len(q.outs))


@split_rule_for("Slice")
def _slice(q: SplitQuery) -> RuleResult:
    if q.i0 != 0:
        return f"node {q.node.name!r} (Slice): split index input"
    rin = q.view.rank(q.ins[0])
    starts, ends = q.ints("starts", 1), q.ints("ends", 2)
    axes = q.ints("axes", 3) or list(range(len(starts or [])))
    if starts is None or ends is None:
        return f"node {q.node.name!r} (Slice): starts/ends are not constant"
    for ax, s, e in zip(axes, starts, ends):
        if _norm(ax, rin) == q.a0 and not (s == 0 and e >= q.view.shape(q.ins[0])[q.a0]):
            return q.refuse(f"cuts split axis {q.a0}")
    return q.first_only([q.a0])


@split_rule_for("Gather")
def _gather(q: SplitQuery) -> RuleResult:
    g = _norm(attr(q.node, "axis", 0), q.view.rank(q.ins[0]))
    if q.i0 == 1:
        return [None, q.a0], [g + q.a0]
    if q.a0 == g:
        return q.refuse(f"indexes along split axis {q.a0}")
    return [q.a0, None], [q.a0 if q.a0 < g else q.a0 + q.view.rank(q.ins[1]) - 1]


@split_rule_for(*sorted(REDUCES), "ArgMax", "ArgMin")
def _reduce(q: SplitQuery) -> RuleResult:
    rin, a0 = q.view.rank(q.ins[0]), q.a0
    keep = attr(q.node, "keepdims", 1)
    if q.op in ("ArgMax", "ArgMin"):
        axes = [_norm(attr(q.node, "axis", 0), rin)]
    else:
        axes = q.ints("axes", 1)
        axes = list(range(rin)) if not axes else [_norm(x, rin) for x in axes]
    if a0 in axes:
        return q.refuse(f"reduces split axis {a0}")
    o = a0 if keep else a0 - sum(1 for x in axes if x < a0)
    return q.first_only([o] * len(q.outs))


@split_rule_for("TopK", "CumSum", "LpNormalization")
def _along_axis(q: SplitQuery) -> RuleResult:
    rin = q.view.rank(q.ins[0])
    ax = _norm(attr(q.node, "axis", -1 if q.op != "CumSum" else 0), rin)
    if q.op == "CumSum":
        c = q.ints("__none__", 1)
        ax = _norm(c[0], rin) if c else ax
    if ax == q.a0:
        return q.refuse(f"works along split axis {q.a0}")
    return q.first_only([q.a0] * len(q.outs))


@split_rule_for("Pad")
def _pad(q: SplitQuery) -> RuleResult:
    pads = q.ints("pads", 1)
    rin = q.view.rank(q.ins[0])
    if pads is None:
        return f"node {q.node.name!r} (Pad): pads are not constant"
    paxes = q.ints("__none__", 3) if len(q.ins) > 3 and q.ins[3] else list(range(rin))
    k = len(paxes)
    for j, ax in enumerate(paxes):
        if _norm(ax, rin) == q.a0 and (pads[j] or pads[j + k]):
            return q.refuse(f"pads split axis {q.a0}")
    return q.first_only([q.a0])


@split_rule_for("Resize")
def _resize(q: SplitQuery) -> RuleResult:
    ins, a0 = q.ins, q.a0
    sc = q.view.const(ins[2]) if len(ins) > 2 and ins[2] else None
    if sc is not None and np.asarray(sc).size:
        if float(np.asarray(sc).reshape(-1)[a0]) != 1.0:
            return q.refuse(f"rescales split axis {a0}")
    elif len(ins) > 3 and ins[3]:
        if q.view.shape(q.outs[0])[a0] != q.view.shape(ins[0])[a0]:
            return q.refuse(f"resizes split axis {a0}")
    return q.first_only([a0])


@split_rule_for("Tile")
def _tile(q: SplitQuery) -> RuleResult:
    reps = q.ints("__none__", 1)
    if reps is None or reps[q.a0] != 1:
        return q.refuse(f"repeats split axis {q.a0}")
    return [q.a0, None], [q.a0]


# ---- rule 7: shape readers -------------------------------------------------------------------

@split_rule_for("Shape", "Size")
def _shape(q: SplitQuery) -> RuleResult:
    return q.refuse("reads the shape of a split tensor")
