"""``train --bench``: predicted against measured peak memory per rank and step time, and a model
that does not fit one device's --memory-limit training on 2 ranks with the predicted peak per
rank within 25% of the measured one (peak RSS of the steps minus the RSS before the program
loads; partitioner/training/memory_window.py)."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest

import models_zoo
from partitioner.cli import main
from partitioner.training.memory_window import MemoryWindow, reset_peak
from partitioner.training.plan import predict_training


def test_memory_window_counts_what_the_steps_allocate() -> None:
    """A 64 MiB array allocated and freed inside the window moves the measured peak by 64 MiB
    (+- 8), with 16 MiB of state counted as resident."""
    if not reset_peak():
        pytest.skip("this kernel does not allow resetting VmHWM")
    w = MemoryWindow(armed=True)
    w.start_steps(16 * 2**20)
    a = np.ones(16 * 2**20, dtype=np.float32)  # 64 MiB, touched
    del a
    w.end_steps()
    assert abs(w.training_bytes - 80 * 2**20) < 8 * 2**20


def test_train_bench_json_on_one_device(tmp_path, capsys) -> None:
    """--bench --json: predicted beside measured step time and memory; the measured memory holds
    at least the resident weights (SGD: the state is the weights), the ratio is predicted/measured."""
    model = models_zoo.build("mlp", batch=16, layers=2, hidden=256, in_features=256)
    onnx.save(model, str(tmp_path / "m.onnx"))
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "d.npz", x=rng.standard_normal((64, 256)).astype(np.float32), y=rng.integers(0, 10, 64))
    rc = main(["train", str(tmp_path / "m.onnx"), "--data", str(tmp_path / "d.npz"), "--batch", "16", "--bench",
               "--json", "-o", str(tmp_path / "r")])
    doc = json.loads(capsys.readouterr().out)
    weights = sum(onnx.numpy_helper.to_array(t).nbytes for t in model.graph.initializer)
    assert rc == 0 and doc["strategy"] == "single" and doc["steps_timed"] == 2
    (mem,) = doc["memory_per_rank"]
    assert mem["measured"] >= weights and mem["ratio"] == pytest.approx(mem["predicted"] / mem["measured"])
    st = doc["step_time_s"]
    assert st["measured"] > 0 and st["predicted"] > 0 and st["ratio"] == pytest.approx(st["predicted"] / st["measured"])


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["onnxruntime", "tvm"])
def test_a_model_too_big_for_one_device_trains_on_two_ranks_as_predicted(tmp_path, capsys, backend) -> None:
    model = models_zoo.build("mlp", batch=32, layers=2, hidden=1536, in_features=1536)
    path = tmp_path / "m.onnx"
    onnx.save(model, str(path))
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "d.npz", x=rng.standard_normal((160, 1536)).astype(np.float32), y=rng.integers(0, 10, 160))
    one = max(predict_training(model, "single", 1, batch=32, optimizer="adam").memory_per_rank)
    two = max(predict_training(model, "tensor", 2, batch=32, optimizer="adam").memory_per_rank)
    limit = str(int((one + two) / 2))
    base = ["train", str(path), "--data", str(tmp_path / "d.npz"), "--optimizer", "adam", "--batch", "32",
            "--memory-limit", limit, "--no-progress", "--backend", backend]
    rc = main([*base, "--devices", "1", "-o", str(tmp_path / "one")])
    err = capsys.readouterr().err
    assert rc == 2 and "exceeds --memory-limit" in err and len(err.strip().splitlines()) == 1
    rc = main([*base, "--devices", "2", "--strategy", "tensor", "--bench", "--json", "-o", str(tmp_path / "two")])
    doc = json.loads(capsys.readouterr().out)
    assert rc == 0 and doc["strategy"] == "tensor" and len(doc["memory_per_rank"]) == 2
    for m in doc["memory_per_rank"]:
        assert m["window_reset"], m
        assert m["predicted"] <= float(limit)
        assert 0.75 <= m["ratio"] <= 1.25, m
    assert doc["step_time_s"]["measured"] > 0 and doc["step_time_s"]["predicted"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("strategy,optimizer", [("data", "adam"), ("data", "sgd"), ("pipeline", "adam"),
                                                ("pipeline", "sgd")])
def test_data_and_pipeline_peak_memory_per_rank_within_25pct(tmp_path, capsys, strategy, optimizer) -> None:
    """Issue 16: the predicted peak per rank within 25% of the measured one for data and pipeline
    1F1B x8 too (2 MPI ranks, ONNX Runtime; the mlp 2048 wide: 48 MiB of weights, so the state,
    gradients and their copies dominate, as the rule counts them; every rank checked, the last
    pipeline stage included)."""
    model = models_zoo.build("mlp", batch=32, hidden=2048, in_features=2048)
    path = tmp_path / "m.onnx"
    onnx.save(model, str(path))
    rng = np.random.default_rng(1)
    np.savez(tmp_path / "d.npz", x=rng.standard_normal((128, 2048)).astype(np.float32), y=rng.integers(0, 10, 128))
    extra = ["--schedule", "1f1b", "--micro-batches", "8"] if strategy == "pipeline" else []
    rc = main(["train", str(path), "--data", str(tmp_path / "d.npz"), "--optimizer", optimizer, "--batch", "32",
               "--devices", "2", "--strategy", strategy, *extra, "--no-progress", "--bench", "--json",
               "-o", str(tmp_path / "run")])
    doc = json.loads(capsys.readouterr().out)
    assert rc == 0 and doc["strategy"] == strategy and len(doc["memory_per_rank"]) == 2
    weights = sum(onnx.numpy_helper.to_array(t).nbytes for t in model.graph.initializer)
    for m in doc["memory_per_rank"]:
        assert m["window_reset"], m
        assert m["measured"] > weights / 4, m  # a real peak: at least the rank's share of the weights
        assert 0.75 <= m["ratio"] <= 1.25, m


@pytest.mark.slow
def test_bert_pipeline_last_stage_peak_within_25pct(tmp_path, capsys) -> None:
    """The last stage of an ONNX Runtime 1F1B x8 plan runs each micro-batch's forward and backward
    in one call: its predicted peak counts that call's live bytes and the arrays kept for the
    deferred weight gradients (``cost.memory.ort_last_stage_activations``), not only the forward's
    stash, which priced the zoo bert of ``benchmarks/train_step.py`` (256 wide, 64 tokens, batch 32)
    at 35 MiB against 53-55 measured. Every rank within 25% (2 MPI ranks)."""
    model = models_zoo.build("bert", batch=32, seq=64, hidden=256, heads=4, layers=2)
    path = tmp_path / "b.onnx"
    onnx.save(model, str(path))
    rng = np.random.default_rng(0)
    out = [d.dim_value for d in model.graph.output[0].type.tensor_type.shape.dim]
    np.savez(tmp_path / "d.npz", x=rng.integers(0, 50, (320, 64)), y=rng.standard_normal([320] + out[1:]).astype(np.float32))
    rc = main(["train", str(path), "--data", str(tmp_path / "d.npz"), "--loss", "mse", "--optimizer", "sgd",
               "--batch", "32", "--devices", "2", "--strategy", "pipeline", "--schedule", "1f1b", "--micro-batches", "8",
               "--no-progress", "--bench", "--json", "-o", str(tmp_path / "run")])
    doc = json.loads(capsys.readouterr().out)
    assert rc == 0 and len(doc["memory_per_rank"]) == 2
    for m in doc["memory_per_rank"]:
        assert m["window_reset"], m
        assert 0.75 <= m["ratio"] <= 1.25, m
