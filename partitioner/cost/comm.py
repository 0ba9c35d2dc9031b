"""Alpha-beta communication costs (COST_MODEL.md, "Communication").

Every row of the reference table is one function of (n, p, α, β, γ). What ``n`` means:

- point-to-point, allreduce, broadcast: n = the size of the tensor each rank holds (bytes).
- allgather: n = the *gathered total* (the output; each rank contributes n/p).
- reduce-scatter: n = the *input* each rank holds (each rank ends with n/p).
- all-to-all: n = the total bytes each rank sends (its whole input, including the part it keeps).
- parameter server: n = the model (gradient) size, s = number of server shards.

So for every collective, ``n`` is the full, unsharded tensor size as one rank sees it: the
larger of the op's per-rank input and output. :func:`collective_time` takes the same ``n``.

γ is the reduction compute per byte. The tree allreduce adds ⌈log₂p⌉·n·γ for its reductions (the
table leaves γ out of that row; with γ = 0 it is the table's formula). For p ≤ 1 every collective
costs nothing. The formulas are used for any p, also where MPICH needs an extra step for
non-powers of two (recursive doubling/halving, Rabenseifner).

Choosing: each ``*_time`` function returns (seconds, algorithm name) of the cheapest algorithm
for this n and p, as MPI libraries switch algorithms by size. :func:`collective_time` maps a
group of ranks onto a cluster: a group inside one node uses the intra-node level; a group that
spans nodes uses the inter-node level (the slowest spanned), except that allreduce also tries the
hierarchical scheme (reduce-scatter inside each node, allreduce across nodes on n/p_local bytes,
allgather inside each node) and keeps it when cheaper.

Shared-memory AllReduce (:func:`shm_allreduce_time`, ``SHM_ALLREDUCE`` on): an AllReduce of at
least ``SHM_MIN_BYTES`` over CPU ranks of one node is what the MPI runtime's rule 7 does
(:mod:`partitioner.runtime.comm_mpi`: each rank copies its array into its slot of a shared window,
reduces its 1/p of the elements over the p slots, copies the reduced elements out into a new
array, three barriers), so it is priced as those memory passes at the rank's calibrated memory
bandwidth plus three α, not as an α-β link: per rank, copy in (read n, write n), reduce (read n,
write n/p), copy out (read n, write n into a fresh array) = (5 + 1/p)·n bytes. Measured before
this rule: 16 MiB on 2 ranks of the 2-core EPYC took ~7.5 ms where the α-β link (~5 GB/s)
priced 2.5 ms. With ``SHM_OWN_PART`` (the runtime's rule 10: a rank reduces its own 1/p straight
from its input, so only the other (p-1)/p is copied in) the copy in is 2(p-1)/p·n bytes and the
whole (5 - 1/p)·n. A data-parallel step's last gradient bucket is lent (the runtime's rule 11: the
update reads the reduced gradients in the window, no copy out): :func:`shm_lent_saving` is the
2n bytes that saves, which the training model takes off that bucket (``SHM_LEND_LAST_BUCKET``).

``bytes_per_level`` counts the bytes put on the wire by all ranks of the group together, per link
level (a flat collective spanning nodes charges all its bytes to the inter-node level).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Sequence

if TYPE_CHECKING:  # annotations only: cluster.py builds on cost/, not the reverse
    from partitioner.cluster import Cluster, LinkLevel
from partitioner.core.errors import PlanError

#: the shared-memory AllReduce rule on (module docstring; off: every AllReduce on the α-β link)
SHM_ALLREDUCE = True
#: the runtime's rule 10 (``comm_mpi.SHM_OWN_PART_FROM_INPUT``): only (p-1)/p of the input copied in
SHM_OWN_PART = os.environ.get("PARTITIONER_SHM_OWN_PART", "1") != "0"
#: the runtime's lent last bucket (``overlap.LEND_LAST_BUCKET`` with ``comm_mpi.SHM_LEND_RESULTS``): a
#: data step's last gradient bucket is not copied out of the window (:func:`shm_lent_saving`)
SHM_LEND_LAST_BUCKET = (os.environ.get("PARTITIONER_TRAIN_LEND_LAST_BUCKET", "1") != "0"
                        and os.environ.get("PARTITIONER_SHM_LEND", "1") != "0")
#: the runtime's threshold for it (partitioner.runtime.comm_mpi.SHM_MIN_BYTES: no import, layering)
SHM_MIN_BYTES = 1 << 20
COLLECTIVES = ("send", "allreduce", "allgather", "reducescatter", "alltoall", "broadcast")


def clog2(p: int) -> int:
    """⌈log₂p⌉ (0 for p ≤ 1)."""
    return math.ceil(math.log2(p)) if p > 1 else 0


# ---- the table, one function per row --------------------------------------------------------

def p2p(n: float, alpha: float, beta: float) -> float:
    """Point-to-point: α + nβ."""
    return alpha + n * beta


def allreduce_ring(n: float, p: int, alpha: float, beta: float, gamma: float = 0.0) -> float:
    """2(p−1)α + 2n(p−1)/p·β + n(p−1)/p·γ (Patarasuk–Yuan)."""
    if p <= 1:
        return 0.0
    return 2 * (p - 1) * alpha + 2 * n * (p - 1) / p * beta + n * (p - 1) / p * gamma


def allreduce_rabenseifner(n: float, p: int, alpha: float, beta: float, gamma: float = 0.0) -> float:
    """Reduce-scatter + allgather: 2⌈log₂p⌉α + 2n(p−1)/p·β + n(p−1)/p·γ."""
    if p <= 1:
        return 0.0
    return 2 * clog2(p) * alpha + 2 * n * (p - 1) / p * beta + n * (p - 1) / p * gamma


def allreduce_recursive_doubling(n: float, p: int, alpha: float, beta: float, gamma: float = 0.0) -> float:
    """⌈log₂p⌉(α + nβ + nγ)."""
    if p <= 1:
        return 0.0
    return clog2(p) * (alpha + n * beta + n * gamma)


def allreduce_tree(n: float, p: int, alpha: float, beta: float, gamma: float = 0.0) -> float:
    """Reduce + broadcast on a binomial tree: 2⌈log₂p⌉(α + nβ) (+ ⌈log₂p⌉nγ for the reductions)."""
    if p <= 1:
        return 0.0
    return 2 * clog2(p) * (alpha + n * beta) + clog2(p) * n * gamma


def allreduce_lower_bound(n: float, p: int, alpha: float, beta: float) -> float:
    """No allreduce beats ⌈log₂p⌉α + 2n(p−1)/p·β."""
    if p <= 1:
        return 0.0
    return clog2(p) * alpha + 2 * n * (p - 1) / p * beta


def allgather_ring(n: float, p: int, alpha: float, beta: float) -> float:
    """(p−1)α + n(p−1)/p·β, n = gathered total."""
    if p <= 1:
        return 0.0
    return (p - 1) * alpha + n * (p - 1) / p * beta


def allgather_recursive_doubling(n: float, p: int, alpha: float, beta: float) -> float:
    """Recursive doubling / Bruck: ⌈log₂p⌉α + n(p−1)/p·β, n = gathered total."""
    if p <= 1:
        return 0.0
    return clog2(p) * alpha + n * (p - 1) / p * beta


def reducescatter_pairwise(n: float, p: int, alpha: float, beta: float, gamma: float = 0.0) -> float:
    """(p−1)α + n(p−1)/p·(β+γ), n = each rank's input."""
    if p <= 1:
        return 0.0
    return (p - 1) * alpha + n * (p - 1) / p * (beta + gamma)


def reducescatter_recursive_halving(n: float, p: int, alpha: float, beta: float, gamma: float = 0.0) -> float:
    """⌈log₂p⌉α + n(p−1)/p·(β+γ), n = each rank's input."""
    if p <= 1:
        return 0.0
    return clog2(p) * alpha + n * (p - 1) / p * (beta + gamma)


def broadcast_binomial(n: float, p: int, alpha: float, beta: float) -> float:
    """⌈log₂p⌉(α + nβ)."""
    if p <= 1:
        return 0.0
    return clog2(p) * (alpha + n * beta)


def broadcast_scatter_allgather(n: float, p: int, alpha: float, beta: float) -> float:
    """Scatter + ring allgather: (⌈log₂p⌉+p−1)α + 2n(p−1)/p·β."""
    if p <= 1:
        return 0.0
    return (clog2(p) + p - 1) * alpha + 2 * n * (p - 1) / p * beta


def alltoall_pairwise(n: float, p: int, alpha: float, beta: float) -> float:
    """(p−1)α + nβ, n = total bytes each rank sends."""
    if p <= 1:
        return 0.0
    return (p - 1) * alpha + n * beta


def alltoall_bruck(n: float, p: int, alpha: float, beta: float) -> float:
    """⌈log₂p⌉α + (n/2)⌈log₂p⌉β, n = total bytes each rank sends."""
    if p <= 1:
        return 0.0
    return clog2(p) * alpha + n / 2 * clog2(p) * beta


def parameter_server(n: float, p: int, s: int, alpha: float, beta: float) -> float:
    """p workers push and pull n bytes through s server shards: 2α + 2pnβ/s."""
    if p <= 0:
        return 0.0
    return 2 * alpha + 2 * p * n * beta / max(1, s)


# ---- algorithm choice -----------------------------------------------------------------------

_Alg = Callable[..., float]

ALLREDUCE: dict[str, _Alg] = {"ring": allreduce_ring, "rabenseifner": allreduce_rabenseifner,
                              "recursive_doubling": allreduce_recursive_doubling, "tree": allreduce_tree}
ALLGATHER: dict[str, _Alg] = {"ring": allgather_ring, "recursive_doubling": allgather_recursive_doubling}
REDUCESCATTER: dict[str, _Alg] = {"pairwise": reducescatter_pairwise,
                                  "recursive_halving": reducescatter_recursive_halving}
BROADCAST: dict[str, _Alg] = {"binomial": broadcast_binomial, "scatter_allgather": broadcast_scatter_allgather}
ALLTOALL: dict[str, _Alg] = {"pairwise": alltoall_pairwise, "bruck": alltoall_bruck}


def _cheapest(algs: dict[str, _Alg], *args: float) -> tuple[float, str]:
    best = min(((fn(*args), name) for name, fn in algs.items()), key=lambda t: t[0])
    return best


def allreduce_time(nbytes: float, p: int, level: LinkLevel, gamma: float = 0.0) -> tuple[float, str]:
    if p <= 1:
        return 0.0, "none"
    return _cheapest(ALLREDUCE, nbytes, p, level.alpha_s, level.beta_s_per_byte, gamma)


def allgather_time(nbytes: float, p: int, level: LinkLevel) -> tuple[float, str]:
    if p <= 1:
        return 0.0, "none"
    return _cheapest(ALLGATHER, nbytes, p, level.alpha_s, level.beta_s_per_byte)


def reducescatter_time(nbytes: float, p: int, level: LinkLevel, gamma: float = 0.0) -> tuple[float, str]:
    if p <= 1:
        return 0.0, "none"
    return _cheapest(REDUCESCATTER, nbytes, p, level.alpha_s, level.beta_s_per_byte, gamma)


def broadcast_time(nbytes: float, p: int, level: LinkLevel) -> tuple[float, str]:
    if p <= 1:
        return 0.0, "none"
    return _cheapest(BROADCAST, nbytes, p, level.alpha_s, level.beta_s_per_byte)


def alltoall_time(nbytes: float, p: int, level: LinkLevel) -> tuple[float, str]:
    if p <= 1:
        return 0.0, "none"
    return _cheapest(ALLTOALL, nbytes, p, level.alpha_s, level.beta_s_per_byte)


def wire_bytes(kind: str, algorithm: str, n: float, p: int) -> float:
    """Bytes all ranks of the group put on the wire together for one collective."""
    if p <= 1:
        return 0.0
    if kind == "send":
        return n
    if kind == "allreduce":
        if algorithm == "recursive_doubling":
            return p * clog2(p) * n
        return 2 * n * (p - 1)  # ring, rabenseifner, tree (reduce + broadcast: n per tree edge, twice)
    if kind in ("allgather", "reducescatter"):
        return n * (p - 1)
    if kind == "broadcast":
        return n * (p - 1) if algorithm == "binomial" else n * (p - 1) * (1 + 1 / p)
    if kind == "alltoall":
        return n * (p - 1) if algorithm == "pairwise" else p * n / 2 * clog2(p)
    raise PlanError(f"unknown collective {kind!r}: use one of {', '.join(COLLECTIVES)}")


# ---- on a cluster ---------------------------------------------------------------------------

@dataclass(frozen=True)
class CommCost:
    """Time of one communication op, the algorithm chosen, and bytes on the wire per level."""

    seconds: float
    algorithm: str
    bytes_per_level: dict[str, float] = field(default_factory=dict, hash=False)

    def to_json(self) -> dict[str, Any]:
        return {"seconds": self.seconds, "algorithm": self.algorithm, "bytes_per_level": dict(self.bytes_per_level)}


def reduction_gamma(cluster: Cluster, ranks: Sequence[int]) -> float:
    """γ (s/byte) of the slowest member: a reduction reads two operands and writes one."""
    return max(3.0 / (cluster.devices[r].memory_bandwidth * cluster.devices[r].efficiency) for r in ranks)


def p2p_time(nbytes: float, src: int, dst: int, cluster: Cluster) -> float:
    """α + nβ on the link between ``src`` and ``dst`` (0 when src == dst)."""
    return p2p(nbytes, *_ab(cluster.link(src, dst))) if src != dst else 0.0


#: the share of a link's α that the sender's CPU spends posting a message (LogP's o: the
#: ping-pong α is sender overhead + wire latency + receiver overhead; over shared memory MPI's
#: software at the two ends is most of it). Measured: the 64-micro-batch MLP pipeline's rank 0
#: spent 1.9 us per Send and its rank 1 1.9 us per Recv inside comm ops (runtime_overhead.json)
#: on a link of α = 2.9 us. The simulator charges the receiver the same for taking out a message
#: that had already arrived.
SEND_OVERHEAD_ALPHA = 0.5


def send_overhead(nbytes: float, src: int, dst: int, cluster: Cluster) -> float:
    """Seconds the sender is busy on one non-blocking send of ``nbytes``: SEND_OVERHEAD_ALPHA x α
    to post it, plus copying the tensor (the runtime's Send copies its input before the send,
    ``backends/tvm/executable.py``) at the link's β (0 when src == dst)."""
    if src == dst:
        return 0.0
    alpha, beta = _ab(cluster.link(src, dst))
    return SEND_OVERHEAD_ALPHA * alpha + nbytes * beta


def _ab(level: LinkLevel) -> tuple[float, float]:
    return level.alpha_s, level.beta_s_per_byte


def _flat(kind: str, n: float, p: int, level: LinkLevel, gamma: float) -> tuple[float, str]:
    if kind == "allreduce":
        return allreduce_time(n, p, level, gamma)
    if kind == "allgather":
        return allgather_time(n, p, level)
    if kind == "reducescatter":
        return reducescatter_time(n, p, level, gamma)
    if kind == "broadcast":
        return broadcast_time(n, p, level)
    if kind == "alltoall":
        return alltoall_time(n, p, level)
    raise PlanError(f"unknown collective {kind!r}: use one of {', '.join(COLLECTIVES)}")


def hierarchical_allreduce(nbytes: float, by_node: Sequence[Sequence[int]], intra: LinkLevel,
                           inter: LinkLevel, gamma: float = 0.0) -> CommCost:
    """Reduce-scatter inside each node, allreduce across nodes on n/p_local, allgather inside.

    With unequal nodes the largest node sets the intra-node time and the smallest the chunk."""
    p_nodes = len(by_node)
    p_max = max(len(g) for g in by_node)
    p_min = min(len(g) for g in by_node)
    t_rs, a_rs = reducescatter_time(nbytes, p_max, intra, gamma)
    t_ar, a_ar = allreduce_time(nbytes / p_min, p_nodes, inter, gamma)
    t_ag, a_ag = allgather_time(nbytes, p_max, intra)
    intra_bytes = sum(2 * nbytes * (len(g) - 1) for g in by_node)
    inter_bytes = p_min * wire_bytes("allreduce", a_ar, nbytes / p_min, p_nodes)
    per = {intra.name: intra_bytes, inter.name: inter_bytes}
    return CommCost(t_rs + t_ar + t_ag, f"hierarchical(rs:{a_rs},ar:{a_ar},ag:{a_ag})",
                    {k: v for k, v in per.items() if v > 0})


def shm_allreduce_time(nbytes: float, group: Sequence[int], cluster: Cluster) -> float | None:
    """Seconds of the shared-memory AllReduce (module docstring) of ``nbytes`` over ``group``, or
    None where the runtime does not take that path (rule off, under ``SHM_MIN_BYTES``, not all
    CPU ranks of one node)."""
    if not SHM_ALLREDUCE or nbytes < SHM_MIN_BYTES or len(cluster.ranks_by_node(group)) != 1 \
            or any(cluster.devices[r].kind != "cpu" for r in group):
        return None
    p = len(group)
    bandwidth = min(cluster.devices[r].memory_bandwidth * cluster.devices[r].efficiency for r in group)
    passes = 5 - 1 / p if SHM_OWN_PART else 5 + 1 / p
    return 3 * cluster.levels[0].alpha_s + passes * nbytes / bandwidth


def shm_lent_saving(nbytes: float, group: Sequence[int], cluster: Cluster) -> float:
    """Seconds the runtime's lent AllReduce (``SHM_LEND_LAST_BUCKET``: the copy out, read n and
    write n) saves on the shared-memory AllReduce of ``nbytes``; 0 where that path is not taken."""
    if not SHM_LEND_LAST_BUCKET or shm_allreduce_time(nbytes, group, cluster) is None:
        return 0.0
    bandwidth = min(cluster.devices[r].memory_bandwidth * cluster.devices[r].efficiency for r in group)
    return 2 * nbytes / bandwidth


def collective_time(kind: str, nbytes: float, ranks: Sequence[int], cluster: Cluster,
                    gamma: float | None = None) -> CommCost:
    """Cost of one collective of ``kind`` over global ``ranks`` (``n`` as in the module docstring).

    ``send`` takes ranks = (src, dst). γ defaults to :func:`reduction_gamma` of the group."""
    if kind not in COLLECTIVES:
        raise PlanError(f"unknown collective {kind!r}: use one of {', '.join(COLLECTIVES)}")
    if kind == "send":
        if len(ranks) != 2:
            raise PlanError(f"send needs ranks=(src, dst), got {list(ranks)}")
        src, dst = ranks
        if src == dst:
            return CommCost(0.0, "local", {})
        level = cluster.link(src, dst)
        return CommCost(p2p(nbytes, *_ab(level)), "p2p", {level.name: float(nbytes)})
    group = sorted(set(ranks))
    p = len(group)
    if p <= 1:
        return CommCost(0.0, "none", {})
    if gamma is None:
        gamma = reduction_gamma(cluster, group)
    level = cluster.group_level(group)
    shm = shm_allreduce_time(nbytes, group, cluster) if kind == "allreduce" else None
    if shm is not None:
        return CommCost(shm, "shm", {level.name: float(nbytes) * p})
    t, alg = _flat(kind, nbytes, p, level, gamma)
    best = CommCost(t, alg, {level.name: wire_bytes(kind, alg, nbytes, p)})
    if kind == "allreduce" and level is not cluster.levels[0]:
        by_node = cluster.ranks_by_node(group)
        if len(by_node) > 1 and max(len(g) for g in by_node) > 1:
            h = hierarchical_allreduce(nbytes, by_node, cluster.levels[0], cluster.levels[1], gamma)
            if h.seconds < best.seconds:
                best = h
    return best
