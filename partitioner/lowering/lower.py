"""Lowering (the mechanism): model + :class:`Plan` -> one local onnx-ir program per rank + :class:`Bindings`.

Rules:
1. Nodes are emitted in the model's topological order; each rank's program is that global order
   restricted to the rank, so comm ops meet in the same relative order on every rank (collectives
   rendezvous in order; a Send is always emitted before its Recv) and the programs cannot deadlock.
2. A node runs on every rank of its group with local shapes; each input is first brought into the
   layout the plan requires (``materialize``), cheapest first:
   same group: partial->whole AllReduce, partial->split ReduceScatter, split->whole AllGather,
   split(a)->split(b) AllToAll, whole->split a local Slice (no communication);
   another group: reduce partials on the source group, then each target rank receives exactly the
   slices it needs (Send/Recv, local Slice when source and target are the same rank) and concats.
3. Initializers are sliced at build time: each rank holds only its shard.
4. Shape-carrying inputs (Reshape/Expand/ConstantOfShape shapes, Resize sizes) and Conv ``group``
   are rewritten to the local shapes; ``bias_on_first`` drops the bias on all but the group's first
   rank; ``spatial`` exchanges halo rows with the neighbours and pads only at the true edges.
5. Every comm output and every intermediate carries its dtype and local shape; programs pass
   ``onnx.checker.check_model(full_check=True)``.
6. The programs stay in onnx-ir (``ir.Model``): the simulator and the verifier read them as they
   are, and they are serialised once, when the artifact is written (``compiler.build_artifact``);
   :attr:`LoweredProgram.programs` is that serialised form, made on first use.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Sequence

import numpy as np
import onnx
import onnx_ir as ir

from partitioner.core import comm_ops
from partitioner.core.bindings import Bindings, Placement, TensorBinding
from partitioner.core.errors import PlanError
from partitioner.core.model_view import ModelView, attr
from partitioner.core.plan import Plan, Sharding
from partitioner.cost.resharding import COMM_OP, conversion
from partitioner.lowering.lazy_weights import is_lazy, shard_reference
from partitioner.core.programs import outer_values, to_proto
from partitioner.lowering.subgraph_reads import clone_subgraphs, materialize_outer_reads
from passes.verify import check_programs, cross_rank_edge, verify_programs

__all__ = ["lower", "verify_programs", "check_programs", "LoweredProgram"]


@dataclass
class _Op:
    """One node of a rank's program before the program is built (by value name; the rank's
    ``ir.Node`` objects are made by :meth:`_Lowerer.build` once pruning has decided what stays)."""

    op_type: str
    inputs: list[str]
    outputs: list[str]
    attrs: dict[str, ir.Attr]
    name: str
    domain: str = ""
    source: ir.Node | None = None  # the model node this is a rank's copy of
    outer: dict[str, str] = field(default_factory=dict)  # subgraph reads: global name -> local name

    def reads(self) -> set[str]:
        return {i for i in self.inputs if i} | set(self.outer.values())


def _attrs(**kw: Any) -> dict[str, ir.Attr]:
    """Typed attributes (lists are INTS even when empty: the shape of a scalar); scalars sorted by
    name, then lists in the order given, as ``comm_ops.make_node`` writes them."""
    out: dict[str, ir.Attr] = {}
    for k, v in sorted(kw.items()):
        if isinstance(v, str):
            out[k] = ir.AttrString(k, v)
        elif not isinstance(v, (list, tuple)):
            out[k] = ir.AttrInt64(k, int(v))
    out.update((k, ir.AttrInt64s(k, [int(x) for x in v])) for k, v in kw.items() if isinstance(v, (list, tuple)))
    return out


@dataclass
class _Rank:
    nodes: list[_Op] = field(default_factory=list)
    inits: dict[str, ir.TensorProtocol] = field(default_factory=dict)
    infos: dict[str, tuple[int, tuple[int, ...]]] = field(default_factory=dict)
    inputs: list[str] = field(default_factory=list)
    outputs: list[str] = field(default_factory=list)
    names: set[str] = field(default_factory=set)
    comm: bool = False


@dataclass(frozen=True)
class LoweredProgram:
    models: tuple[ir.Model, ...]
    bindings: Bindings

    @cached_property
    def programs(self) -> tuple[onnx.ModelProto, ...]:
        """The programs serialised (rule 6), once, on first use."""
        return tuple(to_proto(m) for m in self.models)


def lower(model: ir.Model | ModelView, plan: Plan, *, verify: bool = True) -> LoweredProgram:
    """Lower ``plan`` on ``model`` (rules in the module docstring)."""
    view = model if isinstance(model, ModelView) else ModelView(model)
    out = _Lowerer(view, plan).run()
    if verify:
        verify_programs(out.models, out.bindings, model=view)
    return out


class _Emitter:
    """The per-rank program builder's primitives: fresh names, local shapes, and emitting nodes,
    initializers, slices, point-to-point transfers, collectives and concatenations on a rank."""

    def __init__(self, view: ModelView, plan: Plan) -> None:
        self.view, self.plan = view, plan
        self.ranks = [_Rank() for _ in range(plan.world_size)]
        self.cache: dict[tuple[str, Sharding], dict[int, str]] = {}
        self.produced: dict[str, Sharding] = {}
        self.counter = 0
        self.tag = 0

    # ---- names and shapes -------------------------------------------------------------------
    def fresh(self, base: str, kind: str) -> str:
        self.counter += 1
        return f"{base}__{kind}{self.counter}"

    def next_tag(self) -> int:
        self.tag += 1
        return self.tag

    def micro_shape(self, name: str) -> list[int]:
        shp = list(self.view.shape(name))
        m = self.plan.microbatches
        if m > 1 and name in self.plan.batch_axes:
            ax = self.plan.batch_axes[name]
            if shp[ax] % m:
                raise PlanError(f"value {name!r}: batch axis {ax} of size {shp[ax]} is not divisible by {m} micro-batches")
            shp[ax] //= m
        return shp

    def local_shape(self, name: str, s: Sharding) -> list[int]:
        shp = self.micro_shape(name)
        if s.axis is not None:
            n = len(s.ranks)
            if s.axis >= len(shp) or shp[s.axis] % n:
                raise PlanError(f"value {name!r} {shp}: axis {s.axis} cannot be split in {n} equal parts")
            shp[s.axis] //= n
        return shp

    def chunk(self, name: str, s: Sharding, k: int) -> tuple[int, int]:
        size = self.micro_shape(name)[s.axis] // len(s.ranks)
        return k * size, (k + 1) * size

    # ---- emission ---------------------------------------------------------------------------
    def emit(self, r: int, node: _Op, outs: Sequence[tuple[str, int, Sequence[int]]] = ()) -> None:
        rk = self.ranks[r]
        rk.nodes.append(node)
        if node.domain == comm_ops.DOMAIN:
            rk.comm = True
        for name, elem, shape in outs:
            rk.infos[name] = (elem, tuple(int(d) for d in shape))

    def comm(self, op: str, inputs: list[str], outputs: list[str], name: str, **attrs: Any) -> _Op:
        """A comm node, checked against the contract (:class:`comm_ops.CommOp`)."""
        comm_ops.CommOp(op, name, tuple(inputs), tuple(outputs), dict(attrs)).check()
        return _Op(op, inputs, outputs, _attrs(**attrs), name, comm_ops.DOMAIN)

    def add_init(self, r: int, base: str, array: np.ndarray | onnx.TensorProto | ir.TensorProtocol) -> str:
        rk = self.ranks[r]
        name = base if base not in rk.names else self.fresh(base, "w")
        rk.names.add(name)
        if isinstance(array, onnx.TensorProto):  # a lazy weight's reference (lowering/lazy_weights.py)
            array.name = name
            rk.inits[name] = ir.serde.TensorProtoTensor(array)
        elif isinstance(array, np.ndarray):
            rk.inits[name] = ir.tensor(np.asarray(array, order="C"), name=name)
        else:  # a whole model weight: shared, not copied
            rk.inits[name] = array
        return name

    def const_i64(self, r: int, base: str, values: Sequence[int]) -> str:
        return self.add_init(r, self.fresh(base, "c"), np.asarray(list(values), dtype=np.int64))

    def local_slice(self, r: int, src: str, elem: int, shape: list[int], box: dict[int, tuple[int, int]]) -> tuple[str, list[int]]:
        box = {ax: lh for ax, lh in box.items() if lh != (0, shape[ax])}
        if not box:
            return src, shape
        axes = sorted(box)
        out = self.fresh(src, "slice")
        new_shape = list(shape)
        for ax in axes:
            new_shape[ax] = box[ax][1] - box[ax][0]
        node = _Op("Slice", [src, self.const_i64(r, src, [box[a][0] for a in axes]),
                             self.const_i64(r, src, [box[a][1] for a in axes]), self.const_i64(r, src, axes)], [out], {}, out)
        self.emit(r, node, [(out, elem, new_shape)])
        return out, new_shape

    def p2p(self, src: int, dst: int, name: str, elem: int, shape: list[int]) -> str:
        tag = self.next_tag()
        self.emit(src, self.comm("Send", [name], [], f"send.{name}.to{dst}.t{tag}", peer=dst, tag=tag))
        out = self.fresh(name, f"from{src}_")
        self.emit(dst, self.comm("Recv", [], [out], f"recv.{out}", peer=src, tag=tag, shape=list(shape), dtype=elem),
                  [(out, elem, shape)])
        return out

    def collective(self, op: str, group: tuple[int, ...], names: dict[int, str], value: str, elem: int,
                   out_shape: list[int], **attrs) -> dict[int, str]:
        tag = self.next_tag()
        res = {}
        for r in group:
            out = self.fresh(value, op.lower())
            self.emit(r, self.comm(op, [names[r]], [out], f"{op.lower()}.{out}", group=list(group), tag=tag, **attrs),
                      [(out, elem, out_shape)])
            res[r] = out
        return res

    def concat(self, r: int, parts: list[str], axis: int, elem: int, shape: list[int], base: str) -> str:
        if len(parts) == 1:
            return parts[0]
        out = self.fresh(base, "cat")
        self.emit(r, _Op("Concat", parts, [out], _attrs(axis=axis), out), [(out, elem, shape)])
        return out

class _Resharder(_Emitter):
    """Layout conversion: a value in the layout it was produced in becomes the layout a consumer
    requires, with the comm ops :mod:`partitioner.cost.resharding` names (cached per value and
    layout, so a conversion is emitted once)."""

    def materialize(self, value: str, req: Sharding) -> dict[int, str]:
        key = (value, req)
        if key in self.cache:
            return self.cache[key]
        view = self.view
        if view.is_const(value):
            tensor = view.initializers[value].const_value
            if is_lazy(tensor):  # a weight still on disk: each rank gets a reference, no bytes
                res = {r: self.add_init(r, value, shard_reference(value, tensor, req.axis, k, len(req.ranks)))
                       for k, r in enumerate(req.ranks)}
                self.cache[key] = res
                return res
            if req.axis is None:  # whole on every rank: the model's tensor, shared
                res = {r: self.add_init(r, value, tensor) for r in req.ranks}
                self.cache[key] = res
                return res
            arr = view.const(value)
            res = {}
            for k, r in enumerate(req.ranks):
                piece = arr
                if req.axis is not None:
                    n = arr.shape[req.axis] // len(req.ranks)
                    piece = np.take(arr, range(k * n, (k + 1) * n), axis=req.axis)
                res[r] = self.add_init(r, value, piece)
            self.cache[key] = res
            return res
        src = self.produced.get(value)
        if src is None:
            raise PlanError(f"value {value!r} is used before it is produced (plan has no layout for it)")
        elem = view.elem_type(value)
        have = self.cache[(value, src)]
        if req.partial is not None:
            if req != src:
                raise PlanError(f"value {value!r}: a partial layout is required but {src.describe()} is produced")
            return have
        if src.ranks == req.ranks:
            res = self._same_group(value, src, req, have, elem)
        else:
            if src.partial is not None:
                whole = Sharding(src.ranks)
                have = self.materialize(value, whole)
                src = whole
            res = self._redistribute(value, src, req, have, elem)
        self.cache[key] = res
        return res

    def _same_group(self, value: str, src: Sharding, req: Sharding, have: dict[int, str], elem: int) -> dict[int, str]:
        """One group, two layouts: the collective :func:`partitioner.cost.resharding.conversion` names."""
        g = req.ranks
        out_shape = self.local_shape(value, req)
        kind = conversion(src, req)
        op = COMM_OP.get(kind or "")
        if kind == "allreduce":
            return self.collective(op, g, have, value, elem, out_shape, reduction=src.partial)
        if kind == "reducescatter":
            return self.collective(op, g, have, value, elem, out_shape, axis=req.axis, reduction=src.partial)
        if kind == "allgather":
            return self.collective(op, g, have, value, elem, out_shape, axis=src.axis)
        if kind == "alltoall":
            return self.collective(op, g, have, value, elem, out_shape, split_axis=req.axis, concat_axis=src.axis)
        # whole -> split: a local slice, no communication
        shape = self.local_shape(value, src)
        res = {}
        for k, r in enumerate(g):
            res[r], _ = self.local_slice(r, have[r], elem, shape, {req.axis: self.chunk(value, req, k)})
        return res

    def _redistribute(self, value: str, src: Sharding, req: Sharding, have: dict[int, str], elem: int) -> dict[int, str]:
        src_shape = self.local_shape(value, src)
        res = {}
        for j, t in enumerate(req.ranks):
            region = {req.axis: self.chunk(value, req, j)} if req.axis is not None else {}
            parts = []
            if src.axis is None:
                s = t if t in src.ranks else src.ranks[j % len(src.ranks)]
                sources = [(s, {})]
            else:
                sources = []
                for i, s in enumerate(src.ranks):
                    lo, hi = self.chunk(value, src, i)
                    if req.axis == src.axis:
                        rlo, rhi = region[req.axis]
                        a, b = max(lo, rlo), min(hi, rhi)
                        if a >= b:
                            continue
                        sources.append((s, {src.axis: (a - lo, b - lo)}))
                    else:
                        sources.append((s, {}))
            for s, box in sources:
                full_box = dict(box)
                for ax, lh in region.items():
                    if ax != src.axis:
                        full_box[ax] = lh
                name, shape = self.local_slice(s, have[s], elem, src_shape, full_box)
                parts.append(name if s == t else self.p2p(s, t, name, elem, shape))
            res[t] = self.concat(t, parts, src.axis if src.axis is not None else 0, elem,
                                 self.local_shape(value, req), value)
        return res

class _Lowerer(_Resharder):
    """The main loop: every node of the plan emitted on its ranks, then the bindings and one
    pruned, typed program per rank."""

    def run(self) -> LoweredProgram:
        view, plan = self.view, self.plan
        for name in view.inputs:
            s = plan.tensors.get(name)
            if s is None:
                raise PlanError(f"plan has no layout for graph input {name!r}")
            self.produced[name] = s
            self.cache[(name, s)] = {r: name for r in s.ranks}
            for r in s.ranks:
                rk = self.ranks[r]
                rk.inputs.append(name)
                rk.names.add(name)
                rk.infos[name] = (view.elem_type(name), tuple(self.local_shape(name, s)))
        for node in view.nodes:
            np_ = plan.nodes.get(node.name)
            if np_ is None:
                raise PlanError(f"plan has no placement for node {node.name!r} ({node.op_type})")
            self.emit_node(node, np_)
        bindings = self.bindings()
        return LoweredProgram(tuple(self.build(r) for r in range(plan.world_size)), bindings)

    def emit_node(self, node: ir.Node, np_) -> None:
        view = self.view
        ins, outs = view.node_inputs(node), view.node_outputs(node)
        if len(np_.inputs) != len(ins) or len(np_.outputs) != len(outs):
            raise PlanError(f"plan for node {node.name!r} lists {len(np_.inputs)} inputs/{len(np_.outputs)} outputs; "
                            f"the node has {len(ins)}/{len(outs)}")
        local_in: list[dict[int, str]] = []
        for name, req in zip(ins, np_.inputs):
            if not name:
                local_in.append({})
                continue
            if req is None or tuple(req.ranks) != tuple(np_.ranks):
                raise PlanError(f"node {node.name!r}: input {name!r} has no layout on the node's ranks {list(np_.ranks)}")
            local_in.append(self.materialize(name, req))
        outer_reads = materialize_outer_reads(self, node, tuple(np_.ranks))  # If/Loop subgraphs' reads
        sub_reads = set(outer_values(node))
        out_shapes = [self.local_shape(o, s) if s is not None else None for o, s in zip(outs, np_.outputs)]
        for k, r in enumerate(np_.ranks):
            inputs = [local_in[i][r] if n else "" for i, n in enumerate(ins)]
            outer = {n: loc for n, loc in zip(ins, inputs) if n in sub_reads} | outer_reads[r]
            op = _Op(node.op_type, inputs, list(outs), dict(node.attributes), node.name or "", node.domain, node, outer)
            if np_.rule == "bias_on_first" and k > 0 and len(op.inputs) > 2:
                del op.inputs[2:]
            if np_.rule == "spatial":
                self.spatial_inputs(node, np_, k, r, op)
            self.rewrite_shapes(node, op, r, out_shapes, np_)
            self.emit(r, op, [(o, view.elem_type(o), shp) for o, shp in zip(outs, out_shapes) if shp is not None and o])
            self.ranks[r].names.update(outs)
        for o, s in zip(outs, np_.outputs):
            if s is not None and o:  # "": an omitted optional output
                self.produced[o] = s
                self.cache[(o, s)] = {r: o for r in np_.ranks}

    def rewrite_shapes(self, node: ir.Node, op: _Op, r: int, out_shapes, np_) -> None:
        view = self.view
        outs = view.node_outputs(node)
        if not outs or out_shapes[0] is None:
            return
        changed = list(out_shapes[0]) != list(view.shape(outs[0]))
        slot = {"Reshape": 1, "Expand": 1, "ConstantOfShape": 0, "Resize": 3}.get(node.op_type)
        if slot is not None and changed and len(op.inputs) > slot and op.inputs[slot]:
            op.inputs[slot] = self.const_i64(r, f"{node.name}.shape", out_shapes[0])
        if node.op_type == "Conv" and int(attr(node, "group", 1)) > 1:
            w_in = self.ranks[r].inits.get(op.inputs[1])
            x_info = self.ranks[r].infos.get(op.inputs[0])
            if w_in is not None and x_info is not None:
                op.attrs["group"] = ir.AttrInt64("group", x_info[1][1] // int(w_in.shape[1]))

    def spatial_inputs(self, node: ir.Node, np_, k: int, r: int, op: _Op) -> None:
        """Halo exchange for a Conv/Pool whose H (axis 2) is split over the group (rule 4)."""
        from partitioner.strategies.propagate import halo_plan

        g = np_.ranks
        t = len(g)
        halo = halo_plan(self.view, node, t)
        if halo is None:
            raise PlanError(f"node {node.name!r}: H cannot be split in {t} parts with halos")
        x = self.view.node_inputs(node)[0]
        elem = self.view.elem_type(x)
        req = np_.inputs[0]
        shape = self.local_shape(x, req)
        ci = shape[2]
        have = self.cache[(x, req)]
        if k == 0:  # emit every rank's sends first (once per node), then each rank receives
            self._halo_recv = {}
            for j, s in enumerate(g):
                if j > 0 and halo.bottom[j - 1] > 0:  # rows rank j-1 needs from below: my first rows
                    n = halo.bottom[j - 1]
                    name, shp = self.local_slice(s, have[s], elem, shape, {2: (0, n)})
                    self._halo_recv[(j - 1, "bottom")] = self.p2p(s, g[j - 1], name, elem, shp)
                if j < t - 1 and halo.top[j + 1] > 0:  # rows rank j+1 needs from above: my last rows
                    n = halo.top[j + 1]
                    name, shp = self.local_slice(s, have[s], elem, shape, {2: (ci - n, ci)})
                    self._halo_recv[(j + 1, "top")] = self.p2p(s, g[j + 1], name, elem, shp)
        top, bot = halo.top[k], halo.bottom[k]
        mine, mshape = self.local_slice(r, have[r], elem, shape, {2: (max(0, -top), ci + min(0, bot))})
        parts = ([self._halo_recv[(k, "top")]] if top > 0 else []) + [mine] + \
                ([self._halo_recv[(k, "bottom")]] if bot > 0 else [])
        rows = mshape[2] + max(top, 0) + max(bot, 0)
        cat_shape = list(mshape)
        cat_shape[2] = rows
        op.inputs[0] = self.concat(r, parts, 2, elem, cat_shape, x)
        pads = list(attr(node, "pads", [0, 0, 0, 0]))
        pads[0], pads[2] = halo.pad_top[k], halo.pad_bottom[k]
        op.attrs["pads"] = ir.AttrInt64s("pads", pads)

    # ---- outputs, bindings, programs --------------------------------------------------------
    def bindings(self) -> Bindings:
        view, plan = self.view, self.plan
        ins = []
        for name in view.inputs:
            s = plan.tensors[name]
            ins.append(TensorBinding(name, tuple(view.shape(name)), str(view.np_dtype(name)), self.placements(name, s, None)))
        outs = []
        for name in view.outputs:
            s = self.produced.get(name)
            if s is None:
                raise PlanError(f"graph output {name!r} is not produced by any planned node")
            if s.partial is not None:
                s = Sharding(s.ranks)
            names = self.materialize(name, s)
            if s.axis is None:
                r = s.ranks[0]
                self.ranks[r].outputs.append(names[r])
                outs.append(TensorBinding(name, tuple(view.shape(name)), str(view.np_dtype(name)),
                                          (Placement(r, names[r]),)))
                continue
            for r in s.ranks:
                self.ranks[r].outputs.append(names[r])
            outs.append(TensorBinding(name, tuple(view.shape(name)), str(view.np_dtype(name)), self.placements(name, s, names)))
        return Bindings(tuple(ins), tuple(outs), plan.world_size, plan.microbatches)

    def placements(self, name: str, s: Sharding, names: dict[int, str] | None) -> tuple[Placement, ...]:
        out = []
        for k, r in enumerate(s.ranks):
            local = names[r] if names else name
            if s.axis is None:
                out.append(Placement(r, local))
            else:
                lo, hi = self.chunk(name, s, k)
                out.append(Placement(r, local, s.axis, lo, hi))
        return tuple(out)

    def prune(self, rk: _Rank) -> None:
        """Drop compute nodes whose outputs nothing on this rank reads (replicated tails)."""
        live = set(rk.outputs)
        kept: list[_Op] = []
        for node in reversed(rk.nodes):
            if node.domain == comm_ops.DOMAIN or any(o in live for o in node.outputs):
                kept.append(node)
                live.update(node.reads())
        rk.nodes = kept[::-1]
        rk.inits = {k: v for k, v in rk.inits.items() if k in live}

    def build(self, r: int) -> ir.Model:
        """Rank ``r``'s pruned program as an ``ir.Model`` (rule 6)."""
        rk = self.ranks[r]
        self.prune(rk)
        vals: dict[str, ir.Value] = {}

        def value(name: str) -> ir.Value:
            info = rk.infos.get(name)
            v = ir.Value(name=name) if info is None else \
                ir.Value(name=name, type=ir.TensorType(ir.DataType(info[0])), shape=ir.Shape(info[1]))
            if name:
                vals[name] = v
            return v

        inputs = [value(n) for n in rk.inputs]
        inits = [ir.Value(name=n, const_value=t, type=ir.TensorType(t.dtype), shape=ir.Shape(t.shape))
                 for n, t in rk.inits.items()]
        vals.update((v.name, v) for v in inits)
        nodes = [self.node(r, op, vals, value) for op in rk.nodes]
        outputs = [vals[n] for n in dict.fromkeys(rk.outputs)]
        opsets = {d: v for d, v in self.view.model.opset_imports.items() if d != comm_ops.DOMAIN}
        if rk.comm:
            opsets[comm_ops.DOMAIN] = comm_ops.VERSION
        graph = ir.Graph(inputs, outputs, nodes=nodes, initializers=inits, opset_imports=opsets,
                         name=f"{self.view.graph.name or 'model'}_rank{r}")
        return ir.Model(graph, ir_version=max(int(self.view.model.ir_version or 8), 8),
                        producer_name="partitioner.lower", functions=list(self.view.model.functions.values()),
                        metadata_props={"partitioner.rank": str(r)})

    @staticmethod
    def node(r: int, op: _Op, vals: dict[str, ir.Value], value: Any) -> ir.Node:
        """One ``ir.Node`` of rank ``r``: inputs bound to the rank's values, outputs typed, and
        the rank's own copy of any subgraph (:func:`subgraph_reads.clone_subgraphs`)."""
        missing = [n for n in op.reads() if n not in vals]
        if missing:  # the verifier's rule 7, met while building
            raise cross_rank_edge(r, op.name, op.op_type, missing[0])
        attrs = dict(op.attrs)
        src = op.source
        if src is not None:
            attrs.update(clone_subgraphs(src, {g: vals[loc] for g, loc in op.outer.items()}))
        return ir.Node(op.domain, op.op_type, [vals[n] if n else None for n in op.inputs], list(attrs.values()),
                       outputs=[value(o) for o in op.outputs], name=op.name,
                       version=src.version if src is not None else None,
                       overload=src.overload if src is not None else "",
                       doc_string=src.doc_string if src is not None else None,
                       metadata_props=dict(src.metadata_props) if src is not None and src.metadata_props else None)
