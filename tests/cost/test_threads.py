"""Threads per rank (``cost/threads.py``): a plan with fewer ranks than a node's cores runs each
rank on several threads, and the estimate and the simulator both count it, so ``auto`` compares
a split against the 1-rank plan on the same cores."""

from __future__ import annotations

import pytest

import models_zoo
from partitioner.cluster import Cluster
from partitioner.compiler import prepare
from partitioner.cost.threads import THREAD_EFFICIENCY, rank_threads, thread_speedup
from partitioner.partition import partition


def test_threads_per_rank_on_one_cpu_node() -> None:
    c = Cluster.resolve("cpu:4")
    assert [rank_threads(c, w) for w in (1, 2, 4)] == [4, 2, 1]
    assert thread_speedup(1) == 1.0
    assert thread_speedup(2) == pytest.approx(1 + THREAD_EFFICIENCY)


def test_gpus_and_several_nodes_keep_one_thread() -> None:
    assert rank_threads(Cluster.resolve("h100x8"), 1) == 1
    assert rank_threads(Cluster.resolve("h200:4x8"), 1) == 1


def test_single_on_two_cores_is_predicted_faster_than_on_one(tmp_path) -> None:
    """The same 1-rank plan: on cpu:2 its one rank has 2 threads (estimate and simulation)."""
    import onnx

    path = tmp_path / "mlp.onnx"
    onnx.save(models_zoo.build("mlp", batch=8, hidden=512, layers=3), path)
    model = prepare(str(path))[0]
    one = partition(model, "cpu:1", strategy="single")
    two = partition(model, "cpu:2", strategy="single")
    for key in ("search_estimate", "simulated"):
        a = one.prediction[key]["latency_s" if key == "search_estimate" else "step_latency_s"]
        b = two.prediction[key]["latency_s" if key == "search_estimate" else "step_latency_s"]
        # kernels speed up by thread_speedup(2); the per-call overhead does not
        assert 1.2 < a / b <= thread_speedup(2) * (1 + 1e-9), (key, a, b)
