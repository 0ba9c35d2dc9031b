"""Gradients of tensor parallelism's comm pair (Megatron's f and g).

- ``partitioner.comm.AllReduce`` (sum; Megatron's g after a row-parallel product): every rank
  holds the whole, replicated gradient of the reduced value, so each partial's gradient is that
  same value: the identity.
- f (before a column-parallel product) is an ``Identity`` node named ``tp.f.*`` by the tensor
  rewrite (:mod:`partitioner.training.tensor`); its gradient is the AllReduce (sum) of the
  ranks' partial input gradients (each rank's gradient covers only its column shard).
"""

from __future__ import annotations

import onnx_ir as ir

from partitioner.core.comm_ops import DOMAIN
from partitioner.training.autodiff import FORWARD_NODE_KEY, GradContext, register_gradient

F_PREFIX = "tp.f."
F_TAG_BASE = 8000


@register_gradient(f"{DOMAIN}.AllReduce")
def allreduce_sum(g: GradContext) -> list:
    if g.attr("reduction", "sum") != "sum":
        raise NotImplementedError("only a sum AllReduce has a gradient rule")
    return [g.dy[0]]


def f_backward(g: GradContext) -> ir.Value:
    """The AllReduce (sum, over the f node's group) of f's incoming gradient."""
    node = g.node
    group = [int(r) for r in node.metadata_props.get("training.tensor_group", "").split(",") if r]
    em = g.em
    em._count += 1
    index = int(node.name[len(F_PREFIX):]) if node.name[len(F_PREFIX):].isdigit() else em._count
    comm = ir.Node(DOMAIN, "AllReduce", [g.dy[0]], attributes=ir.convenience.convert_attributes(
        {"group": group, "reduction": "sum", "tag": F_TAG_BASE + index}), num_outputs=1,
        name=f"grad.{node.name}.allreduce", metadata_props={FORWARD_NODE_KEY: node.name})
    out = comm.outputs[0]
    out.name = f"{node.name}.grad_sum"
    out.shape = ir.Shape(g.shape(node.inputs[0]))
    out.type = ir.TensorType(g.dy[0].dtype or node.inputs[0].dtype)
    em.graph.append(comm)
    return out
