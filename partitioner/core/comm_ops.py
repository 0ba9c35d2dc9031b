"""The communication operators: domain ``partitioner.comm``, version 1.

They are ordinary ONNX nodes with side effects, so a per-rank program stays a valid ONNX model
(Netron opens it). Dead-code elimination and CSE must keep them as they are.

Contract (attributes are ints unless said otherwise; ``group`` lists *global* ranks in order):

=============  ========  =======  ==================================================================
op             inputs    outputs  attributes and meaning
=============  ========  =======  ==================================================================
Send           x         (none)   peer, tag. Non-blocking send of x to ``peer``.
Recv           (none)    y        peer, tag, shape (ints), dtype (TensorProto elem type).
AllReduce      x         y        group, reduction (string: sum|max|min|prod), tag.
AllGather      x         y        group, axis, tag. y = concat(x of each member, axis) in group order.
ReduceScatter  x         y        group, axis, reduction, tag. Reduce, split along axis into
                                  len(group) equal chunks; the member at index i keeps chunk i.
AllToAll       x         y        group, split_axis, concat_axis, tag. Chunk j of x (split along
                                  split_axis) goes to group[j]; received chunks are concatenated
                                  along concat_axis in group order.
Broadcast      x | none  y        group, root, tag, shape, dtype. The root passes x; others have
                                  no input and receive root's x.
=============  ========  =======  ==================================================================

A Send matches the Recv with the same (source rank, destination rank, tag). Outputs of comm ops
carry ``value_info`` in the per-rank model, so shapes stay known without custom shape inference.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence

import numpy as np
import onnx
from onnx import helper

from partitioner.core.errors import VerifyError

DOMAIN = "partitioner.comm"
VERSION = 1
OPS = ("Send", "Recv", "AllReduce", "AllGather", "ReduceScatter", "AllToAll", "Broadcast")
COLLECTIVES = ("AllReduce", "AllGather", "ReduceScatter", "AllToAll", "Broadcast")
REDUCTIONS = ("sum", "max", "min", "prod")

_REQUIRED: dict[str, tuple[str, ...]] = {
    "Send": ("peer", "tag"),
    "Recv": ("peer", "tag", "shape", "dtype"),
    "AllReduce": ("group", "reduction", "tag"),
    "AllGather": ("group", "axis", "tag"),
    "ReduceScatter": ("group", "axis", "reduction", "tag"),
    "AllToAll": ("group", "split_axis", "concat_axis", "tag"),
    "Broadcast": ("group", "root", "tag", "shape", "dtype"),
}


def is_comm(node: Any) -> bool:
    """True for a NodeProto or onnx-ir Node in the comm domain."""
    return getattr(node, "domain", "") == DOMAIN


@dataclass(frozen=True)
class CommOp:
    """A parsed communication node: plain data, independent of the IR it came from."""

    op_type: str
    name: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    attrs: dict[str, Any] = field(default_factory=dict, hash=False, compare=True)

    @property
    def tag(self) -> int:
        return int(self.attrs["tag"])

    @property
    def group(self) -> tuple[int, ...]:
        return tuple(int(r) for r in self.attrs.get("group", ()))

    @property
    def np_dtype(self) -> np.dtype:
        return np.dtype(helper.tensor_dtype_to_np_dtype(int(self.attrs["dtype"])))

    @classmethod
    def from_node(cls, node: Any) -> CommOp:
        """Parse an ``onnx.NodeProto`` or an ``onnx_ir.Node``."""
        if isinstance(node, onnx.NodeProto):
            attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
            attrs = {k: (v.decode() if isinstance(v, bytes) else v) for k, v in attrs.items()}
            inputs, outputs = tuple(node.input), tuple(node.output)
        else:  # onnx_ir.Node
            attrs = {k: a.value for k, a in node.attributes.items()}
            inputs = tuple(v.name if v is not None else "" for v in node.inputs)
            outputs = tuple(v.name for v in node.outputs)
        attrs = {k: (list(v) if isinstance(v, (list, tuple)) else v) for k, v in attrs.items()}
        op = cls(node.op_type, node.name or "", inputs, outputs, attrs)
        op.check()
        return op

    def check(self) -> None:
        where = f"comm node {self.name!r} ({self.op_type})"
        if self.op_type not in OPS:
            raise VerifyError(f"{where}: unknown comm op; known: {', '.join(OPS)}")
        missing = [a for a in _REQUIRED[self.op_type] if a not in self.attrs]
        if missing:
            raise VerifyError(f"{where}: missing attribute(s) {', '.join(missing)}")
        if "reduction" in self.attrs and self.attrs["reduction"] not in REDUCTIONS:
            raise VerifyError(f"{where}: reduction must be one of {', '.join(REDUCTIONS)}")
        if self.op_type == "Send" and (len(self.inputs) != 1 or self.outputs):
            raise VerifyError(f"{where}: Send takes one input and has no outputs")
        if self.op_type == "Recv" and (self.inputs or len(self.outputs) != 1):
            raise VerifyError(f"{where}: Recv takes no input and has one output")
        if self.op_type in ("AllReduce", "AllGather", "ReduceScatter", "AllToAll") and (
            len(self.inputs) != 1 or len(self.outputs) != 1
        ):
            raise VerifyError(f"{where}: takes one input and has one output")


def make_node(op_type: str, inputs: Sequence[str], outputs: Sequence[str], *, name: str, **attrs: Any) -> onnx.NodeProto:
    """Build a comm ``NodeProto``; checks the attributes against the contract."""
    lists = {k: v for k, v in attrs.items() if isinstance(v, (list, tuple))}
    node = helper.make_node(op_type, list(inputs), list(outputs), name=name, domain=DOMAIN,
                            **{k: v for k, v in attrs.items() if k not in lists})
    # list attributes (shape, group) are integer lists; typed explicitly, since an empty list
    # (the shape of a scalar) has no element to infer the type from
    node.attribute.extend(helper.make_attribute(k, list(v), attr_type=onnx.AttributeProto.INTS)
                          for k, v in lists.items())
    CommOp.from_node(node)
    return node


def opset_import() -> onnx.OperatorSetIdProto:
    return helper.make_opsetid(DOMAIN, VERSION)


class Communicator(Protocol):
    """What a runtime provides to execute comm ops: numpy in, numpy out.

    Implemented by :mod:`partitioner.runtime.comm_local` (threads and queues, the oracle) and by
    the MPI communicator. Reductions run in group order, so results are deterministic.
    """

    rank: int
    world_size: int

    def send(self, x: np.ndarray, peer: int, tag: int) -> None: ...
    def recv(self, peer: int, tag: int, shape: Sequence[int], dtype: np.dtype) -> np.ndarray: ...
    def allreduce(self, x: np.ndarray, group: Sequence[int], reduction: str, tag: int) -> np.ndarray: ...
    def allgather(self, x: np.ndarray, group: Sequence[int], axis: int, tag: int) -> np.ndarray: ...
    def reduce_scatter(self, x: np.ndarray, group: Sequence[int], axis: int, reduction: str, tag: int) -> np.ndarray: ...
    def alltoall(self, x: np.ndarray, group: Sequence[int], split_axis: int, concat_axis: int, tag: int) -> np.ndarray: ...
    def broadcast(self, x: np.ndarray | None, group: Sequence[int], root: int, tag: int) -> np.ndarray: ...


def execute(op: CommOp, inputs: Sequence[np.ndarray | None], comm: Communicator) -> list[np.ndarray]:
    """Run one comm op on ``comm``. Returns the op's outputs (empty for Send)."""
    a = op.attrs
    t = op.op_type
    if t == "Send":
        comm.send(np.asarray(inputs[0], order="C"), int(a["peer"]), op.tag)
        return []
    if t == "Recv":
        return [comm.recv(int(a["peer"]), op.tag, [int(d) for d in a["shape"]], op.np_dtype)]
    if t == "AllReduce":
        return [comm.allreduce(inputs[0], op.group, a["reduction"], op.tag)]
    if t == "AllGather":
        return [comm.allgather(inputs[0], op.group, int(a["axis"]), op.tag)]
    if t == "ReduceScatter":
        return [comm.reduce_scatter(inputs[0], op.group, int(a["axis"]), a["reduction"], op.tag)]
    if t == "AllToAll":
        return [comm.alltoall(inputs[0], op.group, int(a["split_axis"]), int(a["concat_axis"]), op.tag)]
    if t == "Broadcast":
        x = inputs[0] if inputs and inputs[0] is not None else None
        return [comm.broadcast(x, op.group, int(a["root"]), op.tag)]
    raise VerifyError(f"comm node {op.name!r}: unknown op {t}")


def reduce_arrays(arrays: Sequence[np.ndarray], reduction: str) -> np.ndarray:
    """Reduce in the given (group) order: the fixed order makes results bit-reproducible."""
    fn = {"sum": np.add, "max": np.maximum, "min": np.minimum, "prod": np.multiply}[reduction]
    out = np.array(arrays[0], copy=True)
    # inf/NaN operands (a diverging training step) reduce to inf/NaN silently: the training loop
    # reports the NaN loss in one line; numpy's RuntimeWarning would add a second to stderr
    with np.errstate(invalid="ignore", over="ignore"):
        for arr in arrays[1:]:
            fn(out, arr, out=out)
    return out
