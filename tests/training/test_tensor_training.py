"""Tensor-parallel (Megatron MLP) training on 2 ranks against 1 rank on the same global batch.

The zoo mlp has two pairs (fc0 -> fc1, fc2 -> head): column then row split, g (AllReduce) after
each row product in the forward, f (AllReduce of the input gradient) before a column product in
the backward where the input needs a gradient. After 10 steps the gathered weights (and Adam's
moments) must match 1 rank within rtol 1e-4, atol 1e-5.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import models_zoo
from partitioner.cli import main
from partitioner.core.comm_ops import DOMAIN
from partitioner.training import SGD, AdamW, build_training_graph
from partitioner.training.runner import StepRunner
from partitioner.training.tensor import find_pairs, tensor_runners
from tests.training.rank_threads import step_ranks


def _mlp() -> onnx.ModelProto:
    return models_zoo.build("mlp", batch=8, hidden=32, in_features=16)


@pytest.mark.parametrize("optimizer", [SGD(lr=0.1), AdamW(lr=1e-2, weight_decay=0.01)], ids=["sgd", "adamw"])
def test_two_tensor_ranks_match_one_rank_after_10_steps(optimizer) -> None:
    model = _mlp()
    rng = np.random.default_rng(3)
    batches = [(rng.standard_normal((8, 16)).astype(np.float32), rng.integers(0, 10, 8)) for _ in range(10)]
    one = StepRunner(build_training_graph(model, optimizer=optimizer))
    one_losses = [one.step({"input": x}, y) for x, y in batches]
    _, runners = tensor_runners(model, "cross_entropy", optimizer, batch=8, devices=2, trainable=None,
                                backend="onnxruntime", comm=None, out=None, threads=1, state=None)
    comm = [n for n in runners[0].program.graph.node if n.domain == DOMAIN]
    # g after both row products (forward); f's AllReduce only for fc2's input (fc0's input is data)
    assert len(comm) == 3 and sum(n.name.startswith("tp.g.") for n in comm) == 2
    assert runners[0].state["fc0.weight"].shape == (16, 16) and runners[0].state["head.weight"].shape == (10, 16)
    losses = []
    for x, y in batches:
        out = step_ranks(runners, lambda r, x=x, y=y: ({"input": x}, y))
        assert out[0] == out[1]
        losses.append(out[0])
    np.testing.assert_allclose(losses, one_losses, rtol=1e-4, atol=1e-5)
    full = runners[0].gather_state(runners)
    assert sorted(full) == sorted(one.state)
    for name, w in one.state.items():
        np.testing.assert_allclose(full[name], w, rtol=1e-4, atol=1e-5, err_msg=name)


def test_pairs_need_an_activation_between_products() -> None:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])
    w1 = helper.make_tensor("w1", TensorProto.FLOAT, [4, 6], np.ones(24, np.float32))
    w2 = helper.make_tensor("w2", TensorProto.FLOAT, [6, 3], np.ones(18, np.float32))
    linear = helper.make_graph([helper.make_node("MatMul", ["x", "w1"], ["h"]), helper.make_node("MatMul", ["h", "w2"], ["y"])],
                               "g", [x], [y], [w1, w2])
    assert find_pairs(linear) == []
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"]), helper.make_node("Tanh", ["h"], ["t"]),
             helper.make_node("MatMul", ["t", "w2"], ["y"])]
    assert [(c.op_type, [n.op_type for n in ch], r.op_type)
            for c, ch, r in find_pairs(helper.make_graph(nodes, "g", [x], [y], [w1, w2]))] == [("MatMul", ["Tanh"], "MatMul")]


def test_tensor_train_api_matches_one_device_and_refuses_a_model_without_pairs(tmp_path, capsys) -> None:
    from partitioner.training import train

    rng = np.random.default_rng(0)
    data = {"x": rng.standard_normal((24, 16)).astype(np.float32), "y": rng.integers(0, 10, 24)}
    common = {"loss": "cross_entropy", "optimizer": "adam", "lr": 1e-2, "batch": 8, "epochs": 1, "progress": False}
    tp = train(_mlp(), data, devices=2, strategy="tensor", **common)
    one = train(_mlp(), data, devices=1, **common)
    np.testing.assert_allclose([h["loss"] for h in tp.history], [h["loss"] for h in one.history], rtol=1e-4, atol=1e-5)
    for a, b in zip(tp.model.graph.initializer, one.model.graph.initializer):
        assert a.dims == b.dims
        np.testing.assert_allclose(onnx.numpy_helper.to_array(a), onnx.numpy_helper.to_array(b), rtol=1e-4, atol=1e-5)
    single = helper.make_model(helper.make_graph(
        [helper.make_node("Gemm", ["input", "w", "b"], ["logits"], transB=1)], "linear",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, [8, 16])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [8, 10])],
        [helper.make_tensor("w", TensorProto.FLOAT, [10, 16], rng.standard_normal(160).astype(np.float32)),
         helper.make_tensor("b", TensorProto.FLOAT, [10], np.zeros(10, np.float32))]),
        opset_imports=[helper.make_opsetid("", 18)])
    onnx.save(single, str(tmp_path / "linear.onnx"))
    np.savez(tmp_path / "d.npz", **data)
    rc = main(["train", str(tmp_path / "linear.onnx"), "--data", str(tmp_path / "d.npz"), "--strategy", "tensor",
               "--devices", "2", "--batch", "8", "--no-progress", "-o", str(tmp_path / "r")])
    err = capsys.readouterr().err
    assert rc == 2 and "no Megatron pair" in err and len(err.strip().splitlines()) == 1


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_tvm_tensor_ranks_under_mpi_match_one_rank(tmp_path, optimizer) -> None:
    """2 TVM ranks under mpiexec (comm ops in the forward and the backward) against 1 ONNX
    Runtime rank, 10 steps."""
    from partitioner.training import train

    model = tmp_path / "mlp.onnx"
    onnx.save(_mlp(), str(model))
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "d.npz", x=rng.standard_normal((80, 16)).astype(np.float32), y=rng.integers(0, 10, 80))
    common = {"loss": "cross_entropy", "optimizer": optimizer, "lr": 1e-2 if optimizer == "adam" else 0.1,
              "batch": 8, "epochs": 1, "progress": False}
    single = train(str(model), str(tmp_path / "d.npz"), out_dir=tmp_path / "s", devices=1, **common)
    tvm = train(str(model), str(tmp_path / "d.npz"), out_dir=tmp_path / "t", devices=2, strategy="tensor",
                launcher="mpi", backend="tvm", **common)
    assert len(tvm.history) == 10
    np.testing.assert_allclose([h["loss"] for h in tvm.history], [h["loss"] for h in single.history],
                               rtol=1e-4, atol=1e-5)
    for a, b in zip(tvm.model.graph.initializer, single.model.graph.initializer):
        np.testing.assert_allclose(onnx.numpy_helper.to_array(a), onnx.numpy_helper.to_array(b), rtol=1e-4,
                                   atol=1e-5, err_msg=a.name)


@pytest.mark.slow
def test_bert_mlp_pairs_with_erf_gelu_train_like_one_rank() -> None:
    """The zoo bert's MLPs (GELU written with Div/Erf/Add/Mul and scalar constants) are pairs too;
    2 tensor ranks follow 1 rank for 5 SGD steps (Adam is left out: the attention key bias has an
    analytically zero gradient, and Adam normalises its float noise to +-lr)."""
    model = models_zoo.build("bert", batch=2, seq=8, hidden=32, heads=2, layers=2, vocab=50)
    assert len(find_pairs(model.graph)) == 2
    rng = np.random.default_rng(3)
    batches = [(rng.integers(0, 50, (2, 8)), rng.standard_normal((2, 8, 32)).astype(np.float32)) for _ in range(5)]
    one = StepRunner(build_training_graph(model, loss="mse", optimizer=SGD(lr=0.1)))
    want = [one.step({"input_ids": x}, y) for x, y in batches]
    _, runners = tensor_runners(model, "mse", SGD(lr=0.1), batch=2, devices=2, trainable=None, backend="onnxruntime",
                                comm=None, out=None, threads=1, state=None)
    got = []
    for x, y in batches:
        got.append(step_ranks(runners, lambda r, x=x, y=y: ({"input_ids": x}, y))[0])
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    full = runners[0].gather_state(runners)
    for name, w in one.state.items():
        np.testing.assert_allclose(full[name], w, rtol=1e-4, atol=1e-5, err_msg=name)
