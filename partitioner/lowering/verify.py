"""Checks on lowered per-rank programs (the spec a valid lowering satisfies).

``verify_programs(programs, bindings, model=None)`` raises :class:`VerifyError` (one line, naming
ranks and ops) unless:

1. every value a rank's node reads is produced on that rank (graph input, initializer, node or
   comm output): a value crossing ranks must go through a comm op;
2. every Send has exactly one Recv with the same (source, destination, tag), shape and dtype;
3. the comm ops cannot deadlock: the ranks are simulated step by step with non-blocking Sends,
   blocking Recvs and collectives that need every group member at the same (group, tag);
4. the bindings cover every model input and output, and each placement names a graph
   input/output of its rank's program;
5. with ``model`` given: every model node runs on some rank (by node name).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Sequence

import onnx

from partitioner.core.bindings import Bindings
from partitioner.core.comm_ops import COLLECTIVES, CommOp, is_comm
from partitioner.core.errors import VerifyError
from partitioner.core.segments import node_reads


def _infos(p: onnx.ModelProto) -> dict[str, onnx.ValueInfoProto]:
    g = p.graph
    return {v.name: v for v in list(g.value_info) + list(g.input) + list(g.output)}


def _type_of(vi: onnx.ValueInfoProto) -> tuple[int, tuple[int, ...]]:
    t = vi.type.tensor_type
    return t.elem_type, tuple(d.dim_value for d in t.shape.dim)


def verify_programs(programs: Sequence[onnx.ModelProto], bindings: Bindings, *, model: Any = None) -> None:
    """See the module docstring."""
    if len(programs) != bindings.world_size:
        raise VerifyError(f"{len(programs)} programs for a world size of {bindings.world_size}")
    comm: list[list[CommOp]] = []
    sends: dict[tuple[int, int, int], list[tuple[int, tuple[int, ...]]]] = defaultdict(list)
    recvs: dict[tuple[int, int, int], list[tuple[int, tuple[int, ...]]]] = defaultdict(list)
    for r, p in enumerate(programs):
        g = p.graph
        known = {i.name for i in g.input} | {i.name for i in g.initializer}
        infos = _infos(p)
        ops = []
        for node in g.node:
            missing = [n for n in node_reads(node) if n not in known]
            if missing:
                raise VerifyError(f"rank {r}: node {node.name!r} ({node.op_type}) reads {missing[0]!r}, which is not "
                                  "produced on this rank: a cross-rank edge without a comm op")
            known.update(o for o in node.output if o)
            if is_comm(node):
                op = CommOp.from_node(node)
                ops.append(op)
                if op.op_type == "Send":
                    vi = infos.get(op.inputs[0])
                    if vi is None:
                        init = next((i for i in g.initializer if i.name == op.inputs[0]), None)
                        typ = (init.data_type, tuple(init.dims)) if init is not None else (0, ())
                    else:
                        typ = _type_of(vi)
                    sends[(r, int(op.attrs["peer"]), op.tag)].append(typ)
                elif op.op_type == "Recv":
                    recvs[(int(op.attrs["peer"]), r, op.tag)].append(
                        (int(op.attrs["dtype"]), tuple(int(d) for d in op.attrs["shape"])))
        missing_out = [o.name for o in g.output if o.name not in known]
        if missing_out:
            raise VerifyError(f"rank {r}: graph output {missing_out[0]!r} is never produced")
        comm.append(ops)
    for key in set(sends) | set(recvs):
        s, d, tag = key
        if len(sends.get(key, [])) != len(recvs.get(key, [])):
            raise VerifyError(f"Send/Recv mismatch from rank {s} to rank {d} tag {tag}: "
                              f"{len(sends.get(key, []))} send(s), {len(recvs.get(key, []))} recv(s)")
        for st, rt in zip(sends[key], recvs[key]):
            if st != rt:
                raise VerifyError(f"Send from rank {s} to rank {d} tag {tag} carries elem type {st[0]} shape {list(st[1])} "
                                  f"but the Recv expects elem type {rt[0]} shape {list(rt[1])}")
    simulate_comm(comm)
    _check_bindings(programs, bindings, model)


def simulate_comm(comm: Sequence[Sequence[CommOp]]) -> None:
    """Run the ranks' comm sequences (rule 3); raise VerifyError naming the stalled ranks and ops."""
    n = len(comm)
    pc = [0] * n
    mail: dict[tuple[int, int, int], int] = defaultdict(int)
    while True:
        progress = False
        for r in range(n):
            while pc[r] < len(comm[r]):
                op = comm[r][pc[r]]
                if op.op_type == "Send":
                    mail[(r, int(op.attrs["peer"]), op.tag)] += 1
                elif op.op_type == "Recv":
                    key = (int(op.attrs["peer"]), r, op.tag)
                    if mail[key] == 0:
                        break
                    mail[key] -= 1
                else:
                    break
                pc[r] += 1
                progress = True
        # collectives: fire when every member is waiting at the same (group, tag)
        waiting: dict[tuple[tuple[int, ...], int, str], list[int]] = defaultdict(list)
        for r in range(n):
            if pc[r] < len(comm[r]) and comm[r][pc[r]].op_type in COLLECTIVES:
                op = comm[r][pc[r]]
                if r not in op.group:
                    raise VerifyError(f"rank {r}: collective {op.name!r} does not list the rank in its group {list(op.group)}")
                waiting[(op.group, op.tag, op.op_type)].append(r)
        for (group, _tag, _t), members in waiting.items():
            if sorted(members) == sorted(group):
                for r in members:
                    pc[r] += 1
                progress = True
        if all(pc[r] == len(comm[r]) for r in range(n)):
            return
        if not progress:
            stuck = [f"rank {r} at {comm[r][pc[r]].op_type} {comm[r][pc[r]].name!r}" for r in range(n) if pc[r] < len(comm[r])]
            raise VerifyError(f"deadlock: {'; '.join(stuck)}")


def _check_bindings(programs: Sequence[onnx.ModelProto], bindings: Bindings, model: Any) -> None:
    bindings.check()
    for kind, items in (("input", bindings.inputs), ("output", bindings.outputs)):
        for b in items:
            for p in b.placements:
                g = programs[p.rank].graph
                names = {v.name for v in (g.input if kind == "input" else g.output)}
                if p.local_name not in names:
                    raise VerifyError(f"binding of {kind} {b.name!r}: rank {p.rank} has no graph {kind} {p.local_name!r}")
    if model is None:
        return
    need_in, need_out = set(model.inputs), set(model.outputs)
    have_in, have_out = {b.name for b in bindings.inputs}, {b.name for b in bindings.outputs}
    if need_in - have_in or need_out - have_out:
        raise VerifyError(f"bindings miss model input(s)/output(s): {sorted((need_in - have_in) | (need_out - have_out))}")
    ran = {n.name for p in programs for n in p.graph.node}
    lost = [n.name for n in model.nodes if n.name not in ran]
    if lost:
        raise VerifyError(f"{len(lost)} model node(s) run on no rank, e.g. {lost[0]!r}")
