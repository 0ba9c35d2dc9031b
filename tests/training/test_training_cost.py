"""The training cost model (partitioner/cost/training.py): its rules, checked against quantities
computed here from the ONNX model itself, and the ``train --plan`` report."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest

import models_zoo
from partitioner.cli import main
from partitioner.training.plan import predict_training


@pytest.fixture(scope="module")
def mlp() -> onnx.ModelProto:
    return models_zoo.build("mlp", batch=32, hidden=64, in_features=16)


def _weight_bytes(model: onnx.ModelProto) -> int:
    return sum(onnx.numpy_helper.to_array(t).nbytes for t in model.graph.initializer)


def test_optimizer_state_memory_is_weight_copies(mlp) -> None:
    """Rule 3: Adam keeps 2 copies of the weights, momentum 1, SGD none; each state byte is held
    3 times at the step's peak (resident, returned next state, the backend's output buffer)."""
    w = _weight_bytes(mlp)
    mem = {opt: predict_training(mlp, "single", 1, batch=32, optimizer=opt).memory_per_rank[0]
           for opt in ("sgd", "momentum", "adam")}
    assert mem["momentum"] - mem["sgd"] == pytest.approx(3 * w, rel=1e-9)
    assert mem["adam"] - mem["sgd"] == pytest.approx(6 * w, rel=1e-9)
    assert mem["sgd"] > 4 * w  # 3 x weights + gradients + activations


def test_backward_is_about_twice_the_forward_and_data_parallel_adds_the_allreduce(mlp) -> None:
    one = predict_training(mlp, "single", 1, batch=32)
    # up to 2.4: with activations.RELU_MASK_FROM_OUTPUT the backward no longer reads a ReLU's
    # input, so the forward prices each ReLU fused into its Gemm (this mlp: 38.8 -> 30.4 us, the
    # backward 69.2 us either way: 1.78x -> 2.28x)
    assert 1.5 <= one.breakdown["backward_s"] / one.breakdown["forward_s"] <= 2.4
    two = predict_training(mlp, "data", 2, batch=32)
    assert two.breakdown["comm_s"] > 0 and one.breakdown["comm_s"] == 0
    assert two.breakdown["forward_s"] < one.breakdown["forward_s"]  # half the batch per rank
    assert two.samples_per_s == pytest.approx(32 / two.step_time_s)


def test_pipeline_stash_gpipe_against_1f1b(mlp) -> None:
    """Rule 3: GPipe stashes all M micro-batches on every stage, 1F1B at most S - s: stage 0 of
    GPipe needs more memory; the last stage (one in flight either way) the same."""
    g = predict_training(mlp, "pipeline", 2, batch=32, schedule="gpipe", micro_batches=8)
    f = predict_training(mlp, "pipeline", 2, batch=32, schedule="1f1b", micro_batches=8)
    assert g.memory_per_rank[0] > f.memory_per_rank[0]
    assert g.step_time_s == pytest.approx(f.step_time_s)
    assert sum(f.memory_per_rank) < 2 * predict_training(mlp, "single", 1, batch=32).memory_per_rank[0]


def test_tensor_splits_pair_weights_and_adds_f_and_g(mlp) -> None:
    t = predict_training(mlp, "tensor", 2, batch=32, optimizer="adam")
    s = predict_training(mlp, "single", 1, batch=32, optimizer="adam")
    assert t.breakdown["comm_s"] > 0
    assert t.memory_per_rank[0] < s.memory_per_rank[0]


def test_train_plan_prints_prediction_json(tmp_path, capsys) -> None:
    path = tmp_path / "mlp.onnx"
    onnx.save(models_zoo.build("mlp", batch=8, hidden=32, in_features=16), str(path))
    rc = main(["train", str(path), "--data", str(tmp_path / "none.npz"), "--devices", "2", "--strategy", "pipeline",
               "--micro-batches", "4", "--batch", "16", "--optimizer", "adam", "--plan", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["strategy"] == "pipeline" and len(out["memory_per_rank"]) == 2
    assert out["micro_batches"] == 4 and np.isfinite(out["step_time_s"]) and out["step_time_s"] > 0


def test_auto_picks_the_fastest_plan_that_fits_and_trains_like_one_device(mlp) -> None:
    from partitioner.training import train
    from partitioner.training.plan import choose_strategy

    chosen, preds = choose_strategy(mlp, 2, batch=32, optimizer="adam")
    assert set(preds) == {"data", "pipeline", "tensor"}
    assert preds[chosen].samples_per_s == max(p.samples_per_s for p in preds.values())
    # a memory limit under the chosen plan's peak moves the choice to a plan that fits
    limit = max(preds[chosen].memory_per_rank) * 0.999
    fitting = {k for k, p in preds.items() if max(p.memory_per_rank) <= limit}
    if fitting:
        assert choose_strategy(mlp, 2, batch=32, optimizer="adam", memory_limit=limit)[0] in fitting
    with pytest.raises(Exception, match="fits the memory limit"):
        choose_strategy(mlp, 2, batch=32, optimizer="adam", memory_limit=1.0)
    rng = np.random.default_rng(0)
    data = {"x": rng.standard_normal((64, 16)).astype(np.float32), "y": rng.integers(0, 10, 64)}
    common = {"loss": "cross_entropy", "optimizer": "adam", "lr": 1e-2, "batch": 32, "epochs": 1, "progress": False}
    auto = train(mlp, data, devices=2, strategy="auto", **common)
    one = train(mlp, data, devices=1, **common)
    np.testing.assert_allclose([h["loss"] for h in auto.history], [h["loss"] for h in one.history], rtol=1e-4,
                               atol=1e-5)


def test_hybrid_prediction_is_a_replica_pipeline_plus_the_replica_allreduce(mlp) -> None:
    h = predict_training(mlp, "hybrid", 4, batch=32, stages=2, micro_batches=4)
    p = predict_training(mlp, "pipeline", 2, batch=16, micro_batches=4)
    assert h.memory_per_rank == p.memory_per_rank * 2
    assert h.breakdown["replica_allreduce_s"] > 0
    assert h.step_time_s == pytest.approx(p.step_time_s + h.breakdown["replica_allreduce_s"])
    assert sum(p.stage_weight_bytes) == pytest.approx(_weight_bytes(mlp))  # every weight in exactly one stage


def test_memory_limit_picks_a_sharded_plan_and_refuses_one_that_does_not_fit(tmp_path, capsys) -> None:
    """A limit under the data-parallel (replicated) prediction but above a sharded plan's: auto
    trains with a sharded plan; --strategy data is refused with one line, exit 2."""
    model = models_zoo.build("mlp", batch=32, hidden=256, in_features=64)
    onnx.save(model, str(tmp_path / "m.onnx"))
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "d.npz", x=rng.standard_normal((64, 64)).astype(np.float32), y=rng.integers(0, 10, 64))
    data = max(predict_training(model, "data", 2, batch=32, optimizer="adam").memory_per_rank)
    sharded = min(max(predict_training(model, s, 2, batch=32, optimizer="adam").memory_per_rank)
                  for s in ("pipeline", "tensor"))
    assert sharded < data
    limit = str(int((sharded + data) / 2))
    base = ["train", str(tmp_path / "m.onnx"), "--data", str(tmp_path / "d.npz"), "--devices", "2", "--batch", "32",
            "--optimizer", "adam", "--memory-limit", limit, "-o", str(tmp_path / "r")]
    rc = main([*base, "--strategy", "data", "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and "exceeds --memory-limit" in err and len(err.strip().splitlines()) == 1
    rc = main([*base, "--strategy", "auto", "--json"])
    cap = capsys.readouterr()
    assert rc == 0 and json.loads(cap.out)["steps"] == 2


def test_pipeline_cut_respects_the_memory_limit_and_still_trains_like_one_rank(tmp_path, capsys,
                                                                             monkeypatch) -> None:
    """The stage DP under --memory-limit: the default (time-balanced) cut of a small bert exceeds a
    limit 5% under its peak; the memory-aware cut fits it on every rank (the cost model's
    per-stage prediction, 1F1B stash counts) and the pipeline still trains like one rank. The
    cost-model cut (no measured profile): a profile timed on a loaded machine can move the free
    cut onto the fitted one (this failed once while other work loaded the machine)."""
    from partitioner.training import SGD, measured_cut, train
    from partitioner.training.pipeline import build_pipeline

    monkeypatch.setattr(measured_cut, "MEASURED_CUT", False)

    model = models_zoo.build("bert", batch=4, seq=16, hidden=32, heads=2, layers=2, vocab=50)
    free = predict_training(model, "pipeline", 2, batch=4, optimizer="sgd", micro_batches=2)
    limit = 0.95 * max(free.memory_per_rank)
    fitted = predict_training(model, "pipeline", 2, batch=4, optimizer="sgd", micro_batches=2, memory_limit=limit)
    assert max(fitted.memory_per_rank) <= limit < max(free.memory_per_rank)
    plan = build_pipeline(model, "mse", SGD(lr=0.1), batch=4, stages=2, micro_batches=2, memory_limit=limit)
    free_plan = build_pipeline(model, "mse", SGD(lr=0.1), batch=4, stages=2, micro_batches=2)
    assert plan.stages[0].weights != free_plan.stages[0].weights  # the cut moved
    rng = np.random.default_rng(0)
    data = {"x": rng.integers(0, 50, (12, 16)), "y": rng.standard_normal((12, 16, 32)).astype(np.float32)}
    common = {"loss": "mse", "optimizer": "sgd", "lr": 0.1, "batch": 4, "epochs": 1, "progress": False}
    piped = train(model, data, devices=2, strategy="pipeline", micro_batches=2, memory_limit=limit, **common)
    one = train(model, data, devices=1, **common)
    np.testing.assert_allclose([h["loss"] for h in piped.history], [h["loss"] for h in one.history], rtol=1e-4,
                               atol=1e-5)
    onnx.save(model, str(tmp_path / "bert.onnx"))
    np.savez(tmp_path / "d.npz", **data)
    rc = main(["train", str(tmp_path / "bert.onnx"), "--data", str(tmp_path / "d.npz"), "--loss", "mse", "--devices",
               "2", "--strategy", "pipeline", "--batch", "4", "--memory-limit", "1000", "--no-progress", "-o",
               str(tmp_path / "r")])
    err = capsys.readouterr().err
    assert rc == 2 and "fits --memory-limit" in err and len(err.strip().splitlines()) == 1


def test_data_parallel_overlap_is_simulated_beside_the_blocking_step(monkeypatch) -> None:
    """Rule 5: the predicted data-parallel step overlaps the bucket AllReduces with the backward
    (the ONNX Runtime ranks do); ``overlap=False`` (TVM) is forward + backward + AllReduce +
    optimizer. The overlap hides part of the AllReduce only when there are several buckets, and
    never more than the AllReduce or the backward takes. (Buckets of 64 KiB here, for a small
    model to have several; the step builder's default is the cost model's 25 MiB.)"""
    import inspect

    from partitioner.cost import training as cost
    from partitioner.training import buckets
    from partitioner.training.step import build_training_graph

    assert inspect.signature(build_training_graph).parameters["bucket_bytes"].default == cost.BUCKET_BYTES
    monkeypatch.setattr(buckets, "LIST_ALLREDUCE", False)  # both forms pay the concatenation and split
    model = models_zoo.build("mlp", batch=32, hidden=128, in_features=128)  # 4 weights of 64 KiB
    hidden, default = {}, cost.BUCKET_BYTES
    for bucket in (default, 64 * 1024):
        monkeypatch.setattr(cost, "BUCKET_BYTES", bucket)
        over = predict_training(model, "data", 2, batch=32)
        block = predict_training(model, "data", 2, batch=32, overlap=False)
        b = block.breakdown
        assert block.step_time_s == pytest.approx(b["forward_s"] + b["backward_s"] + b["comm_s"] + b["optimizer_s"])
        assert over.step_time_s == pytest.approx(b["step_with_overlap_s"])
        assert b["step_without_overlap_s"] == pytest.approx(block.step_time_s)
        saved = block.step_time_s - over.step_time_s
        assert -1e-12 <= saved <= min(b["comm_s"], b["backward_s"]) * (1 + 1e-9)
        hidden[bucket] = saved / b["comm_s"]  # the share of the AllReduce hidden
    assert hidden[default] < 0.05  # one bucket: ready only when the backward is done
    assert hidden[64 * 1024] > 0.1  # the last layers' buckets reduce while the backward goes on


def _two_convs(batch: int = 4, c: int = 32, hw: int = 16) -> onnx.ModelProto:
    """x -> Conv(w1) -> Conv(w2) -> y: the backward needs dW1, dW2 and dx of the second conv only
    (x is data)."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array((rng.standard_normal((c, c, 3, 3)) * 0.1).astype(np.float32), n)
             for n in ("w1", "w2")]
    nodes = [helper.make_node("Conv", ["x", "w1"], ["h"], name="conv1", pads=[1, 1, 1, 1]),
             helper.make_node("Conv", ["h", "w2"], ["y"], name="conv2", pads=[1, 1, 1, 1])]
    g = helper.make_graph(nodes, "two_convs", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, c, hw, hw])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, c, hw, hw])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])


def test_backward_contractions_run_at_the_calibrated_backward_efficiency() -> None:
    """Rule 1: the backward is costed from the step graph's own nodes; its contractions run at
    their backward class's efficiency when the device has one: the second conv's input gradient
    (a ConvTranspose) at ``conv_backward``, both convs' weight gradients (the GEMM rule's MatMul,
    rules/linear.py) at ``gemm_backward``, each with the forward conv's FLOPs. Halving one class
    from the forward efficiency adds exactly those contractions' time at it (they are compute
    bound), and leaves the forward as it was."""
    import dataclasses

    from partitioner.cluster import cpu_cluster, replicate

    model = _two_convs()
    base = cpu_cluster(1)
    e = 0.5
    dev = dataclasses.replace(base.devices[0], efficiency_by_class={"conv": e, "gemm": e})
    conv_flops = 2 * 4 * 32 * 32 * 9 * 16 * 16  # one 3x3 conv, 32 -> 32 channels, 16x16, batch 4
    peak = dev.peak("float32")
    for cls, count in (("conv_backward", 1), ("gemm_backward", 2)):
        slow = dataclasses.replace(dev, efficiency_by_class={"conv": e, "gemm": e, cls: e / 2})
        same, half = (predict_training(model, "single", 1, batch=4, loss="mse",
                                       cluster=replicate(dataclasses.replace(base, devices=[d]), 1)) for d in (dev, slow))
        assert half.breakdown["forward_s"] == pytest.approx(same.breakdown["forward_s"], rel=1e-12)
        extra = half.breakdown["backward_s"] - same.breakdown["backward_s"]
        assert extra == pytest.approx(count * conv_flops / (peak * e), rel=1e-6), cls


def test_step_graph_costing_counts_every_step_node_once(mlp) -> None:
    """Rule 1's attribution: forward + backward + the loss over all forward nodes equals the
    roofline of every node of the step graph but the optimizer's (each counted once, none lost),
    on a device with no backward class (so each node runs at its own class's efficiency)."""
    import onnx_ir as ir

    from partitioner.cluster import cpu_cluster
    from partitioner.cost.roofline import graph_op_times
    from partitioner.cost.training import profile, step_times
    from partitioner.training.optimizers import make_optimizer
    from partitioner.training.step import _load, build_training_graph, default_trainable

    device = cpu_cluster(1).devices[0]
    step = build_training_graph(mlp, loss="cross_entropy", optimizer=make_optimizer("sgd", 1e-3), batch=32)
    graph = _load(mlp, 32).graph
    prof = profile(graph, device, set(default_trainable(graph)), step.graph)
    times = graph_op_times(step.graph, device)
    kept = sum(t for n, t in zip(step.graph, times) if n.metadata_props.get("training.forward_node") != "optimizer")
    assert float(prof.forward.sum() + prof.backward.sum()) == pytest.approx(kept, rel=1e-9)
    assert isinstance(step, ir.Model)
    # without the step graph: the factor rule (rule 1's fallback), a different figure
    old = profile(graph, device, set(default_trainable(graph)))
    assert float(old.backward.sum()) != pytest.approx(float(prof.backward.sum()), rel=1e-3)


def test_backward_probes_do_the_forward_convs_and_gemms_work() -> None:
    """The calibration's training probes (calibrate.backward_kernels): each gradient form has
    the FLOPs of the forward kernel it differentiates (hand-counted here), so their efficiency is
    comparable with the forward classes'; a cluster file may carry their classes."""
    from partitioner.calibrate import backward_kernels, kernel_model, kernel_roof
    from partitioner.cluster import Cluster, Device, cpu_cluster

    peak = 1e11
    dev = Device("probe", "cpu", {"float32": peak}, 1e9, 1e15)  # bandwidth high: compute bound
    flops = {"gemm": 2 * 128 * 256 * 256, "conv64": 2 * 4 * 64 * 64 * 9 * 28 * 28,
             "conv256": 2 * 4 * 256 * 256 * 9 * 7 * 7, "conv256_4": 2 * 4 * 256 * 256 * 9 * 4 * 4,
             "conv512_2": 2 * 4 * 512 * 512 * 9 * 2 * 2, "gemm_large": 2 * 256 * 1024 * 1024}
    for k in (k for k in backward_kernels() if k.op_class not in ("where", "reduce_batch")):  # contractions only
        want = flops["gemm_large" if "1024x1024" in k.name else "conv256_4" if "256c_4" in k.name
                     else "conv512_2" if "512c_2" in k.name
                     else "conv64" if "64c" in k.name else "conv256" if "256c" in k.name else "gemm"]
        roof, launches = kernel_roof(kernel_model(k), dev)
        assert roof == pytest.approx(want / peak, rel=1e-6), k.name
        assert launches == 1
    c = cpu_cluster(1)
    doc = c.to_json()
    doc["devices"][0]["efficiency_by_class"] = {"gemm": 0.9, "gemm_backward": 0.7, "conv_backward": 0.3}
    back = Cluster.from_json(doc)
    assert back.devices[0].class_efficiency("conv_backward") == 0.3


def test_forward_convs_of_a_step_run_at_the_training_form_probe(monkeypatch) -> None:
    """Rule 1 (``forward_class``): a step's forward convs take their weights as graph inputs and
    run at ``conv_train`` when the device has it: halving it from ``conv`` adds exactly the two
    forward convs' time (compute bound, 16x16 maps: no small-map term) and leaves the backward
    as it was. Fails with ``TRAIN_FORWARD_PROBES`` off (checked: the forward is then unchanged)."""
    import dataclasses

    from partitioner.cluster import cpu_cluster, replicate
    from partitioner.cost import training as cost_training

    model = _two_convs()
    base = cpu_cluster(1)
    e = 0.5
    dev = dataclasses.replace(base.devices[0], efficiency_by_class={"conv": e, "gemm": e})
    slow = dataclasses.replace(dev, efficiency_by_class={"conv": e, "gemm": e, "conv_train": e / 2})
    conv_flops = 2 * 4 * 32 * 32 * 9 * 16 * 16
    same, half = (predict_training(model, "single", 1, batch=4, loss="mse",
                                   cluster=replicate(dataclasses.replace(base, devices=[d]), 1)) for d in (dev, slow))
    assert half.breakdown["backward_s"] == pytest.approx(same.breakdown["backward_s"], rel=1e-12)
    extra = half.breakdown["forward_s"] - same.breakdown["forward_s"]
    assert extra == pytest.approx(2 * conv_flops / (dev.peak("float32") * e), rel=1e-6)
    assert cost_training.forward_class(slow, "gemm") == "gemm"
    monkeypatch.setattr(cost_training, "TRAIN_FORWARD_PROBES", False)
    assert cost_training.forward_class(slow, "conv") == "conv"
