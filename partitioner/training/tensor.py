"""Tensor-parallel (Megatron) training: MLP pairs split column then row, with f and g.

Rules (``tests/training/test_tensor_training.py`` checks them):

1. A *pair* is a product whose weight is an initializer (``MatMul``, or ``Gemm`` without
   ``transA``; the *column* product), then a region of nodes that act per column (its bias
   ``Add`` of a ``[N]`` initializer; elementwise ops whose other operands are scalar constants,
   such as GELU written with Erf) with at least one activation, then a second such product that
   reads the region (the *row* product) with ``N`` input features. No region value is used
   outside the region and the row product. Pairs do not overlap.
2. On rank r of R the column product keeps output features ``[r N/R, (r+1) N/R)`` of its weight
   (and bias), the row product the same rows of its weight. The row product's output is a partial
   sum: a ``partitioner.comm.AllReduce`` (sum) over the group follows it (Megatron's g), then the
   row Gemm's bias (``beta * C``), which every rank holds whole.
3. An ``Identity`` named ``tp.f.<k>`` (Megatron's f) feeds the column product: the identity
   forward, the AllReduce (sum) of the input gradient backward (each rank's gradient covers its
   column shard only). The AllReduce's gradient is the identity (:mod:`.rules.comm`).
4. Every rank runs the whole batch and computes the same loss; replicated weights get the same
   gradient on every rank (deterministic reductions), sharded ones their shard's gradient, so R
   ranks equal one rank of the same batch. The optimizer state of a sharded weight is sharded
   the same way; :meth:`TensorRunner.gather_state` rebuilds the 1-rank state (checkpoints).
5. A model without a pair whose ``N`` divides by R is refused (one line, exit 2).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir
from onnx import helper, numpy_helper

from partitioner.core.errors import UsageError
from partitioner.training.runner import StepRunner

UNARY = {"Relu", "LeakyRelu", "Gelu", "Tanh", "Sigmoid", "Erf"}
ELEMENTWISE = UNARY | {"Add", "Sub", "Mul", "Div", "Identity"}
GATHER_TAG = 31000
G_TAG_BASE = 8500


def _weight_axes(node: onnx.NodeProto) -> tuple[int, int]:
    """(output-feature axis, input-feature axis) of the product's weight."""
    trans_b = next((a.i for a in node.attribute if a.name == "transB"), 0) if node.op_type == "Gemm" else 0
    return (0, 1) if trans_b else (1, 0)


def _is_product(node: onnx.NodeProto, inits: Mapping[str, onnx.TensorProto]) -> bool:
    if node.op_type not in ("MatMul", "Gemm") or len(node.input) < 2 or node.input[1] not in inits:
        return False
    if node.op_type == "Gemm" and any(a.name == "transA" and a.i for a in node.attribute):
        return False
    return len(inits[node.input[1]].dims) == 2


def find_pairs(graph: onnx.GraphProto) -> list[tuple[onnx.NodeProto, list[onnx.NodeProto], onnx.NodeProto]]:
    """Rule 1: the (column, chain, row) pairs in graph order."""
    inits = {t.name: t for t in graph.initializer}
    users: dict[str, list[onnx.NodeProto]] = {}
    for n in graph.node:
        for i in n.input:
            users.setdefault(i, []).append(n)
    outputs = {o.name for o in graph.output}
    nodes = list(graph.node)
    pairs, used = [], set()
    for k, col in enumerate(nodes):
        if id(col) in used or not _is_product(col, inits):
            continue
        found = _chain_to_row(col, nodes[k + 1:], inits, users, outputs)
        if found is not None and id(found[1]) not in used:
            pairs.append((col, *found))
            used.update({id(col), id(found[1])})
    return pairs


def _chain_to_row(col: onnx.NodeProto, after: list[onnx.NodeProto], inits: Mapping[str, onnx.TensorProto],
                  users: Mapping[str, list[onnx.NodeProto]], outputs: set[str]) -> Any:
    """The per-column region after ``col`` (its bias Add, elementwise ops whose other operands are
    scalar constants) and the row product reading it; None when the region leaks or has no
    activation."""
    n_out = inits[col.input[1]].dims[_weight_axes(col)[0]]
    values, chain = {col.output[0]}, []
    for u in after:
        reads = [i for i in u.input if i in values]
        if not reads:
            continue
        others = [i for i in u.input if i and i not in values]
        if _is_product(u, inits) and u.input[0] in values and len(reads) == 1 \
                and inits[u.input[1]].dims[_weight_axes(u)[1]] == n_out:
            leaks = any(v in outputs or any(x is not u and x not in chain for x in users.get(v, []))
                        for v in values)
            return None if leaks or not any(c.op_type in UNARY for c in chain) else (chain, u)
        bias = (u.op_type == "Add" and col.op_type == "MatMul" and not chain and len(others) == 1
                and others[0] in inits and list(inits[others[0]].dims) == [n_out])
        scalars = all(i in inits and int(np.prod(inits[i].dims)) == 1 for i in others)
        if not (bias or (u.op_type in ELEMENTWISE and scalars)):
            return None
        chain.append(u)
        values.update(u.output)
    return None


def _slice(t: onnx.TensorProto, axis: int, rank: int, world: int) -> onnx.TensorProto:
    a = numpy_helper.to_array(t)
    k = a.shape[axis] // world
    return numpy_helper.from_array(np.ascontiguousarray(np.take(a, range(rank * k, (rank + 1) * k), axis=axis)), t.name)


def shard_axes(proto: onnx.ModelProto, world: int) -> dict[str, int]:
    """The sharded initializers and their split axis (rule 2); refuses a model with no pair."""
    inits = {t.name: t for t in proto.graph.initializer}
    axes: dict[str, int] = {}
    for col, chain, row in find_pairs(proto.graph):
        out_axis, _ = _weight_axes(col)
        if inits[col.input[1]].dims[out_axis] % world:
            continue
        axes[col.input[1]] = out_axis
        if col.op_type == "Gemm" and len(col.input) > 2 and col.input[2] in inits and len(inits[col.input[2]].dims) == 1 \
                and inits[col.input[2]].dims[0] == inits[col.input[1]].dims[out_axis]:
            axes[col.input[2]] = 0
        n_out = inits[col.input[1]].dims[out_axis]
        for c in chain:  # the column bias (scalar constants stay whole)
            axes.update({i: 0 for i in c.input if c.op_type == "Add" and i in inits and list(inits[i].dims) == [n_out]})
        axes[row.input[1]] = _weight_axes(row)[1]
    if not axes:
        raise UsageError(f"tensor training: no Megatron pair (product, per-column activation, product) whose hidden "
                         f"size divides by {world} in {proto.graph.name or 'the model'}; use --strategy data or "
                         "pipeline")
    return axes


def shard_forward(model: ir.Model, rank: int, world: int) -> ir.Model:
    """Rules 2-3 on rank ``rank``: the sharded weights, f before each column product, g after
    each row product."""
    from partitioner.core.comm_ops import DOMAIN, VERSION

    proto = ir.serde.serialize_model(model)
    g = proto.graph
    axes = shard_axes(proto, world)
    old_infos = {vi.name: vi for vi in list(g.value_info) + list(g.output)}
    for i, t in enumerate(g.initializer):
        if t.name in axes:
            g.initializer[i].CopyFrom(_slice(t, axes[t.name], rank, world))
    inits = {t.name: t for t in g.initializer}
    nodes, fixed_infos = list(g.node), []
    pairs = [p for p in find_pairs(g) if p[0].input[1] in axes]
    for k, (col, _chain, row) in enumerate(pairs):
        f_out = f"tp.f.{k}.out"
        nodes.insert(nodes.index(col), helper.make_node("Identity", [col.input[0]], [f_out], name=f"tp.f.{k}"))
        col.input[0] = f_out
        out = row.output[0]
        row.output[0] = f"{out}.partial"
        bias = row.input[2] if row.op_type == "Gemm" and len(row.input) > 2 and row.input[2] else None
        reduced = f"{out}.sum" if bias else out
        tail = [helper.make_node("AllReduce", [row.output[0]], [reduced], name=f"tp.g.{k}", domain=DOMAIN,
                                 group=list(range(world)), reduction="sum", tag=G_TAG_BASE + k)]
        if bias:
            beta = next((a.f for a in row.attribute if a.name == "beta"), 1.0)
            del row.input[2:]
            if beta != 1.0:
                inits[bias].CopyFrom(numpy_helper.from_array(numpy_helper.to_array(inits[bias]) * beta, bias))
            tail.append(helper.make_node("Add", [reduced, bias], [out], name=f"tp.g.{k}.bias"))
        at = nodes.index(row) + 1
        nodes[at:at] = tail
        info = onnx.ValueInfoProto()
        info.CopyFrom(old_infos[out])
        info.name = reduced
        fixed_infos.append(info)
    del g.node[:]
    g.node.extend(nodes)
    del g.value_info[:]
    g.value_info.extend(fixed_infos)
    if all(o.domain != DOMAIN for o in proto.opset_import):
        proto.opset_import.append(helper.make_opsetid(DOMAIN, VERSION))
    proto = onnx.shape_inference.infer_shapes(proto)
    out_model = ir.serde.deserialize_model(proto)
    for node in out_model.graph:
        if (node.name or "").startswith("tp.f."):
            node.metadata_props["training.tensor_group"] = ",".join(str(r) for r in range(world))
    return out_model


class TensorRunner(StepRunner):
    """One tensor-parallel rank: a :class:`StepRunner` of its sharded step that reads the whole
    batch and gathers the 1-rank state for checkpoints (rule 4)."""

    global_batch = True
    memory_pattern = True  # ONNX Runtime's memory pattern on (runner.MEMORY_PATTERN)
    memory_reuse = True  # and its buffer reuse (runner.MEMORY_REUSE)

    def __init__(self, step: Any, axes: Mapping[str, int], world: int, **kwargs: Any) -> None:
        self.axes = dict(axes)
        self.world = world
        full = kwargs.pop("state", None)
        super().__init__(step, **kwargs)
        if full is not None:  # a 1-rank state (resume): this rank's shard of it
            rank = self.comm.rank
            for name in self.state:
                axis = self.axes.get(_base(name))
                value = np.asarray(full[name])
                if axis is not None:
                    k = value.shape[axis] // world
                    value = np.take(value, range(rank * k, (rank + 1) * k), axis=axis)
                self.state[name] = np.ascontiguousarray(value.astype(self.state[name].dtype))

    def gather_state(self, runners: Sequence[TensorRunner]) -> dict[str, np.ndarray]:
        """The 1-rank state: shards concatenated (in process), or received by rank 0 (MPI)."""
        names = sorted(self.state)
        if len(runners) == self.world:
            return {n: (np.concatenate([r.state[n] for r in runners], axis=self.axes[_base(n)])
                        if _base(n) in self.axes else self.state[n]) for n in names}
        sharded = [n for n in names if _base(n) in self.axes]
        if self.comm.rank != 0:
            for i, n in enumerate(sharded):
                self.comm.send(np.ascontiguousarray(self.state[n]), 0, GATHER_TAG + i)
            if hasattr(self.comm, "flush"):
                self.comm.flush()
            return dict(self.state)
        out = dict(self.state)
        for i, n in enumerate(sharded):
            parts = [self.state[n]] + [self.comm.recv(r, GATHER_TAG + i, self.state[n].shape, self.state[n].dtype)
                                       for r in range(1, self.world)]
            out[n] = np.concatenate(parts, axis=self.axes[_base(n)])
        return out


def _base(name: str) -> str:
    """The weight a state entry belongs to (``W.m`` -> ``W``)."""
    for suffix in (".m", ".v", ".velocity"):
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def tensor_runners(model: Any, loss: str, optimizer: Any, *, batch: int, devices: int,
                   trainable: Sequence[str] | None, backend: str, comm: Any, out: os.PathLike[str] | None,
                   threads: int, state: Mapping[str, np.ndarray] | None) -> tuple[list[int], list[TensorRunner]]:
    """The training loop's runners for ``--strategy tensor`` (one MPI rank's, or every rank as an
    in-process thread's)."""
    from pathlib import Path

    from partitioner.training.step import build_training_graph

    axes = shard_axes(model if isinstance(model, onnx.ModelProto) else ir.serde.serialize_model(model), devices)

    def runner(rank: int, c: Any) -> TensorRunner:
        step = build_training_graph(model, loss=loss, optimizer=optimizer, batch=batch, trainable=trainable,
                                    forward_rewrite=lambda m: shard_forward(m, rank, devices))
        work = Path(out) / f"rank{rank}" if out is not None else None
        return TensorRunner(step, axes, devices, backend=backend, comm=c, workdir=work, threads=threads, state=state)

    if comm is not None:
        return [comm.rank], [runner(comm.rank, comm)]
    from partitioner.runtime.comm_local import LocalWorld

    world = LocalWorld(devices)
    return list(range(devices)), [runner(r, world.communicator(r)) for r in range(devices)]
