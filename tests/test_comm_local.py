"""The in-process communicator against numpy-computed collectives (seeded inputs)."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from partitioner.core import comm_ops
from partitioner.core.errors import RunFailed
from partitioner.runtime.comm_local import LocalWorld


def _run_ranks(world: LocalWorld, fn, n: int) -> list:
    results: list = [None] * n
    errors: list = []

    def body(r: int) -> None:
        try:
            results[r] = fn(world.communicator(r))
        except Exception as exc:  # surfaced below
            errors.append(exc)
            world.abort(str(exc))

    threads = [threading.Thread(target=body, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    if errors:
        raise errors[0]
    return results


@pytest.fixture
def xs() -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [rng.standard_normal((4, 6)).astype(np.float32) for _ in range(4)]


def test_allreduce_allgather_reducescatter_alltoall(xs):
    group = [0, 1, 2, 3]
    out = _run_ranks(LocalWorld(4), lambda c: (
        c.allreduce(xs[c.rank], group, "sum", 0),
        c.allgather(xs[c.rank], group, 1, 1),
        c.reduce_scatter(xs[c.rank], group, 0, "max", 2),
        c.alltoall(xs[c.rank], group, 0, 1, 3),
    ), 4)
    total = xs[0] + xs[1] + xs[2] + xs[3]
    for r in range(4):
        np.testing.assert_allclose(out[r][0], total, rtol=1e-6)
        np.testing.assert_array_equal(out[r][1], np.concatenate(xs, axis=1))
        np.testing.assert_array_equal(out[r][2], np.maximum.reduce(xs)[r:r + 1])
        np.testing.assert_array_equal(out[r][3], np.concatenate([x[r:r + 1] for x in xs], axis=1))


def test_subgroup_broadcast_and_p2p(xs):
    def body(c):
        if c.rank in (1, 3):
            b = c.broadcast(xs[c.rank] if c.rank == 3 else None, [1, 3], 3, 7)
        else:
            b = None
        if c.rank == 0:
            c.send(xs[0], 2, 5)
            return b
        if c.rank == 2:
            return c.recv(0, 5, (4, 6), np.float32)
        return b

    out = _run_ranks(LocalWorld(4), body, 4)
    np.testing.assert_array_equal(out[1], xs[3])
    np.testing.assert_array_equal(out[3], xs[3])
    np.testing.assert_array_equal(out[2], xs[0])


def test_repeated_collectives_keep_order(xs):
    """Micro-batch loops call the same collective repeatedly: each call pairs with its peer's call."""
    out = _run_ranks(LocalWorld(2), lambda c: [c.allreduce(xs[c.rank] * k, [0, 1], "sum", 0) for k in range(5)], 2)
    for k in range(5):
        np.testing.assert_allclose(out[0][k], (xs[0] + xs[1]) * k, rtol=1e-6)


def test_recv_shape_mismatch_is_an_error(xs):
    def body(c):
        if c.rank == 0:
            c.send(xs[0], 1, 0)
        else:
            c.recv(0, 0, (2, 2), np.float32)

    with pytest.raises(RunFailed, match="expected float32"):
        _run_ranks(LocalWorld(2), body, 2)


def test_missing_peer_times_out_instead_of_hanging():
    world = LocalWorld(2, timeout_s=0.5)
    with pytest.raises(RunFailed, match="timed out"):
        world.communicator(1).recv(0, 9, (1,), np.float32)


def test_execute_dispatches_comm_nodes(xs):
    node = comm_ops.make_node("AllGather", ["x"], ["y"], name="ag", group=[0, 1], axis=0, tag=4)
    op = comm_ops.CommOp.from_node(node)
    out = _run_ranks(LocalWorld(2), lambda c: comm_ops.execute(op, [xs[c.rank]], c)[0], 2)
    np.testing.assert_array_equal(out[1], np.concatenate(xs[:2], axis=0))


def test_contract_rejects_bad_attributes():
    from partitioner.core.errors import VerifyError

    with pytest.raises(VerifyError, match="missing attribute"):
        comm_ops.make_node("Recv", [], ["y"], name="r", peer=0, tag=0)
    with pytest.raises(VerifyError, match="reduction"):
        comm_ops.make_node("AllReduce", ["x"], ["y"], name="a", group=[0, 1], reduction="mean", tag=0)
