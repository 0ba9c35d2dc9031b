"""Gradient buckets without the concatenation: a data-parallel ONNX Runtime rank's step program
with each bucket's AllReduce over its gradients as they are.

Rules:

1. The step program (:mod:`partitioner.training.step` rule 5) flattens each bucket's gradients
   (``Reshape(g, [-1])``), concatenates them, AllReduces the concatenation and splits the result
   back (``Split`` then ``Reshape`` to each weight's shape): two weight-sized copies per step that
   only serve the one-array AllReduce. :func:`unbucket` rewrites every such bucket into one
   ``AllReduce`` per member, each reading the gradient ``g`` itself and writing the name the
   final ``Reshape`` wrote, all with the bucket's tag and at the bucket AllReduce's place in the
   program; :func:`bucket_runs` finds those runs of consecutive AllReduce nodes of one tag, which
   :class:`partitioner.training.overlap.OverlappedExecutable` runs as one collective
   (``allreduce_list``, :mod:`partitioner.runtime.comm_mpi` rule 8). The results are
   bit-identical: each element gets the same additions in the same rank order.
2. A bucket whose shape differs from that pattern (a part that is not ``Reshape(g, [-1])``, a
   reduced value read by anything but the ``Split``, a split piece read by anything but one
   ``Reshape``) is left as it is.
3. For data-parallel ONNX Runtime and TVM ranks (:class:`partitioner.training.runner.StepRunner`).
   ONNX Runtime ranks run the rewritten program's segments as sessions
   (:class:`~partitioner.training.overlap.OverlappedExecutable`). The TVM VM calls a comm op
   with one tensor, so TVM ranks build one library per segment and AllReduce the list in place
   between them (:class:`~partitioner.training.overlap.TvmBucketedExecutable`, overlap rule
   7). :data:`LIST_ALLREDUCE` (default on) switches the rewrite for both;
   ``$PARTITIONER_TRAIN_LIST_ALLREDUCE=0`` turns it off (to measure the difference): TVM ranks
   then build the step as one library, each bucket concatenated, AllReduced and split inside it.
"""

from __future__ import annotations

import os

import onnx
from onnx import helper

from partitioner.core.comm_ops import DOMAIN

#: rule 3: rewrite data-parallel ranks' buckets into list AllReduces (docs/training.md)
LIST_ALLREDUCE = os.environ.get("PARTITIONER_TRAIN_LIST_ALLREDUCE", "1") != "0"


def _users(graph: onnx.GraphProto) -> dict[str, list[onnx.NodeProto]]:
    users: dict[str, list[onnx.NodeProto]] = {}
    for n in graph.node:
        for i in n.input:
            users.setdefault(i, []).append(n)
    return users


def _members(node: onnx.NodeProto, producer: dict[str, onnx.NodeProto], users: dict[str, list[onnx.NodeProto]],
             outputs: set[str]) -> tuple[list[tuple[str, str]], list[onnx.NodeProto]] | None:
    """Rule 1's (gradient, result name) pairs of one bucket AllReduce and the nodes they
    replace, or None when the bucket does not have rule 1's shape (rule 2)."""
    src = producer.get(node.input[0])
    parts = list(src.input) if src is not None and src.op_type == "Concat" else [node.input[0]]
    removed = [src] if src is not None and src.op_type == "Concat" else []
    grads = []
    for p in parts:
        r = producer.get(p)
        if r is None or r.op_type != "Reshape" or len(users.get(p, [])) != 1 or p in outputs:
            return None
        grads.append(r.input[0])
        removed.append(r)
    split_users = users.get(node.output[0], [])
    if len(split_users) != 1 or split_users[0].op_type != "Split" or len(split_users[0].output) != len(grads):
        return None
    split = split_users[0]
    names = []
    for piece in split.output:
        back = users.get(piece, [])
        if len(back) != 1 or back[0].op_type != "Reshape" or piece in outputs:
            return None
        names.append(back[0].output[0])
        removed.append(back[0])
    if node.output[0] in outputs or (src is not None and src.op_type == "Concat" and src.output[0] in outputs):
        return None
    return list(zip(grads, names)), removed + [split]


def unbucket(program: onnx.ModelProto) -> onnx.ModelProto:
    """Rule 1: ``program`` with every bucket's concatenation and split replaced by one AllReduce
    per gradient (a new model; ``program`` is left as it is)."""
    out = onnx.ModelProto()
    out.CopyFrom(program)
    g = out.graph
    producer = {o: n for n in g.node for o in n.output}
    users = _users(g)
    outputs = {o.name for o in g.output}
    replace: dict[int, list[onnx.NodeProto]] = {}
    drop: set[int] = set()
    for node in g.node:
        if node.domain != DOMAIN or node.op_type != "AllReduce":
            continue
        found = _members(node, producer, users, outputs)
        if found is None:
            continue
        pairs, removed = found
        attrs = {a.name: a for a in node.attribute}
        replace[id(node)] = [helper.make_node("AllReduce", [grad], [name], name=f"{node.name}.{k}", domain=DOMAIN)
                             for k, (grad, name) in enumerate(pairs)]
        for new in replace[id(node)]:
            new.attribute.extend(attrs.values())
        drop |= {id(n) for n in removed}
    nodes = []
    for n in g.node:
        if id(n) in replace:
            nodes += replace[id(n)]
        elif id(n) not in drop:
            nodes.append(n)
    del g.node[:]
    g.node.extend(nodes)
    return out


def bucket_runs(tags: list[int | None]) -> list[tuple[int, int]]:
    """Rule 1: the ``[start, end)`` runs of consecutive steps whose AllReduce tag is the same
    (``tags[i]``: step i's AllReduce tag, None for any other step); a run of one is a plain
    AllReduce."""
    runs = []
    i = 0
    while i < len(tags):
        j = i + 1
        if tags[i] is not None:
            while j < len(tags) and tags[j] == tags[i]:
                j += 1
        runs.append((i, j))
        i = j
    return runs
