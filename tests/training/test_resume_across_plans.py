"""``--resume`` across plans that shard the state differently, and the bad-input contract under
the pipeline and tensor strategies (the checks run before any rank starts)."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest

import models_zoo
from partitioner.cli import main
from partitioner.training import train


@pytest.fixture()
def mlp(tmp_path):
    path = tmp_path / "mlp.onnx"
    onnx.save(models_zoo.build("mlp", batch=8, hidden=32, in_features=16), str(path))
    rng = np.random.default_rng(0)
    x = rng.standard_normal((32, 16)).astype(np.float32)
    np.savez(tmp_path / "d.npz", x=x, y=x[:, :10].argmax(axis=1).astype(np.int64))
    return str(path), str(tmp_path / "d.npz"), tmp_path


def test_tensor_checkpoint_resumes_as_pipeline_and_as_one_device(mlp) -> None:
    """Epoch 1 on 2 tensor ranks (state sharded by columns/rows), epoch 2 resumed on 2 pipeline
    stages (state split by stage): the same epoch-2 losses and weights as one device throughout
    (Adam's moments and step count travel in the gathered .state.npz)."""
    model, data, tmp = mlp
    common = {"loss": "cross_entropy", "optimizer": "adam", "lr": 1e-2, "batch": 8, "progress": False}
    full = train(model, data, epochs=2, devices=1, out_dir=tmp / "full", **common)
    train(model, data, epochs=1, devices=2, strategy="tensor", out_dir=tmp / "tp", **common)
    ckpt = tmp / "tp" / "checkpoint_epoch1.onnx"
    pipe = train(model, data, epochs=1, devices=2, strategy="pipeline", micro_batches=2, seed=1, resume=ckpt,
                 out_dir=tmp / "pp", **common)
    np.testing.assert_allclose([h["loss"] for h in pipe.history], [h["loss"] for h in full.history[4:]],
                               rtol=1e-4, atol=1e-5)
    for a, b in zip(pipe.model.graph.initializer, full.model.graph.initializer):
        np.testing.assert_allclose(onnx.numpy_helper.to_array(a), onnx.numpy_helper.to_array(b), rtol=1e-4,
                                   atol=1e-5, err_msg=a.name)
    tp2 = train(model, data, epochs=1, devices=2, strategy="tensor", seed=1, resume=tmp / "pp" / "checkpoint_epoch1.onnx",
                out_dir=tmp / "tp2", **common)
    assert len(tp2.history) == 4 and np.all(np.isfinite([h["loss"] for h in tp2.history]))


@pytest.mark.parametrize("strategy", ["pipeline", "tensor"])
def test_bad_input_under_sharded_strategies(mlp, capsys, strategy) -> None:
    model, _, tmp = mlp
    base = ["train", model, "--strategy", strategy, "--devices", "2", "--batch", "8", "--no-progress"]
    np.savez(tmp / "nolabels.npz", x=np.zeros((8, 16), np.float32))
    np.savez(tmp / "range.npz", x=np.zeros((8, 16), np.float32), y=np.full(8, 10))
    for data, words in (("nolabels.npz", "missing array(s) y"), ("range.npz", "10 classes")):
        rc = main([*base, "--data", str(tmp / data), "-o", str(tmp / "r")])
        err = capsys.readouterr().err
        assert rc == 2 and words in err and len(err.strip().splitlines()) == 1, err
    other = tmp / "other.onnx"
    onnx.save(models_zoo.build("mlp", batch=8, hidden=48, in_features=16), str(other))
    rc = main([*base, "--data", str(tmp / "d.npz"), "--resume", str(other), "-o", str(tmp / "r2")])
    err = capsys.readouterr().err
    assert rc == 2 and "another model" in err and len(err.strip().splitlines()) == 1
    # a NaN loss: exit 1, the step named, the last good checkpoint kept and loadable
    x = np.random.default_rng(1).standard_normal((8, 16)).astype(np.float32) * 100
    np.savez(tmp / "one.npz", x=x, y=np.arange(8) % 10)
    rc = main([*base, "--data", str(tmp / "one.npz"), "--epochs", "4", "--lr", "1e30", "-o", str(tmp / "nan")])
    err = capsys.readouterr().err
    assert rc == 1 and "at step" in err and "checkpoint_epoch1.onnx" in err and len(err.strip().splitlines()) == 1
    onnx.checker.check_model(onnx.load(str(tmp / "nan" / "checkpoint_epoch1.onnx")))
    assert json.loads((tmp / "nan" / "history.json").read_text())["checkpoints"][-1].endswith("checkpoint_epoch1.onnx")
