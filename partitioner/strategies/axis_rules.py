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
"""

from __future__ import annotations

from typing import Sequence, Union

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
    R = view.rank(outs[0]) if outs else 0

    def same_all(axis: int | None) -> tuple[Axes, Axes]:
        return [axis if (i == 0) else None for i in range(len(ins))], [axis] * len(outs)

    if op in ELEMENTWISE or op == "Expand":
        targets = {a + R - view.rank(ins[i]) for i, a in split}
        if len(targets) != 1:
            return f"node {node.name!r} ({op}): inputs split on different axes"
        o = targets.pop()
        req: Axes = []
        for i, name in enumerate(ins):
            if not name or (op == "Expand" and i == 1):
                req.append(None)
                continue
            r = view.rank(name)
            ax = o - (R - r)
            req.append(ax if ax >= 0 and view.shape(name)[ax] != 1 else None)
        return req, [o] * len(outs)
    if op == "CastLike":  # input 1 gives only the element type: its split does not matter
        return [in_axes[0], in_axes[1] if len(in_axes) > 1 else None], [in_axes[0]] * len(outs)
    (i0, a0), = split[:1]
    if len(split) > 1 and op not in ("Concat", "MatMul", "Sum", "Mean", "Max", "Min"):
        return f"node {node.name!r} ({op}): more than one input is split"
    if op in UNARY:
        if i0 != 0:
            return f"node {node.name!r} ({op}): a split parameter input"
        return same_all(a0)
    if op in SOFTMAX_LIKE:
        ax = _norm(attr(node, "axis", -1), R)
        return f"node {node.name!r} ({op}) normalises axis {ax}" if ax == a0 else same_all(a0)
    if op == "LayerNormalization":
        ax = _norm(attr(node, "axis", -1), R)
        if a0 >= ax:
            return f"node {node.name!r} (LayerNormalization) normalises axis {a0}"
        return [a0] + [None] * (len(ins) - 1), [a0] * len(outs)
    if op in ("BatchNormalization", "InstanceNormalization"):
        if a0 == 0:
            return [0] + [None] * (len(ins) - 1), [0] + [None] * (len(outs) - 1)
        if a0 == 1:
            return [1] + [0] * (len(ins) - 1), [1] + [None] * (len(outs) - 1)
        if op == "BatchNormalization":  # inference: per-channel affine, spatial axes pass
            return [a0] + [None] * (len(ins) - 1), [a0] + [None] * (len(outs) - 1)
        return f"node {node.name!r} ({op}) normalises over axis {a0}"
    if op in POOLS or op == "LRN":
        if a0 == 0 or (a0 == 1 and op != "LRN"):
            return same_all(a0)
        return f"node {node.name!r} ({op}) pools over spatial axis {a0}"
    if op in ("Conv", "ConvTranspose"):
        if a0 == 0 and i0 == 0:
            return [0] + [None] * (len(ins) - 1), [0]
        return f"node {node.name!r} ({op}) mixes axis {a0} of input {i0}"
    if op == "MatMul":
        ra, rb = view.rank(ins[0]), view.rank(ins[1])
        targets = set()
        for i, a in split:
            r = ra if i == 0 else rb
            if i == 0 and r >= 2 and a == r - 1:
                return f"node {node.name!r} (MatMul) contracts axis {a} of its first input"
            if i == 1 and (a == r - 2 or r == 1):
                return f"node {node.name!r} (MatMul) contracts axis {a} of its second input"
            if i == 1 and a == r - 1:
                targets.add(R - 1)
            elif i == 0 and ra == 1:
                return f"node {node.name!r} (MatMul) contracts its 1-D first input"
            else:
                targets.add(a + R - r)
        if len(targets) != 1:
            return f"node {node.name!r} (MatMul): inputs split on different axes"
        o = targets.pop()
        req = []
        for i, name in enumerate(ins):
            r = ra if i == 0 else rb
            if o == R - 1:
                req.append(r - 1 if i == 1 else None)
            elif o == R - 2 and ra >= 2:
                req.append(ra - 2 if i == 0 else None)
            else:
                ax = o - (R - r)
                req.append(ax if ax >= 0 and ax < r - 2 and view.shape(name)[ax] != 1 else None)
        return req, [o]
    if op == "Gemm":
        if i0 == 0 and a0 == (1 if attr(node, "transA", 0) else 0):
            return [a0 if i == 0 else None for i in range(len(ins))], [0]
        return f"node {node.name!r} (Gemm) contracts or splits axis {a0} of input {i0}"
    if op == "Transpose":
        rin = view.rank(ins[0])
        perm = list(attr(node, "perm", list(range(rin))[::-1]))
        return ([a0], [perm.index(a0)]) if i0 == 0 else f"node {node.name!r}: bad input"
    if op == "Reshape":
        if i0 != 0:
            return f"node {node.name!r} (Reshape): split shape input"
        j = reshape_map(view.shape(ins[0]), view.shape(outs[0]), a0, shards)
        if j is None:
            return f"node {node.name!r} (Reshape) mixes split axis {a0} with other axes"
        return [a0, None], [j]
    if op == "Flatten":
        f = _norm(attr(node, "axis", 1), view.rank(ins[0]))
        if a0 == 0 and f >= 1:
            return same_all(0)
        if a0 == f:
            return [a0], [1]
        return f"node {node.name!r} (Flatten) merges split axis {a0} into a larger axis"
    if op in ("Squeeze", "Unsqueeze"):
        rin = view.rank(ins[0])
        axes = _int_list(view, node, "axes", 1)
        if op == "Squeeze":
            if axes is None:
                axes = [i for i, d in enumerate(view.shape(ins[0])) if d == 1]
            axes = [_norm(x, rin) for x in axes]
            if a0 in axes:
                return f"node {node.name!r} (Squeeze) removes split axis {a0}"
            o = a0 - sum(1 for x in axes if x < a0)
        else:
            if axes is None:
                return f"node {node.name!r} (Unsqueeze): axes are not constant"
            axes = sorted(_norm(x, R) for x in axes)
            o = a0
            for x in axes:
                if x <= o:
                    o += 1
        return [a0] + [None] * (len(ins) - 1), [o]
    if op == "Concat":
        c = _norm(attr(node, "axis", 0), R)
        axes = {a for _, a in split}
        if len(axes) != 1 or c in axes:
            return f"node {node.name!r} (Concat) joins along split axis {c}"
        a = axes.pop()
        return [a if n else None for n in ins], [a]
    if op == "Split":
        c = _norm(attr(node, "axis", 0), view.rank(ins[0]))
        if c == a0 or i0 != 0:
            return f"node {node.name!r} (Split) splits along split axis {c}"
        return [a0] + [None] * (len(ins) - 1), [a0] * len(outs)
    if op == "Slice":
        if i0 != 0:
            return f"node {node.name!r} (Slice): split index input"
        rin = view.rank(ins[0])
        starts, ends = _int_list(view, node, "starts", 1), _int_list(view, node, "ends", 2)
        axes = _int_list(view, node, "axes", 3) or list(range(len(starts or [])))
        if starts is None or ends is None:
            return f"node {node.name!r} (Slice): starts/ends are not constant"
        for ax, s, e in zip(axes, starts, ends):
            if _norm(ax, rin) == a0 and not (s == 0 and e >= view.shape(ins[0])[a0]):
                return f"node {node.name!r} (Slice) cuts split axis {a0}"
        return [a0] + [None] * (len(ins) - 1), [a0]
    if op == "Gather":
        g = _norm(attr(node, "axis", 0), view.rank(ins[0]))
        if i0 == 1:
            return [None, a0], [g + a0]
        if a0 == g:
            return f"node {node.name!r} (Gather) indexes along split axis {a0}"
        return [a0, None], [a0 if a0 < g else a0 + view.rank(ins[1]) - 1]
    if op in REDUCES or op in ("ArgMax", "ArgMin"):
        rin = view.rank(ins[0])
        keep = attr(node, "keepdims", 1)
        if op in ("ArgMax", "ArgMin"):
            axes = [_norm(attr(node, "axis", 0), rin)]
        else:
            axes = _int_list(view, node, "axes", 1)
            axes = list(range(rin)) if not axes else [_norm(x, rin) for x in axes]
        if a0 in axes:
            return f"node {node.name!r} ({op}) reduces split axis {a0}"
        o = a0 if keep else a0 - sum(1 for x in axes if x < a0)
        return [a0] + [None] * (len(ins) - 1), [o] * len(outs)
    if op in ("TopK", "CumSum", "LpNormalization"):
        ax = _norm(attr(node, "axis", -1 if op != "CumSum" else 0), view.rank(ins[0]))
        if op == "CumSum":
            c = _int_list(view, node, "__none__", 1)
            ax = _norm(c[0], view.rank(ins[0])) if c else ax
        if ax == a0:
            return f"node {node.name!r} ({op}) works along split axis {a0}"
        return [a0] + [None] * (len(ins) - 1), [a0] * len(outs)
    if op == "Pad":
        pads = _int_list(view, node, "pads", 1)
        rin = view.rank(ins[0])
        if pads is None:
            return f"node {node.name!r} (Pad): pads are not constant"
        paxes = _int_list(view, node, "__none__", 3) if len(ins) > 3 and ins[3] else list(range(rin))
        k = len(paxes)
        for j, ax in enumerate(paxes):
            if _norm(ax, rin) == a0 and (pads[j] or pads[j + k]):
                return f"node {node.name!r} (Pad) pads split axis {a0}"
        return [a0] + [None] * (len(ins) - 1), [a0]
    if op == "Resize":
        scales = _int_list(view, node, "__none__", 2) if len(ins) > 2 and ins[2] else None
        sc = view.const(ins[2]) if len(ins) > 2 and ins[2] else None
        if sc is not None and np.asarray(sc).size:
            if float(np.asarray(sc).reshape(-1)[a0]) != 1.0:
                return f"node {node.name!r} (Resize) rescales split axis {a0}"
        elif len(ins) > 3 and ins[3]:
            if view.shape(outs[0])[a0] != view.shape(ins[0])[a0]:
                return f"node {node.name!r} (Resize) resizes split axis {a0}"
        del scales
        return [a0] + [None] * (len(ins) - 1), [a0]
    if op == "Tile":
        reps = _int_list(view, node, "__none__", 1)
        if reps is None or reps[a0] != 1:
            return f"node {node.name!r} (Tile) repeats split axis {a0}"
        return [a0, None], [a0]
    if op in ("Shape", "Size"):
        return f"node {node.name!r} ({op}) reads the shape of a split tensor"
    return f"node {node.name!r}: no sharding rule for {op}"
