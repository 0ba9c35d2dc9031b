"""``partitioner train`` end to end and its bad-input contract (one line, exit 2; NaN: exit 1
with the step named and the last good checkpoint kept)."""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

import models_zoo
from partitioner.cli import main


@pytest.fixture()
def mlp(tmp_path):
    path = tmp_path / "mlp.onnx"
    onnx.save(models_zoo.build("mlp", batch=8, hidden=32, in_features=16), str(path))
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 16)).astype(np.float32)
    y = (x[:, :10].argmax(axis=1)).astype(np.int64)  # a learnable rule
    np.savez(tmp_path / "train.npz", x=x, y=y)
    return path, tmp_path


def _run(argv, capsys):
    rc = main(argv)
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def test_train_writes_history_and_a_deployable_checkpoint(mlp, capsys) -> None:
    path, tmp = mlp
    rc, out, err = _run(["train", str(path), "--data", str(tmp / "train.npz"), "--optimizer", "adam", "--lr", "1e-2",
                         "--batch", "8", "--epochs", "2", "--devices", "2", "-o", str(tmp / "run"), "--json"], capsys)
    assert rc == 0, err
    report = json.loads(out)
    hist = json.loads((tmp / "run" / "history.json").read_text())["steps"]
    assert len(hist) == 16 and report["steps"] == 16
    first = np.mean([h["loss"] for h in hist[:4]])
    last = np.mean([h["loss"] for h in hist[-4:]])
    assert last < first
    ckpt = onnx.load(str(tmp / "run" / "checkpoint_epoch2.onnx"))
    onnx.checker.check_model(ckpt, full_check=True)
    orig = onnx.load(str(path))
    assert [n.op_type for n in ckpt.graph.node] == [n.op_type for n in orig.graph.node]
    changed = [a.name for a, b in zip(ckpt.graph.initializer, orig.graph.initializer)
               if not np.array_equal(onnx.numpy_helper.to_array(a), onnx.numpy_helper.to_array(b))]
    assert changed, "no weight changed"
    assert (tmp / "run" / "checkpoint_epoch2.state.npz").is_file()
    page = (tmp / "run" / "report.html").read_text()
    assert "<polyline" in page and page.count(",") >= 16  # one point per step
    # the checkpoint runs as a plain inference model, and `compile` deploys it with the same outputs
    x = np.load(tmp / "train.npz")["x"][:8]
    want = ort.InferenceSession(ckpt.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"input": x})[0]
    import partitioner

    art = partitioner.compile(str(tmp / "run" / "checkpoint_epoch2.onnx"), cluster="cpu:2", strategy="data",
                              backend="onnxruntime", progress=False)
    got = art.run({"input": x}, in_process=True)
    np.testing.assert_allclose(got.outputs["logits"], want, rtol=1e-5, atol=1e-6)


def test_missing_data_key_is_one_line_exit_2(mlp, capsys) -> None:
    path, tmp = mlp
    np.savez(tmp / "bad.npz", x=np.zeros((8, 16), np.float32))
    rc, _, err = _run(["train", str(path), "--data", str(tmp / "bad.npz"), "--batch", "8", "--no-progress", "-o", str(tmp / "r")], capsys)
    assert rc == 2 and "missing array(s) y" in err and len(err.strip().splitlines()) == 1


def test_labels_out_of_range_exit_2(mlp, capsys) -> None:
    path, tmp = mlp
    np.savez(tmp / "bad.npz", x=np.zeros((8, 16), np.float32), y=np.full(8, 10))
    rc, _, err = _run(["train", str(path), "--data", str(tmp / "bad.npz"), "--batch", "8", "--no-progress", "-o", str(tmp / "r")], capsys)
    assert rc == 2 and "10 classes" in err and len(err.strip().splitlines()) == 1


def test_loss_not_matching_the_output_exit_2(tmp_path, capsys) -> None:
    w = onnx.numpy_helper.from_array(np.ones((4,), np.float32), "w")
    g = helper.make_graph([helper.make_node("ReduceSum", ["x"], ["s"], keepdims=0, axes=None),
                           helper.make_node("Mul", ["x", "w"], ["y0"]),
                           helper.make_node("ReduceSum", ["y0", "ax"], ["y"], keepdims=0)], "vec",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [8, 4])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [8])],
                          initializer=[w, onnx.numpy_helper.from_array(np.array([1], np.int64), "ax")])
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)]), str(tmp_path / "vec.onnx"))
    np.savez(tmp_path / "d.npz", x=np.zeros((8, 4), np.float32), y=np.zeros(8, np.int64))
    rc, _, err = _run(["train", str(tmp_path / "vec.onnx"), "--data", str(tmp_path / "d.npz"), "--batch", "8",
                       "--loss", "cross_entropy", "--no-progress", "-o", str(tmp_path / "r")], capsys)
    assert rc == 2 and "cross_entropy" in err and len(err.strip().splitlines()) == 1


def test_nan_loss_stops_names_the_step_and_keeps_the_last_checkpoint(mlp, capsys) -> None:
    path, tmp = mlp
    x = np.random.default_rng(1).standard_normal((8, 16)).astype(np.float32) * 100
    np.savez(tmp / "one.npz", x=x, y=np.arange(8) % 10)
    # one step per epoch; an absurd learning rate blows the weights up after the first step
    rc, _, err = _run(["train", str(path), "--data", str(tmp / "one.npz"), "--batch", "8", "--epochs", "4",
                       "--lr", "1e30", "--no-progress", "--no-progress", "-o", str(tmp / "r")], capsys)
    assert rc == 1 and "at step" in err and len(err.strip().splitlines()) == 1
    assert "checkpoint_epoch1.onnx" in err
    onnx.checker.check_model(onnx.load(str(tmp / "r" / "checkpoint_epoch1.onnx")))
    _nan_kept_the_last_good_checkpoint(tmp / "r", err)


def _nan_kept_the_last_good_checkpoint(run, err: str) -> None:
    """One step per epoch: the step the error names is the first bad one, so the checkpoint of
    the epoch before it is the last one written, named in the error, its weights finite and equal
    to model.onnx (nothing lost, nothing half-written)."""
    import re

    step = int(re.search(r"at step (\d+)", err).group(1))
    assert step >= 2
    last = run / f"checkpoint_epoch{step - 1}.onnx"
    assert f"checkpoint_epoch{step - 1}.onnx" in err and last.is_file()
    assert not (run / f"checkpoint_epoch{step}.onnx").exists()
    kept, latest = onnx.load(str(last)), onnx.load(str(run / "model.onnx"))
    for a, b in zip(kept.graph.initializer, latest.graph.initializer):
        arr = onnx.numpy_helper.to_array(a)
        assert np.all(np.isfinite(arr)), a.name
        np.testing.assert_array_equal(arr, onnx.numpy_helper.to_array(b))


@pytest.mark.slow
def test_nan_loss_under_mpi_ranks_is_exit_1_with_the_step_named(mlp, capsys) -> None:
    path, tmp = mlp
    x = np.random.default_rng(1).standard_normal((8, 16)).astype(np.float32) * 100
    np.savez(tmp / "one.npz", x=x, y=np.arange(8) % 10)
    rc, _, err = _run(["train", str(path), "--data", str(tmp / "one.npz"), "--batch", "8", "--epochs", "4",
                       "--devices", "2", "--launcher", "mpi", "--lr", "1e30", "--no-progress", "-o",
                       str(tmp / "rmpi")], capsys)
    assert rc == 1 and "at step" in err and len(err.strip().splitlines()) == 1, err
    _nan_kept_the_last_good_checkpoint(tmp / "rmpi", err)


def test_missing_gradient_rule_lists_every_op_exit_2(tmp_path, capsys) -> None:
    g = helper.make_graph([helper.make_node("Sin", ["x"], ["a"]), helper.make_node("MatMul", ["a", "w"], ["b"]),
                           helper.make_node("Cos", ["b"], ["c"]), helper.make_node("Softsign", ["c"], ["y"])], "trig",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [8, 4])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [8, 3])],
                          initializer=[onnx.numpy_helper.from_array(np.ones((4, 3), np.float32), "w")])
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)]), str(tmp_path / "t.onnx"))
    np.savez(tmp_path / "d.npz", x=np.zeros((8, 4), np.float32), y=np.zeros(8, np.int64))
    rc, _, err = _run(["train", str(tmp_path / "t.onnx"), "--data", str(tmp_path / "d.npz"), "--batch", "8",
                       "--no-progress", "-o", str(tmp_path / "r")], capsys)
    # Sin comes before the weight, so it needs no gradient; Cos and Softsign both do, listed at once
    assert rc == 2 and "Cos" in err and "Softsign" in err and "Sin" not in err
    assert len(err.strip().splitlines()) == 1


def test_resume_continues_on_another_device_count_and_refuses_another_model(mlp, capsys) -> None:
    """Resuming epoch 1's checkpoint on 1 device (it was trained on 2) gives the same epoch-2
    losses as the uninterrupted 2-device run (same shuffles: the resumed run uses seed + 1)."""
    path, tmp = mlp
    data = str(tmp / "train.npz")
    base = ["--data", data, "--optimizer", "adam", "--lr", "1e-2", "--batch", "8", "--no-progress"]
    assert main(["train", str(path), *base, "--epochs", "2", "--devices", "2", "-o", str(tmp / "full")]) == 0
    ckpt = tmp / "full" / "checkpoint_epoch1.onnx"
    assert main(["train", str(path), *base, "--epochs", "1", "--devices", "1", "--seed", "1", "--resume", str(ckpt),
                 "-o", str(tmp / "resumed")]) == 0
    capsys.readouterr()
    full = json.loads((tmp / "full" / "history.json").read_text())["steps"]
    resumed = json.loads((tmp / "resumed" / "history.json").read_text())["steps"]
    np.testing.assert_allclose([h["loss"] for h in resumed], [h["loss"] for h in full[8:]], rtol=1e-4, atol=1e-5)
    # the same under mpiexec (the resume path travels to every rank)
    assert main(["train", str(path), *base, "--epochs", "1", "--devices", "2", "--launcher", "mpi", "--seed", "1",
                 "--resume", str(ckpt), "-o", str(tmp / "resumed_mpi")]) == 0
    capsys.readouterr()
    resumed_mpi = json.loads((tmp / "resumed_mpi" / "history.json").read_text())["steps"]
    np.testing.assert_allclose([h["loss"] for h in resumed_mpi], [h["loss"] for h in full[8:]], rtol=1e-4, atol=1e-5)
    other = tmp / "other.onnx"
    onnx.save(models_zoo.build("mlp", batch=8, hidden=48, in_features=16), str(other))
    rc, _, err = _run(["train", str(path), *base, "--resume", str(other), "-o", str(tmp / "x")], capsys)
    assert rc == 2 and "another model" in err and len(err.strip().splitlines()) == 1
