"""Pipeline training (GPipe and 1F1B) on 2 stages against 1 rank on the same global batch.

Both start from the same weights; the pipeline cuts every global batch of 8 into 4 micro-batches,
sends activations forward and their gradients backward between the stages, accumulates the
gradients and applies one update per step. After 10 steps the weights (and Adam's moments) must
match the 1-rank run within rtol 1e-4, atol 1e-5 (only float summation order differs).
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest

import models_zoo
from partitioner.cli import main
from partitioner.runtime.comm_local import LocalWorld
from partitioner.training import SGD, AdamW, build_training_graph
from partitioner.training.pipeline import build_pipeline, extra_warmup, in_flight, schedule_order
from partitioner.training.pipeline_runner import PipelineRunner, gathered_state
from partitioner.training.runner import StepRunner
from tests.training.rank_threads import step_ranks


def _mlp() -> onnx.ModelProto:
    return models_zoo.build("mlp", batch=8, hidden=32, in_features=16)


def _batches(n: int = 10) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(3)
    return [(rng.standard_normal((8, 16)).astype(np.float32), rng.integers(0, 10, 8)) for _ in range(n)]


def _tvm_pipeline_trains_like_one_rank(model, plan, image: tuple[int, ...], workdir, steps: int = 4) -> None:
    """``plan``'s 2 TVM stages (threads, a local world) against a 1-rank ONNX Runtime step: ``steps``
    SGD steps (lr 0.1) on seeded batches of 8 ``image``-shaped inputs, losses and every weight within
    rtol 1e-4, atol 1e-5."""
    rng = np.random.default_rng(2)
    batches = [(rng.standard_normal((8, *image)).astype(np.float32), rng.integers(0, 10, 8)) for _ in range(steps)]
    one = StepRunner(build_training_graph(model, optimizer=SGD(lr=0.1)))
    one_losses = [one.step({"input": x}, y) for x, y in batches]
    world = LocalWorld(2, timeout_s=120)
    runners = [PipelineRunner(plan, s, comm=world.communicator(s), backend="tvm", workdir=workdir) for s in range(2)]
    np.testing.assert_allclose(_run_pipeline(runners, batches), one_losses, rtol=1e-4, atol=1e-5)
    full = gathered_state(runners)
    for name, w in one.state.items():
        np.testing.assert_allclose(full[name], w, rtol=1e-4, atol=1e-5, err_msg=name)


def _run_pipeline(runners: list[PipelineRunner], batches) -> list[float]:
    losses = []
    for x, y in batches:
        out = step_ranks(runners, lambda r, x=x, y=y: ({"input": x}, y))
        assert len(set(out)) == 1  # the last stage broadcasts the global loss
        losses.append(out[0])
    return losses


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("optimizer", [SGD(lr=0.1), AdamW(lr=1e-2, weight_decay=0.01)], ids=["sgd", "adamw"])
def test_two_stages_match_one_rank_after_10_steps(schedule, optimizer) -> None:
    model, batches = _mlp(), _batches()
    one = StepRunner(build_training_graph(model, optimizer=optimizer))
    one_losses = [one.step({"input": x}, y) for x, y in batches]
    plan = build_pipeline(model, "cross_entropy", optimizer, batch=8, stages=2, micro_batches=4, schedule=schedule)
    assert all(st.weights for st in plan.stages), "a stage without weights: the cut is degenerate"
    world = LocalWorld(2, timeout_s=60)
    runners = [PipelineRunner(plan, s, comm=world.communicator(s)) for s in range(2)]
    losses = _run_pipeline(runners, batches)
    np.testing.assert_allclose(losses, one_losses, rtol=1e-4, atol=1e-5)
    full = gathered_state(runners)
    assert sorted(full) == sorted(one.state)  # same state names: a pipeline checkpoint is a 1-rank one
    for name, w in one.state.items():
        np.testing.assert_allclose(full[name], w, rtol=1e-4, atol=1e-5, err_msg=name)
    start = StepRunner(build_training_graph(model, optimizer=optimizer)).state
    assert any(not np.allclose(one.state[n], start[n]) for n in one.signature.weights), "no weight moved"
    # rule 5: GPipe keeps every micro-batch's stash, 1F1B at most (stages - stage + the plan's extra
    # warm-up) of them: ONNX Runtime's table says 1 (3 of the 4), GPipe has no warm-up to extend
    assert plan.extra_warmup == extra_warmup("onnxruntime") * (schedule == "1f1b")
    assert runners[0].peak_stash == (4 if schedule == "gpipe" else 2 + plan.extra_warmup)
    assert runners[0].peak_stash == in_flight(schedule, 2, 4, plan.extra_warmup)[0]
    assert world.bytes_sent > 0


@pytest.mark.parametrize("optimizer", [SGD(lr=0.1), AdamW(lr=1e-2, weight_decay=0.01)], ids=["sgd", "adamw"])
def test_hybrid_data_x_pipeline_matches_one_rank_after_10_steps(optimizer) -> None:
    """4 ranks: 2 data-parallel replicas of a 2-stage 1F1B pipeline (each replica takes half of
    every global batch of 8, in 2 micro-batches; each stage's gradients are AllReduced over the
    replicas) against 1 rank."""
    from partitioner.training.pipeline_runner import pipeline_runners

    model, batches = _mlp(), _batches()
    one = StepRunner(build_training_graph(model, optimizer=optimizer))
    one_losses = [one.step({"input": x}, y) for x, y in batches]
    _, runners = pipeline_runners(model, "cross_entropy", optimizer, batch=8, devices=4, schedule="1f1b",
                                  micro_batches=2, trainable=None, backend="onnxruntime", comm=None, out=None,
                                  threads=1, state=None, stages=2)
    assert [(r.replica, r.stage.index, r.replica_group) for r in runners] == [
        (0, 0, [0, 2]), (0, 1, [1, 3]), (1, 0, [0, 2]), (1, 1, [1, 3])]
    losses = _run_pipeline(runners, batches)
    np.testing.assert_allclose(losses, one_losses, rtol=1e-4, atol=1e-5)
    full = gathered_state(runners)
    for name, w in one.state.items():
        np.testing.assert_allclose(full[name], w, rtol=1e-4, atol=1e-5, err_msg=name)
        replica1 = next(r for r in runners if r.replica == 1 and name in r.state)
        np.testing.assert_allclose(replica1.state[name], w, rtol=1e-4, atol=1e-5, err_msg=name)


def test_schedule_orders() -> None:
    assert schedule_order("gpipe", 0, 2, 3) == [("F", 0), ("F", 1), ("F", 2), ("B", 2), ("B", 1), ("B", 0)]
    assert schedule_order("1f1b", 0, 3, 4) == [("F", 0), ("F", 1), ("F", 2), ("B", 0), ("F", 3), ("B", 1),
                                               ("B", 2), ("B", 3)]
    assert schedule_order("1f1b", 2, 3, 2) == [("FB", 0), ("FB", 1)]
    # rule 5's extra warm-up: one more forward before the first backward on stages before the last
    assert schedule_order("1f1b", 0, 3, 4, 1) == [("F", 0), ("F", 1), ("F", 2), ("F", 3), ("B", 0), ("B", 1),
                                                  ("B", 2), ("B", 3)]
    assert schedule_order("1f1b", 2, 3, 2, 1) == [("FB", 0), ("FB", 1)]
    for sched, extra in (("gpipe", 0), ("1f1b", 0), ("1f1b", 1)):  # every micro-batch F and B once, F first
        order = schedule_order(sched, 1, 4, 8, extra)
        assert sorted(order) == sorted([("F", m) for m in range(8)] + [("B", m) for m in range(8)])
        assert all(order.index(("F", m)) < order.index(("B", m)) for m in range(8))


def test_pipeline_train_cli_and_mpi_ranks_match_threads(tmp_path, capsys) -> None:
    """``train --strategy pipeline`` end to end: the in-process stages and 2 MPI processes (ONNX
    Runtime) give the same losses and weights, and the checkpoint holds every stage's weights."""
    from partitioner.training import train

    model = tmp_path / "mlp.onnx"
    onnx.save(_mlp(), str(model))
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "d.npz", x=rng.standard_normal((40, 16)).astype(np.float32), y=rng.integers(0, 10, 40))
    common = {"loss": "cross_entropy", "optimizer": "adam", "lr": 1e-2, "batch": 8, "epochs": 1, "devices": 2,
              "progress": False, "strategy": "pipeline", "micro_batches": 4}
    threads = train(str(model), str(tmp_path / "d.npz"), out_dir=tmp_path / "t", **common)
    mpi = train(str(model), str(tmp_path / "d.npz"), out_dir=tmp_path / "m", launcher="mpi", **common)
    single = train(str(model), str(tmp_path / "d.npz"), out_dir=tmp_path / "s", **{**common, "devices": 1,
                                                                                      "strategy": "data"})
    for run in (threads, mpi):
        np.testing.assert_allclose([h["loss"] for h in run.history], [h["loss"] for h in single.history],
                                   rtol=1e-4, atol=1e-5)
        for a, b in zip(run.model.graph.initializer, single.model.graph.initializer):
            np.testing.assert_allclose(onnx.numpy_helper.to_array(a), onnx.numpy_helper.to_array(b), rtol=1e-4,
                                       atol=1e-5, err_msg=a.name)
    for r in range(2):  # each MPI rank reports its steps' peak RSS over its baselines (train --bench)
        import json

        mem = json.loads((tmp_path / "m" / f"memory_rank{r}.json").read_text())
        assert mem["rank"] == r and mem["training_peak_bytes"] >= mem["process_baseline_bytes"] > 0
        assert mem["training_bytes"] >= mem["state_bytes"] > 0
    with np.load(tmp_path / "m" / "checkpoint_epoch1.state.npz") as z:
        assert "head.weight.m" in z.files and "fc0.weight.m" in z.files  # both stages' optimizer state
    rc = main(["train", str(model), "--data", str(tmp_path / "d.npz"), "--strategy", "pipeline", "--devices", "2",
               "--batch", "8", "--micro-batches", "3", "--no-progress", "-o", str(tmp_path / "bad")])
    err = capsys.readouterr().err
    assert rc == 2 and "3 equal micro-batches" in err and len(err.strip().splitlines()) == 1


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_tvm_pipeline_stages_under_mpi_match_one_rank(tmp_path, optimizer) -> None:
    """2 TVM stages under mpiexec (1F1B, 4 micro-batches) against 1 ONNX Runtime rank, 10 steps."""
    from partitioner.training import train

    model = tmp_path / "mlp.onnx"
    onnx.save(_mlp(), str(model))
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "d.npz", x=rng.standard_normal((80, 16)).astype(np.float32), y=rng.integers(0, 10, 80))
    common = {"loss": "cross_entropy", "optimizer": optimizer, "lr": 1e-2 if optimizer == "adam" else 0.1,
              "batch": 8, "epochs": 1, "progress": False}
    single = train(str(model), str(tmp_path / "d.npz"), out_dir=tmp_path / "s", devices=1, **common)
    tvm = train(str(model), str(tmp_path / "d.npz"), out_dir=tmp_path / "t", devices=2, strategy="pipeline",
                schedule="1f1b", micro_batches=4, launcher="mpi", backend="tvm", **common)
    assert len(tvm.history) == 10
    np.testing.assert_allclose([h["loss"] for h in tvm.history], [h["loss"] for h in single.history],
                               rtol=1e-4, atol=1e-5)
    for a, b in zip(tvm.model.graph.initializer, single.model.graph.initializer):
        np.testing.assert_allclose(onnx.numpy_helper.to_array(a), onnx.numpy_helper.to_array(b), rtol=1e-4,
                                   atol=1e-5, err_msg=a.name)


@pytest.mark.slow
def test_tvm_hybrid_under_mpi_matches_one_rank(tmp_path) -> None:
    """4 TVM ranks under mpiexec: 2 replicas x 2 stages (1F1B, 2 micro-batches), 10 SGD steps."""
    from partitioner.training import train

    model = tmp_path / "mlp.onnx"
    onnx.save(_mlp(), str(model))
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "d.npz", x=rng.standard_normal((80, 16)).astype(np.float32), y=rng.integers(0, 10, 80))
    common = {"loss": "cross_entropy", "optimizer": "sgd", "lr": 0.1, "batch": 8, "epochs": 1, "progress": False}
    single = train(str(model), str(tmp_path / "d.npz"), out_dir=tmp_path / "s", devices=1, **common)
    tvm = train(str(model), str(tmp_path / "d.npz"), out_dir=tmp_path / "t", devices=4, strategy="hybrid", stages=2,
                micro_batches=2, launcher="mpi", backend="tvm", **common)
    np.testing.assert_allclose([h["loss"] for h in tvm.history], [h["loss"] for h in single.history],
                               rtol=1e-4, atol=1e-5)
    for a, b in zip(tvm.model.graph.initializer, single.model.graph.initializer):
        np.testing.assert_allclose(onnx.numpy_helper.to_array(a), onnx.numpy_helper.to_array(b), rtol=1e-4,
                                   atol=1e-5, err_msg=a.name)


@pytest.mark.slow
def test_batchnorm_model_pipelines_with_micro_batch_statistics() -> None:
    """Rule 7: a BatchNormalization model (the zoo resnet) trains on 2 stages; its running
    statistics move (once per micro-batch) and GPipe and 1F1B give the same losses and state."""
    from partitioner.training import train

    model = models_zoo.build("resnet", batch=4, image=32, classes=10)
    rng = np.random.default_rng(0)
    data = {"x": rng.standard_normal((8, 3, 32, 32)).astype(np.float32), "y": rng.integers(0, 10, 8)}
    runs = {s: train(model, data, devices=2, strategy="pipeline", schedule=s, micro_batches=2, batch=4, epochs=1,
                     progress=False, lr=0.01) for s in ("gpipe", "1f1b")}
    np.testing.assert_allclose([h["loss"] for h in runs["gpipe"].history], [h["loss"] for h in runs["1f1b"].history],
                               rtol=1e-5, atol=1e-6)
    assert all(np.isfinite(h["loss"]) for h in runs["1f1b"].history)
    before = {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}
    after = {t.name: onnx.numpy_helper.to_array(t) for t in runs["1f1b"].model.graph.initializer}
    means = [n for n in before if n.endswith(".mean")]
    assert means and all(not np.allclose(after[n], before[n]) for n in means)  # every BN's statistics, both stages


def test_recompute_is_chosen_when_memory_is_short_and_trains_like_one_rank() -> None:
    """Rule 8: under a limit no plain split fits (GPipe stashes 8 micro-batches of activations),
    the planner recomputes: stage 0 stashes only its input, its predicted peak fits the limit,
    and the pipeline still matches 1 rank after the steps (weights rtol 1e-4, atol 1e-5)."""
    from partitioner.core.errors import UsageError
    from partitioner.training import SGD, train
    from partitioner.training.pipeline import build_pipeline
    from partitioner.training.plan import predict_training

    model = models_zoo.build("mlp", batch=64, layers=4, hidden=128, in_features=16)
    kw = {"batch": 64, "optimizer": "sgd", "schedule": "gpipe", "micro_batches": 8}
    free = max(predict_training(model, "pipeline", 2, **kw).memory_per_rank)
    chosen = None
    for frac in np.linspace(0.95, 0.2, 16):
        try:
            p = predict_training(model, "pipeline", 2, memory_limit=frac * free, **kw)
        except UsageError:
            break
        if p.recompute:
            chosen = (frac * free, p)
            break
    assert chosen is not None, "no limit made the planner recompute"
    limit, pred = chosen
    assert max(pred.memory_per_rank) <= limit
    plan = build_pipeline(model, "cross_entropy", SGD(lr=0.1), batch=64, stages=2, micro_batches=8, schedule="gpipe",
                          memory_limit=limit)
    assert plan.recompute and plan.stages[0].stash == ["input"]
    rng = np.random.default_rng(0)
    data = {"x": rng.standard_normal((128, 16)).astype(np.float32), "y": rng.integers(0, 10, 128)}
    common = {"loss": "cross_entropy", "optimizer": "sgd", "lr": 0.1, "batch": 64, "epochs": 1, "progress": False}
    piped = train(model, data, devices=2, strategy="pipeline", schedule="gpipe", micro_batches=8,
                  memory_limit=limit, **common)
    one = train(model, data, devices=1, **common)
    np.testing.assert_allclose([h["loss"] for h in piped.history], [h["loss"] for h in one.history], rtol=1e-4,
                               atol=1e-5)
    for a, b in zip(piped.model.graph.initializer, one.model.graph.initializer):
        np.testing.assert_allclose(onnx.numpy_helper.to_array(a), onnx.numpy_helper.to_array(b), rtol=1e-4,
                                   atol=1e-5, err_msg=a.name)
