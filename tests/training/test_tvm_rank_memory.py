"""A TVM 1-rank or data-parallel training rank's predicted peak (``cost.memory.tvm_rank_memory``,
issue 16): its libraries priced by their own Relax memory plans (``backends.tvm.planned_memory``).

Fast: the planned allocations of a hand-built program against bytes derived here from its shapes;
the programs the cost model prices are the ones a TVM ``StepRunner`` builds; the rule's terms on
a small mlp (the state from the zoo model's weight shapes, the window from the step's buckets);
the knob off gives rule 3's sum. Slow: ``train --bench --backend tvm`` on 1 rank and on 2 data
ranks, the predicted peak within 25% of the measured one (the rule 3 price of the same runs, made
for ONNX Runtime's arena, is printed beside it).
"""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import models_zoo
from backends.tvm.planned_memory import planned_bytes
from partitioner.cli import main
from partitioner.cost import memory
from partitioner.training import SGD
from partitioner.training.loop import bucket_bytes
from partitioner.training.plan import predict_training
from partitioner.training.step import build_training_graph, signature

N, K, M = 64, 256, 512  # x [N, K] @ w [K, M]


def _program() -> onnx.ModelProto:
    """``relu(x @ w) + 1`` with both operands inputs (a weight the library does not hold)."""
    g = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Relu", ["h"], ["r"]),
         helper.make_node("Add", ["r", "one"], ["y"])],
        "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [N, K]),
              helper.make_tensor_value_info("w", TensorProto.FLOAT, [K, M])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [N, M])],
        initializer=[onnx.numpy_helper.from_array(np.ones((1,), np.float32), "one")])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def test_planned_bytes_of_a_program_against_its_shapes() -> None:
    p = planned_bytes(_program())
    assert p is not None
    assert p.outputs == N * M * 4  # the one result, a fresh tensor per call
    # the product (or its fused form) is planned; nothing near the inputs' size is invented
    assert 0 <= p.storage <= 4 * (N * M + K * M) * 4
    assert planned_bytes(_program()) is p  # cached per program


def test_the_priced_programs_are_the_runners() -> None:
    """1 rank: the forward and backward's library and the update's (overlap rule 9); a data rank:
    one per segment between its AllReduces (overlap rule 7); every program lowers."""
    from partitioner.training.runner import tvm_rank_programs

    model = models_zoo.build("mlp", batch=16, hidden=64, in_features=32)
    one = build_training_graph(model, optimizer=SGD(lr=0.1), batch=16)
    progs = tvm_rank_programs(one)
    assert len(progs) == 2
    assert not any(n.op_type == "AllReduce" for p in progs for n in p.graph.node)
    two = build_training_graph(model, optimizer=SGD(lr=0.1), batch=8, world_size=2)
    reduced = sum(1 for n in two.graph if n.op_type == "AllReduce")
    progs2 = tvm_rank_programs(two)
    assert reduced >= 1 and len(progs2) >= 2
    assert all(planned_bytes(p) is not None for p in progs + progs2)


def _state_bytes(model: onnx.ModelProto) -> float:
    return float(sum(onnx.numpy_helper.to_array(t).nbytes for t in model.graph.initializer))


def test_rule_terms_on_a_small_mlp(monkeypatch) -> None:
    """Single: 2 x the state (SGD: the weights) + the libraries' plans + the batch's buffers.
    Data on 2 ranks with 1 MiB+ buckets: + 2 slots of the largest bucket. Off: rule 3's sum."""
    model = models_zoo.build("mlp", batch=64, hidden=512, in_features=512)
    weights = _state_bytes(model)
    single = predict_training(model, "single", 1, batch=64, backend="tvm").memory_per_rank[0]
    step = build_training_graph(model, optimizer=SGD(lr=1e-3), batch=64)
    from partitioner.training.runner import tvm_rank_programs

    libs = sum(planned_bytes(p).total for p in tvm_rank_programs(step))
    sig = signature(step)
    batch_bytes = sum(memory.value_bytes(v) for p in tvm_rank_programs(step) for v in p.graph.input
                      if v.name in set(sig.data) | {sig.labels})
    assert batch_bytes >= 64 * 512 * 4  # at least the data batch once
    assert single == pytest.approx(2 * weights + libs + batch_bytes)

    data = predict_training(model, "data", 2, batch=64, backend="tvm").memory_per_rank
    step2 = build_training_graph(model, optimizer=SGD(lr=1e-3), batch=32, world_size=2,
                                 bucket_bytes=bucket_bytes("tvm", 1))  # as train builds a TVM data rank
    buckets = [float(np.prod(n.inputs[0].shape.numpy())) * 4 for n in step2.graph if n.op_type == "AllReduce"]
    libs2 = sum(planned_bytes(p).total for p in tvm_rank_programs(step2))
    batch2 = sum(memory.value_bytes(v) for p in tvm_rank_programs(step2) for v in p.graph.input
                 if v.name in set(sig.data) | {sig.labels})
    assert max(buckets) >= 2**20
    assert data == [pytest.approx(2 * weights + libs2 + batch2 + 2 * max(buckets))] * 2

    monkeypatch.setattr(memory, "TVM_PLANNED_MEMORY", False)
    off = predict_training(model, "single", 1, batch=64, backend="tvm").memory_per_rank[0]
    assert off != pytest.approx(single)
    assert off == predict_training(model, "single", 1, batch=64).memory_per_rank[0]  # rule 3, as ONNX Runtime


@pytest.mark.slow
@pytest.mark.parametrize("devices,strategy", [(1, "single"), (2, "data")])
def test_tvm_rank_peak_within_25pct(tmp_path, capsys, devices, strategy) -> None:
    """The zoo bert as ``benchmarks/train_step.py`` trains it (2 layers, 256 wide, sequence 64,
    batch 32, MSE against random targets, SGD): rule 3 priced its TVM 1-rank step
    +50% over the measured peak (session 22); this rule within 25%, every rank."""
    model = models_zoo.build("bert", batch=32, seq=64, hidden=256, heads=4, layers=2)
    path = tmp_path / "m.onnx"
    onnx.save(model, str(path))
    rng = np.random.default_rng(2)
    out = [d.dim_value for d in model.graph.output[0].type.tensor_type.shape.dim]
    np.savez(tmp_path / "d.npz", x=rng.integers(0, 50, (64, 64)).astype(np.int64),
             y=rng.standard_normal([64] + out[1:]).astype(np.float32))
    rc = main(["train", str(path), "--data", str(tmp_path / "d.npz"), "--loss", "mse", "--batch", "32",
               "--devices", str(devices),
               "--strategy", strategy, "--backend", "tvm", "--no-progress", "--bench", "--json",
               "-o", str(tmp_path / "run")])
    doc = json.loads(capsys.readouterr().out)
    assert rc == 0 and len(doc["memory_per_rank"]) == devices
    for m in doc["memory_per_rank"]:
        print(strategy, m)
        assert m["window_reset"], m
        assert 0.75 <= m["ratio"] <= 1.25, m
