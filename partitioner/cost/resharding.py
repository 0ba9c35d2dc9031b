"""The one resharding table: how a value moves from the layout it is produced in to the layout a
consumer requires. The strategies' estimates (:func:`partitioner.strategies.costing.estimate`)
charge it and the lowering (:mod:`partitioner.lowering.lower`) emits it, so the two agree by
construction.

Table (``src`` produced, ``req`` required; a layout is whole, split on an axis, or partial):

===========================  ======================  ==========================
same ranks, ``src``           ``req`` whole            ``req`` split on an axis
===========================  ======================  ==========================
partial (pending reduction)   ``allreduce``            ``reducescatter``
split on an axis              ``allgather``            ``alltoall``
whole                         (nothing)                ``slice`` (local, no comm)
===========================  ======================  ==========================

Different rank groups: ``send`` (point-to-point, after reducing a partial value on its own
group). Equal layouts: nothing (None).
"""

from __future__ import annotations

from partitioner.core.plan import Sharding

#: conversion kind -> the comm op (domain ``partitioner.comm``) the lowering emits for it.
COMM_OP = {"allreduce": "AllReduce", "reducescatter": "ReduceScatter", "allgather": "AllGather",
           "alltoall": "AllToAll", "send": "Send"}


def conversion(src: Sharding, req: Sharding) -> str | None:
    """The table above: None, ``slice``, ``send`` or a collective's kind (as in :data:`COMM_OP`)."""
    if src == req:
        return None
    if src.ranks == req.ranks:
        if src.partial is not None:
            return "allreduce" if req.axis is None else "reducescatter"
        if src.axis is not None:
            return "allgather" if req.axis is None else "alltoall"
        return "slice" if req.axis is not None else None
    return "send"


def communicates(kind: str | None) -> bool:
    """Whether a conversion moves data between ranks (``slice`` and None do not)."""
    return kind is not None and kind != "slice"
