"""Data parallel: each gradient bucket's AllReduce starts as soon as the bucket's gradients exist
and runs beside the rest of the backward pass (partitioner/training/overlap.py,
partitioner/training/step.py rule 5)."""

from __future__ import annotations


import numpy as np
import onnx_ir as ir

import models_zoo
from partitioner.runtime.comm_local import LocalWorld
from partitioner.training import SGD, build_training_graph
from partitioner.training.overlap import OverlappedExecutable
from partitioner.training.runner import StepRunner

from .test_data_tvm_buckets import step_data_ranks


def _step(bucket_bytes: int):
    model = models_zoo.build("mlp", batch=8, layers=3, hidden=64, in_features=16)
    return build_training_graph(model, loss="cross_entropy", optimizer=SGD(lr=0.1), batch=4, world_size=2,
                                bucket_bytes=bucket_bytes)


def test_each_bucket_allreduce_sits_right_after_its_last_gradient() -> None:
    """Small buckets (one per weight): every AllReduce but the last has backward nodes after it,
    and each comes right after the bucket's concat/flatten, which follow the gradient's producer."""
    step = _step(bucket_bytes=16 * 1024)
    nodes = list(step.graph)
    ar = [i for i, n in enumerate(nodes) if n.op_type == "AllReduce"]
    assert len(ar) >= 3
    backward = [i for i, n in enumerate(nodes)
                if n.metadata_props.get("training.forward_node") not in (None, "loss", "optimizer")]
    assert sum(1 for i in ar if i < max(backward)) == len(ar) - 1  # all but the last overlap backward work
    for i in ar:  # the comm op's input is produced just before it (the bucket's flatten/concat)
        assert nodes[i - 1].outputs[0] is nodes[i].inputs[0]


def test_overlapped_ranks_start_bucket_0_before_the_backward_ends_and_match_blocking_ones() -> None:
    step = _step(bucket_bytes=16 * 1024)
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((8, 16)).astype(np.float32), rng.integers(0, 10, 8)

    def ranks(blocking: bool):
        world = LocalWorld(2, timeout_s=60)
        runners = [StepRunner(step, comm=world.communicator(r)) for r in range(2)]
        if blocking:
            from backends.onnxruntime import RankExecutable

            for r in runners:
                r._exe = RankExecutable(r.program)
        step_data_ranks(runners, [(x, y)] * 3, timeout_s=60)
        return runners

    over, block = ranks(False), ranks(True)
    assert isinstance(over[0]._exe, OverlappedExecutable)
    for a, b in zip(over, block):
        for name in a.state:
            np.testing.assert_array_equal(a.state[name], b.state[name], err_msg=name)
    tl = over[0]._exe.timeline
    handed = min(t0 for kind, _, t0, _ in tl if kind == "submit")
    segs = sorted((t0, t1) for kind, _, t0, t1 in tl if kind == "segment")
    assert len(segs) >= 3
    # bucket 0 went to the comm thread before the backward's later segments started
    assert handed < segs[-2][0]
    assert len([k for k, *_ in tl if k == "allreduce"]) == len([k for k, *_ in tl if k == "submit"]) >= 3


def test_one_big_bucket_is_one_blocking_allreduce() -> None:
    """One bucket: nothing to overlap, so the rank runs its AllReduce inline (no thread hop)."""

    step = _step(bucket_bytes=25 * 2**20)
    assert isinstance(step, ir.Model) and sum(1 for n in step.graph if n.op_type == "AllReduce") == 1
    world = LocalWorld(2, timeout_s=60)
    exe = StepRunner(step, comm=world.communicator(0))._exe
    assert exe._pool is None and not exe.overlap
