"""A data-parallel rank's optimizer update sharded over the ranks of one node (overlap rule 11).

Rules:

1. For: a TVM data rank whose step ends with one AllReduce run whose results the communicator
   lends (views of its shared window, :mod:`partitioner.runtime.comm_mpi` rule 11: each reduced
   gradient lies whole in the slot of the one member that reduced it) followed by the optimizer
   update (every node in :data:`partitioner.training.overlap.ELEMENTWISE_OPS`). Instead of every
   rank updating every weight from all the reduced gradients (the zoo resnet: 45 MiB of weights
   read, gradients read, weights written, per rank per step, 8-20 ms of its step), each rank
   updates only the weights whose gradients it reduced (its ``1/R``: ZeRO-1's sharded update)
   and writes them into state every member of the node sees (comm_mpi rule 12), so no all-gather
   copies anything: a barrier after the update, and the next step's forward reads the weights
   there. The state the update keeps per weight (momentum's velocity, Adam's ``m`` and ``v``)
   lives there too, so every rank's state stays whole (checkpoints, ``--resume``); a value no
   gradient feeds (Adam's step count) every rank computes for itself.
2. :func:`plan` accepts an update only when every output depends on at most one of the run's
   gradients (the weights partition by gradient, as the reduction does) and writing an output
   ``X.next`` over ``X`` (in place: from the second step the state fed in *is* the shared array)
   cannot change a value read later: no node after the one producing ``X.next`` reads ``X``.
   Otherwise, or when a gradient was not lent (below the window's size, a step output copied),
   the rank runs the full update library (overlap rule 9): every rank decides alike.
3. The update runs in numpy, node by node over whole arrays (the same float32 operations in the
   same order as the ONNX graph; equal to TVM's kernels within rounding), one gradient's nodes
   at a time; weight-sized intermediates take buffers from a pool reused across weights (sized
   by liveness, SGD: one), and the node producing an output writes straight into its shared
   array. Measured (one core, 33.75 MiB of SGD update, load 4.6): whole arrays 4.7 ms, against
   5.2 / 7.7 / 15.3 ms in blocks of 256Ki / 64Ki / 16Ki elements (the Python per node and block
   costs more than the cache saves); the full fused TVM update of the zoo resnet's 45 MiB is
   about 9 ms of a data rank's step.
4. Ordering: every member has passed the run's AllReduce, hence finished its backward, before any
   member writes (the reduction's closing barrier), so no rank still reads the weights it
   overwrites; the barrier after the update keeps the next forward from reading a weight
   before its owner wrote it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
from onnx import numpy_helper

_UFUNCS = {"Add": np.add, "Sub": np.subtract, "Mul": np.multiply, "Div": np.divide, "Pow": np.power,
           "Sqrt": np.sqrt, "Neg": np.negative}


@dataclass
class ShardedUpdate:
    """Rule 1's plan for one update segment (built by :func:`plan`)."""

    group: tuple[int, ...]
    outputs: tuple[str, ...]
    shared: tuple[str, ...]  # the outputs written into the shared state (fed by one gradient)
    private: list[onnx.NodeProto]  # nodes no gradient feeds: every rank runs them
    by_grad: dict[str, list[onnx.NodeProto]]  # a gradient's nodes, in graph order
    consts: dict[str, np.ndarray]
    base: dict[str, str]  # shared output -> the input it replaces (the state fed in)
    last_use: dict[str, int] = field(default_factory=dict)
    pool: list[np.ndarray] = field(default_factory=list)
    steps: int = 0  # sharded updates run (the tests read it)

    def run(self, env: Mapping[str, np.ndarray], comm: Any) -> dict[str, np.ndarray] | None:
        """The update's outputs by name, or None when a gradient was not lent
        (rule 2: the caller runs the full update)."""
        owners = {g: comm.lent_owner(self.group, env[g]) for g in self.by_grad}
        if any(o is None for o in owners.values()):
            return None
        me = list(self.group).index(comm.rank)
        targets = dict(zip(self.shared, comm.shared_arrays(self.group, "sharded-update",
                                                           [env[self.base[o]] for o in self.shared])))
        vals: dict[str, np.ndarray] = dict(self.consts)
        for node in self.private:
            vals[node.output[0]] = self._apply(node, vals, env, None)
        for g, nodes in self.by_grad.items():
            if owners[g] == me:
                self._run_nodes(nodes, vals, env, targets)
        comm.node_barrier(self.group)  # rule 4: every owner wrote its part
        self.steps += 1
        return {o: targets[o] if o in targets else vals[o] for o in self.outputs}

    def _run_nodes(self, nodes: list[onnx.NodeProto], vals: dict[str, np.ndarray],
                   env: Mapping[str, np.ndarray], targets: dict[str, np.ndarray]) -> None:
        """One gradient's nodes; weight-sized intermediates in pooled buffers (rule 3)."""
        free = list(range(len(self.pool)))
        held: dict[str, int] = {}
        for k, node in enumerate(nodes):
            name = node.output[0]
            out = targets.get(name)
            if out is None:
                args = [self._get(i, vals, env) for i in node.input]
                shape, dtype = np.broadcast_shapes(*(np.shape(a) for a in args)), np.result_type(*args)
                size = int(np.prod(shape))
                if size > 1:
                    if not free:
                        self.pool.append(np.empty(0, dtype))
                        free.append(len(self.pool) - 1)
                    slot = free.pop()
                    if self.pool[slot].size < size or self.pool[slot].dtype != dtype:
                        self.pool[slot] = np.empty(size, dtype)
                    held[name] = slot
                    out = self.pool[slot][:size].reshape(shape)
            vals[name] = self._apply(node, vals, env, out)
            for i in set(node.input):  # liveness: a buffer whose value is read for the last time
                if i in held and self.last_use.get(i) == id(node) and i not in targets:
                    free.append(held.pop(i))
        for name in held:
            vals.pop(name, None)

    @staticmethod
    def _get(name: str, vals: Mapping[str, np.ndarray], env: Mapping[str, np.ndarray]) -> np.ndarray:
        return vals[name] if name in vals else env[name]

    def _apply(self, node: onnx.NodeProto, vals: Mapping[str, np.ndarray], env: Mapping[str, np.ndarray],
               out: np.ndarray | None) -> np.ndarray:
        args = [self._get(i, vals, env) for i in node.input]
        if node.op_type == "Identity":
            if out is None:
                return np.array(args[0])
            np.copyto(out, args[0])
            return out
        fn = _UFUNCS[node.op_type]
        if out is None:
            return np.asarray(fn(*args))
        return fn(*args, out=out)


def plan(model: onnx.ModelProto, grads: Sequence[str], group: Sequence[int]) -> ShardedUpdate | None:
    """Rule 2: the sharded form of the update segment ``model`` whose gradient inputs are
    ``grads`` (the last AllReduce run's results), or None when it does not qualify."""
    from partitioner.training.overlap import ELEMENTWISE_OPS

    g = model.graph
    inputs = {i.name for i in g.input}
    outputs = tuple(o.name for o in g.output)
    grad_set = set(grads) & inputs
    feeds: dict[str, set[str]] = {n: {n} for n in grad_set}
    for node in g.node:
        if node.op_type not in ELEMENTWISE_OPS or node.domain not in ("", "ai.onnx") or len(node.output) != 1:
            return None
        feeds[node.output[0]] = set().union(*(feeds.get(i, set()) for i in node.input))
        if len(feeds[node.output[0]]) > 1:
            return None
    shared = tuple(o for o in outputs if feeds.get(o))
    base = {o: o[:-len(".next")] for o in shared if o.endswith(".next")}
    if not shared or len(base) != len(shared) or not set(base.values()) <= inputs:
        return None
    order = {n.output[0]: k for k, n in enumerate(g.node)}
    for o, x in base.items():  # rule 2: no later node reads X once X.next was written over it
        if any(x in n.input for n in g.node[order[o] + 1:]):
            return None
    # a node no gradient feeds joins the one gradient its readers serve (momentum's ``mu v``);
    # one read by several (Adam's bias corrections: scalars) every rank runs for itself
    serves = {n.output[0]: set(feeds[n.output[0]]) for n in g.node}
    for node in reversed(g.node):
        if not feeds[node.output[0]]:
            readers = [serves[m.output[0]] for m in g.node if node.output[0] in m.input]
            serves[node.output[0]] = set().union(*readers) if readers else set()
    group_of = {o: next(iter(v)) if len(v) == 1 else None for o, v in serves.items()}
    up = ShardedUpdate(tuple(int(r) for r in group), outputs, shared,
                       [n for n in g.node if group_of[n.output[0]] is None], {},
                       {t.name: numpy_helper.to_array(t) for t in g.initializer}, base)
    for node in g.node:
        if group_of[node.output[0]] is not None:
            up.by_grad.setdefault(group_of[node.output[0]], []).append(node)
        for i in node.input:
            up.last_use[i] = id(node)
    return up
