"""Sharding propagation: turn a per-node assignment (group, stage, mode) into a :class:`Plan`'s
node and tensor layouts. This is the one policy engine every strategy drives.

Modes (per node, on its ordered device group G of size t):

- ``replicate``: every input whole on every rank of G; outputs replicated.
- ``data``: split axes pass through (:func:`axis_rules.split_rule`); the graph inputs start split
  on the batch axis 0. A node that cannot run chunk-wise raises :class:`StrategyNotApplicable`.
- ``tensor``: Megatron-style rules. A 2-D constant weight after a whole or batch-split input
  (the batch is gathered first: the survey's "one weird trick") is split on its output features
  (column-parallel: output split on its last axis); after an input split on the
  contracted axis it is split on its input features (row-parallel: the output is a partial sum,
  reduced once, where a non-linear consumer first needs it: one AllReduce per pair). Conv splits
  output channels (then input channels: partial), depthwise Conv splits groups, Gather splits the
  embedding width; other ops pass a split through when :func:`split_rule` allows, else the
  inputs are gathered whole. Partial sums pass through views and Add/Sub of partials and
  Mul/Div by constants (linear), and are reduced before anything else.
- ``spatial``: like ``data`` with the graph inputs split on H (axis 2); Conv/MaxPool/AveragePool
  on a split H get halo exchange (rule ``spatial``); where H cannot stay split it is gathered.

A layout that would not divide a dimension evenly is never chosen: the inputs are gathered.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import onnx_ir as ir

from partitioner.core.errors import StrategyNotApplicable
from partitioner.core.model_view import ModelView, attr
from partitioner.core.plan import NodePlan, Sharding
from partitioner.strategies.axis_rules import VIEWS, split_rule

MODES = ("replicate", "data", "tensor", "spatial")
Rel = tuple  # (axis | None, partial | None)


@dataclass(frozen=True)
class Assignment:
    ranks: tuple[int, ...]
    stage: int = 0
    mode: str = "replicate"


def propagate(view: ModelView, assign: Mapping[str, Assignment],
              input_layouts: Mapping[str, Sharding]) -> tuple[dict[str, NodePlan], dict[str, Sharding]]:
    """Layouts for every node and value (see the module docstring)."""
    tensors: dict[str, Sharding] = dict(input_layouts)
    avail: dict[tuple[str, tuple[int, ...]], set[Rel]] = {}
    for name, s in input_layouts.items():
        avail.setdefault((name, s.ranks), set()).add((s.axis, s.partial))
    nodes: dict[str, NodePlan] = {}
    for node in view.nodes:
        a = assign[node.name]
        G, t = a.ranks, len(a.ranks)
        ins, outs = view.node_inputs(node), view.node_outputs(node)
        rel: list[Rel] = []
        for name in ins:
            if not name or view.is_const(name) or name not in tensors:
                rel.append((None, None))
                continue
            src = tensors[name]
            axis = src.axis if len(src.ranks) == t else None
            rel.append((axis, src.partial if src.ranks == G else None))
        if a.mode == "replicate" or t == 1:
            req: list[Rel] = [(None, None)] * len(ins)
            out: list[Rel] = [(None, None)] * len(outs)
            rule = "plain"
        elif a.mode == "data":
            req, out, rule = _data(view, node, rel, t)
        elif a.mode == "tensor":
            req, out, rule = _tensor(view, node, rel, t, {n: avail.get((n, G), set()) for n in ins if n})
        elif a.mode == "spatial":
            req, out, rule = _spatial(view, node, rel, t)
        else:
            raise StrategyNotApplicable(f"node {node.name!r}: unknown mode {a.mode!r}")
        in_sh = tuple(Sharding(G, r[0], r[1]) if n else None for n, r in zip(ins, req))
        out_sh = tuple(Sharding(G, r[0], r[1]) for r in out)
        nodes[node.name] = NodePlan(G, in_sh, out_sh, a.stage, rule)
        for n, s in zip(ins, in_sh):
            if n and s is not None:
                avail.setdefault((n, G), set()).add((s.axis, s.partial))
        for n, s in zip(outs, out_sh):
            tensors[n] = s
            avail.setdefault((n, G), set()).add((s.axis, s.partial))
    return nodes, tensors


def _divides(view: ModelView, names: list[str], axes: list, t: int) -> bool:
    for n, ax in zip(names, axes):
        if n and ax is not None and view.shape(n)[ax] % t:
            return False
    return True


def _gather(ins: list[str], outs: list[str]) -> tuple[list[Rel], list[Rel], str]:
    return [(None, None)] * len(ins), [(None, None)] * len(outs), "plain"


def _pass(view: ModelView, node: ir.Node, axes: list, t: int) -> tuple[list[Rel], list[Rel], str] | str:
    ins, outs = view.node_inputs(node), view.node_outputs(node)
    r = split_rule(view, node, axes, t)
    if isinstance(r, str):
        return r
    req, out = r
    if not _divides(view, ins, req, t) or not _divides(view, outs, out, t):
        return f"node {node.name!r} ({node.op_type}): a split dimension is not divisible by {t}"
    return [(x, None) for x in req], [(x, None) for x in out], "plain"


def _data(view, node, rel, t):
    r = _pass(view, node, [x[0] for x in rel], t)
    if isinstance(r, str):
        raise StrategyNotApplicable(f"data parallelism: {r}")
    return r


def _spatial(view, node, rel, t):
    ins, outs = view.node_inputs(node), view.node_outputs(node)
    axes = [x[0] for x in rel]
    op = node.op_type
    if axes and axes[0] == 2 and view.rank(ins[0]) == 4:
        if op in ("Conv", "MaxPool", "AveragePool") and halo_plan(view, node, t) is not None:
            return [(2, None)] + [(None, None)] * (len(ins) - 1), [(2, None)] + [(None, None)] * (len(outs) - 1), "spatial"
        if op == "ConvTranspose" and _pointwise_upsample(view, node) and _divides(view, outs, [2], t):
            return [(2, None)] + [(None, None)] * (len(ins) - 1), [(2, None)], "plain"
        if op == "Resize" and _nearest_integer_scale(view, node) and _divides(view, outs, [2], t):
            return [(2, None)] + [(None, None)] * (len(ins) - 1), [(2, None)], "plain"
    r = _pass(view, node, axes, t)
    return _gather(ins, outs) if isinstance(r, str) else r


def _pointwise_upsample(view: ModelView, node: ir.Node) -> bool:
    w = view.shape(view.node_inputs(node)[1])
    k = list(attr(node, "kernel_shape", w[2:]))
    s = list(attr(node, "strides", [1] * len(k)))
    pads = list(attr(node, "pads", [0] * 2 * len(k)))
    return (k == s and not any(pads) and not any(attr(node, "output_padding", []) or [])
            and all(d == 1 for d in attr(node, "dilations", [1] * len(k))) and attr(node, "auto_pad", "NOTSET") in ("NOTSET", b"NOTSET"))


def _nearest_integer_scale(view: ModelView, node: ir.Node) -> bool:
    mode = attr(node, "mode", "nearest")
    ctm = attr(node, "coordinate_transformation_mode", "half_pixel")
    if mode != "nearest" or ctm not in ("half_pixel", "asymmetric"):
        return False
    ins, outs = view.node_inputs(node), view.node_outputs(node)
    h_in, h_out = view.shape(ins[0])[2], view.shape(outs[0])[2]
    return h_out % h_in == 0


@dataclass(frozen=True)
class Halo:
    """Per rank k of a spatially split Conv/Pool: rows needed from the ranks above/below (may be
    negative: rows to drop) and the H padding the rank applies itself."""

    top: tuple[int, ...]
    bottom: tuple[int, ...]
    pad_top: tuple[int, ...]
    pad_bottom: tuple[int, ...]


def halo_plan(view: ModelView, node: ir.Node, t: int) -> Halo | None:
    """Halo sizes for splitting H of a Conv/MaxPool/AveragePool in t equal chunks, or None."""
    ins, outs = view.node_inputs(node), view.node_outputs(node)
    h_in, h_out = view.shape(ins[0])[2], view.shape(outs[0])[2]
    if h_in % t or h_out % t or attr(node, "auto_pad", "NOTSET") not in ("NOTSET", "VALID"):
        return None
    if attr(node, "ceil_mode", 0) or len(view.shape(ins[0])) != 4:
        return None
    if node.op_type == "Conv":
        k = list(attr(node, "kernel_shape", view.shape(ins[1])[2:]))
    else:
        k = list(attr(node, "kernel_shape"))
    s = list(attr(node, "strides", [1, 1]))
    d = list(attr(node, "dilations", [1, 1]))
    pads = list(attr(node, "pads", [0, 0, 0, 0]))
    ci, co = h_in // t, h_out // t
    tops, bots, pts, pbs = [], [], [], []
    for r in range(t):
        a, b = r * ci, (r + 1) * ci
        o0, o1 = r * co, (r + 1) * co
        lo = o0 * s[0] - pads[0]
        hi = (o1 - 1) * s[0] - pads[0] + (k[0] - 1) * d[0] + 1
        top, bot = a - max(lo, 0), min(hi, h_in) - b
        if abs(top) > ci or abs(bot) > ci or (r == 0 and top != 0) or (r == t - 1 and bot > 0):
            return None
        tops.append(top)
        bots.append(bot)
        pts.append(max(0, -lo))
        pbs.append(max(0, hi - h_in))
    # neighbours must agree: rows rank r needs from r+1 are rows r+1 sends
    return Halo(tuple(tops), tuple(bots), tuple(pts), tuple(pbs))


_LINEAR_VIEWS = VIEWS


def _tensor(view: ModelView, node: ir.Node, rel: list[Rel], t: int, avail: dict[str, set[Rel]]):
    ins, outs = view.node_inputs(node), view.node_outputs(node)
    op = node.op_type
    partial = [p for _, p in rel]
    axes = [a for a, _ in rel]
    nonconst = [i for i, n in enumerate(ins) if n and not view.is_const(n)]
    # 1. partial sums pass through linear ops
    if any(partial):
        linear = False
        if op in _LINEAR_VIEWS and partial[0] and all(not p for p in partial[1:]):
            linear = True
        elif op in ("Add", "Sub") and nonconst and all(partial[i] for i in nonconst) and len(nonconst) == len([n for n in ins if n]):
            linear = True
        elif op in ("Mul", "Div") and partial[0] and len(nonconst) == 1 and nonconst[0] == 0:
            linear = True
        if linear:
            req = [(None, partial[i]) if i in nonconst else (None, None) for i in range(len(ins))]
            return req, [(None, "sum")] * len(outs), "plain"
    # 2. prefer a whole copy that already exists (no new communication)
    for i, n in enumerate(ins):
        if n and axes[i] is not None and (None, None) in avail.get(n, set()) and op not in ("MatMul", "Gemm", "Conv"):
            axes[i] = None
    # 3. ops with weights
    if op == "MatMul" and len(ins) == 2 and view.is_const(ins[1]) and view.rank(ins[1]) == 2:
        return _matmul(view, node, axes, t)
    if op == "Gemm" and view.is_const(ins[1]) and not attr(node, "transA", 0):
        return _gemm(view, node, axes, t)
    if op in ("Conv", "ConvTranspose") and view.is_const(ins[1]):
        r = _conv(view, node, axes, t)
        if r is not None:
            return r
    if op == "Gather" and view.is_const(ins[0]) and view.rank(ins[0]) == 2 and axes[1] is None \
            and attr(node, "axis", 0) == 0 and view.shape(ins[0])[1] % t == 0:
        return [(1, None), (None, None)], [(view.rank(outs[0]) - 1, None)], "plain"
    r = _pass(view, node, axes, t)
    return _gather(ins, outs) if isinstance(r, str) else r


def _matmul(view, node, axes, t):
    ins, outs = view.node_inputs(node), view.node_outputs(node)
    ra, R = view.rank(ins[0]), view.rank(outs[0])
    K, N = view.shape(ins[1])
    a = axes[0]
    if a is None:
        if N % t == 0:
            return [(None, None), (1, None)], [(R - 1, None)], "plain"
        return _gather(ins, outs)
    if a == ra - 1:
        if K % t == 0:
            return [(a, None), (0, None)], [(None, "sum")], "plain"
        return _gather(ins, outs)
    if a == 0 and N % t == 0:
        # batch-split activations into a weight layer ("one weird trick"): gather the batch and
        # split the weight's columns, so each rank holds 1/t of the weights
        return [(None, None), (1, None)], [(R - 1, None)], "plain"
    r = _pass(view, node, [a, None], t)
    return _gather(ins, outs) if isinstance(r, str) else r


def _gemm(view, node, axes, t):
    ins, outs = view.node_inputs(node), view.node_outputs(node)
    trans_b = attr(node, "transB", 0)
    w = view.shape(ins[1])
    n_axis, k_axis = (0, 1) if trans_b else (1, 0)
    N, K = w[n_axis], w[k_axis]
    has_c = len(ins) > 2 and bool(ins[2])
    a = axes[0]
    if a is None or (a == 0 and N % t == 0):  # batch-split input: gather it, split the columns
        if N % t:
            return _gather(ins, outs)
        req = [(None, None), (n_axis, None)]
        if has_c:
            c = view.shape(ins[2])
            if not view.is_const(ins[2]) or (len(c) >= 1 and c[-1] not in (1, N)):
                return _gather(ins, outs)
            req.append((len(c) - 1, None) if len(c) >= 1 and c[-1] == N else (None, None))
        return req, [(1, None)], "plain"
    if a == 1:
        req = [(1, None), (k_axis, None)] + ([(None, None)] if has_c else [])
        return req, [(None, "sum")], "bias_on_first" if has_c else "plain"
    return [(0, None)] + [(None, None)] * (len(ins) - 1), [(0, None)], "plain"


def _conv(view, node, axes, t):
    ins, outs = view.node_inputs(node), view.node_outputs(node)
    group = int(attr(node, "group", 1))
    w = view.shape(ins[1])
    has_b = len(ins) > 2 and bool(ins[2])
    transpose = node.op_type == "ConvTranspose"
    c_in = view.shape(ins[0])[1]
    a = axes[0]
    if a == 0:
        return [(0, None)] + [(None, None)] * (len(ins) - 1), [(0, None)], "plain"
    if a not in (None, 1):
        return None
    if group > 1:
        # grouped/depthwise: split whole groups; input channels follow
        c_out = view.shape(outs[0])[1]
        if group % t or c_in % t or c_out % t or transpose:
            return None
        req = [(1, None), (0, None)] + ([(0, None)] if has_b else [])
        return req, [(1, None)], "plain"
    if a is None:
        c_out = w[1] if transpose else w[0]
        if c_out % t:
            return None
        req = [(None, None), (1 if transpose else 0, None)] + ([(0, None)] if has_b else [])
        return req, [(1, None)], "plain"
    if c_in % t:
        return None
    req = [(1, None), (0 if transpose else 1, None)] + ([(None, None)] if has_b else [])
    return req, [(None, "sum")], "bias_on_first" if has_b else "plain"


def input_layouts(view: ModelView, ranks: tuple[int, ...], axis: int | None) -> dict[str, Sharding]:
    """Every graph input on ``ranks``: split on ``axis`` when it divides evenly, else whole."""
    out = {}
    for n in view.inputs:
        shp = view.shape(n)
        ok = axis is not None and axis < len(shp) and shp[axis] % len(ranks) == 0 and len(ranks) > 1
        out[n] = Sharding(tuple(ranks), axis if ok else None)
    return out


def batch_axes(view: ModelView, shards: int) -> dict[str, int]:
    """Which axis of each value carries the batch (graph inputs: axis 0), for micro-batching.

    Raises StrategyNotApplicable (one line, naming the node) where the batch cannot be followed."""
    cache = view.__dict__.setdefault("_batch_axes_cache", {})
    if shards not in cache:
        try:
            cache[shards] = _batch_axes(view, shards)
        except StrategyNotApplicable as exc:
            cache[shards] = exc
    if isinstance(cache[shards], StrategyNotApplicable):
        raise cache[shards]
    return dict(cache[shards])


def _batch_axes(view: ModelView, shards: int) -> dict[str, int]:
    axes: dict[str, int] = {n: 0 for n in view.inputs if view.rank(n) >= 1}
    for n in view.inputs:
        if view.rank(n) >= 1 and view.shape(n)[0] % shards:
            raise StrategyNotApplicable(f"input {n!r}: batch {view.shape(n)[0]} is not divisible by {shards}")
    for node in view.nodes:
        ins, outs = view.node_inputs(node), view.node_outputs(node)
        given = [axes.get(n) if n else None for n in ins]
        r = split_rule(view, node, given, shards)
        if isinstance(r, str):
            raise StrategyNotApplicable(f"micro-batching: {r}")
        for n, want, have in zip(ins, r[0], given):
            # every micro-batch runs the same program: a value without a batch axis (a constant
            # that is full-size on the batch axis) would need a different slice per micro-batch
            if n and want is not None and have is None:
                raise StrategyNotApplicable(f"micro-batching: node {node.name!r} needs {n!r} sliced on axis "
                                            f"{want}, but it has no batch axis (a constant the size of the batch)")
        for n, ax in zip(outs, r[1]):
            if ax is not None:
                if view.shape(n)[ax] % shards:
                    raise StrategyNotApplicable(f"micro-batching: value {n!r} axis {ax} is not divisible by {shards}")
                axes[n] = ax
    for n in view.outputs:
        # bindings rule 1: micro-batches are cut and reassembled along axis 0 of every output
        if axes.get(n) != 0:
            where = "carries no batch axis" if axes.get(n) is None else f"carries the batch on axis {axes[n]}, not 0"
            raise StrategyNotApplicable(f"micro-batching: output {n!r} {where}")
    return axes


def assign_all(view: ModelView, ranks: tuple[int, ...], mode: str, stage: int = 0) -> dict[str, Assignment]:
    a = Assignment(tuple(ranks), stage, mode)
    return {n.name: a for n in view.nodes}

