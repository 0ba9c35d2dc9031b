"""Which nodes have side effects: the communication operators and zero-output nodes.

Rule: a node is side-effecting when it is in the ``partitioner.comm`` domain (``Send``,
``Recv``, ``AllReduce``, ``AllGather``, ``ReduceScatter``, ``AllToAll``, ``Broadcast``: each one
is a rendezvous with other ranks, so removing or merging one on a single rank deadlocks the
others) or when it has no outputs (its only reason to exist is its effect).

Passes that delete or merge nodes (dead-code elimination, CSE) ask :func:`is_side_effecting`
first and leave such nodes alone.
"""

from __future__ import annotations

import onnx_ir as ir

from partitioner.core.comm_ops import DOMAIN as COMM_DOMAIN
from partitioner.core.comm_ops import OPS
from partitioner.core.comm_ops import VERSION as COMM_DOMAIN_VERSION

COMM_OP_TYPES: frozenset[str] = frozenset(OPS)


def is_comm_node(node: ir.Node) -> bool:
    """True when ``node`` is a communication operator (domain ``partitioner.comm``)."""
    return node.domain == COMM_DOMAIN


def is_side_effecting(node: ir.Node) -> bool:
    """True when ``node`` must never be removed or merged: a comm op, or a node with no outputs."""
    return is_comm_node(node) or len(node.outputs) == 0
