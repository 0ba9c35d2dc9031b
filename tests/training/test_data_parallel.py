"""Data-parallel training on 2 ranks against 1 rank on the same global batch.

Both runs start from the same weights; each step the 2 ranks take halves of the global batch and
AllReduce (mean) their gradients through the project's comm ops (in-process communicator). After
10 steps the weights must match the 1-rank run within rtol 1e-4, atol 1e-5 (float32 sums in a
different order are the only difference).
"""

from __future__ import annotations

import numpy as np
import pytest

import models_zoo
from partitioner.runtime.comm_local import LocalWorld
from partitioner.training import SGD, AdamW, build_training_graph
from partitioner.training.runner import StepRunner
from tests.training.rank_threads import step_ranks


def _run_two_ranks(step2, batches, backend: str = "onnxruntime"):
    world = LocalWorld(2, timeout_s=60)
    runners = [StepRunner(step2, backend=backend, comm=world.communicator(r)) for r in range(2)]
    losses = []
    for x, y in batches:
        out = step_ranks(runners, lambda r, x=x, y=y: ({"input": x[r * 4:(r + 1) * 4]}, y[r * 4:(r + 1) * 4]))
        assert out[0] == out[1]  # the loss is AllReduced too: every rank reports the global loss
        losses.append(out[0])
    return runners, losses


@pytest.mark.parametrize("optimizer", [SGD(lr=0.1), AdamW(lr=1e-2, weight_decay=0.01)], ids=["sgd", "adamw"])
def test_two_ranks_match_one_rank_after_10_steps(optimizer) -> None:
    model = models_zoo.build("mlp", batch=8, hidden=32, in_features=16)
    rng = np.random.default_rng(3)
    batches = [(rng.standard_normal((8, 16)).astype(np.float32), rng.integers(0, 10, 8)) for _ in range(10)]
    one = StepRunner(build_training_graph(model, optimizer=optimizer))
    one_losses = [one.step({"input": x}, y) for x, y in batches]
    runners, two_losses = _run_two_ranks(build_training_graph(model, optimizer=optimizer, batch=4, world_size=2),
                                         batches)
    np.testing.assert_allclose(two_losses, one_losses, rtol=1e-4, atol=1e-5)
    for name, w in one.weights().items():
        for r in runners:
            np.testing.assert_allclose(r.state[name], w, rtol=1e-4, atol=1e-5, err_msg=name)
    start = StepRunner(build_training_graph(model, optimizer=optimizer)).state
    assert any(not np.allclose(one.state[n], start[n]) for n in one.signature.weights), "no weight moved"


def test_mpi_ranks_match_in_process_ranks(tmp_path) -> None:
    """``--launcher mpi`` (2 processes under mpiexec, MPI AllReduce) trains to the same weights
    as the in-process ranks, which the test above ties to a 1-rank run."""
    import onnx

    from partitioner.training import train

    model = tmp_path / "mlp.onnx"
    onnx.save(models_zoo.build("mlp", batch=8, hidden=32, in_features=16), str(model))
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "d.npz", x=rng.standard_normal((40, 16)).astype(np.float32), y=rng.integers(0, 10, 40))
    common = {"loss": "cross_entropy", "optimizer": "sgd", "lr": 0.1, "batch": 8, "epochs": 2, "devices": 2, "progress": False}
    threads = train(str(model), str(tmp_path / "d.npz"), out_dir=tmp_path / "t", **common)
    mpi = train(str(model), str(tmp_path / "d.npz"), out_dir=tmp_path / "m", launcher="mpi", **common)
    assert len(mpi.history) == len(threads.history) == 10
    np.testing.assert_allclose([h["loss"] for h in mpi.history], [h["loss"] for h in threads.history],
                               rtol=1e-5, atol=1e-6)
    for a, b in zip(mpi.model.graph.initializer, threads.model.graph.initializer):
        np.testing.assert_allclose(onnx.numpy_helper.to_array(a), onnx.numpy_helper.to_array(b), rtol=1e-4,
                                   atol=1e-5, err_msg=a.name)


@pytest.mark.slow
def test_tvm_ranks_under_mpi_match_onnxruntime_ranks(tmp_path) -> None:
    """2 TVM ranks under mpiexec (comm ops as call_dps_packed into the MPI communicator) follow
    the ONNX Runtime in-process ranks' losses within 1e-4 and end at the same weights."""
    import onnx

    from partitioner.training import train

    model = tmp_path / "mlp.onnx"
    onnx.save(models_zoo.build("mlp", batch=8, hidden=32, in_features=16), str(model))
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "d.npz", x=rng.standard_normal((40, 16)).astype(np.float32), y=rng.integers(0, 10, 40))
    common = {"loss": "cross_entropy", "optimizer": "sgd", "lr": 0.1, "batch": 8, "epochs": 2, "devices": 2,
              "progress": False}
    ort_run = train(str(model), str(tmp_path / "d.npz"), out_dir=tmp_path / "o", **common)
    tvm_run = train(str(model), str(tmp_path / "d.npz"), out_dir=tmp_path / "t", launcher="mpi", backend="tvm",
                    **common)
    np.testing.assert_allclose([h["loss"] for h in tvm_run.history], [h["loss"] for h in ort_run.history],
                               rtol=0, atol=1e-4)
    for a, b in zip(tvm_run.model.graph.initializer, ort_run.model.graph.initializer):
        np.testing.assert_allclose(onnx.numpy_helper.to_array(a), onnx.numpy_helper.to_array(b), rtol=1e-4,
                                   atol=1e-5, err_msg=a.name)


def test_python_iterator_data_trains_like_the_same_arrays() -> None:
    from partitioner.training import train

    model = models_zoo.build("mlp", batch=8, hidden=32, in_features=16)
    rng = np.random.default_rng(4)
    x, y = rng.standard_normal((32, 16)).astype(np.float32), rng.integers(0, 10, 32)
    common = {"loss": "cross_entropy", "optimizer": "sgd", "lr": 0.1, "batch": 8, "epochs": 1, "progress": False}
    a = train(model, {"x": x, "y": y}, **common)
    b = train(model, ((x[i:i + 8], y[i:i + 8]) for i in range(0, 32, 8)), **common)
    assert [h["loss"] for h in a.history] == [h["loss"] for h in b.history]


def test_the_mean_is_taken_before_the_backward_not_over_the_reduced_buckets() -> None:
    """Step rule 5: the 1/R of the gradient mean scales the loss gradient's seed (activation
    sized), so each reduced bucket goes straight to its split: no weight-sized multiply per step
    after the AllReduce. (The 2-rank weights matching 1 rank above check that the mean is kept.)"""
    model = models_zoo.build("mlp", batch=8, hidden=16, in_features=8)
    step = build_training_graph(model, optimizer=SGD(lr=0.1), batch=4, world_size=2)
    reduced = [n.outputs[0] for n in step.graph if n.op_type == "AllReduce"]
    assert reduced
    for v in reduced:
        assert {u.op_type for u, _ in v.uses()} <= {"Split", "Reshape"}, [u.op_type for u, _ in v.uses()]
