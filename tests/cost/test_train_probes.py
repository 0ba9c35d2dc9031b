"""The training probes added for issue 16's step-time target (calibrate.backward_kernels,
cost/training.py rule 1): the ReLU gradient's Where at its own calibrated class, and the
ConvTranspose probes in the form the training step runs them (weights as a graph input)."""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest


def _linear_relu_linear(batch: int = 64, width: int = 256):
    """x -> MatMul(w1) -> Relu -> MatMul(w2) -> y: the backward has one ReLU gradient (a Where)."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array((rng.standard_normal((width, width)) * 0.1).astype(np.float32), n)
             for n in ("w1", "w2")]
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"], name="fc1"),
             helper.make_node("Relu", ["h"], ["r"], name="relu"),
             helper.make_node("MatMul", ["r", "w2"], ["y"], name="fc2")]
    g = helper.make_graph(nodes, "lrl", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, width])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, width])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])


def test_relu_gradient_where_runs_at_the_where_class() -> None:
    """Rule 1 (``node_class``): with a calibrated ``where`` class a tenth of ``elementwise``, the
    step's one Where (the ReLU gradient: condition [64, 256] bool, dy [64, 256] float, a scalar
    zero, output [64, 256] float; memory bound) costs 10x its elementwise memory time, and nothing
    else changes: the predicted backward grows by exactly 9x that time (hand-counted bytes below).
    Fails with ``TRAIN_WHERE_CLASS`` off (checked: the backward is then unchanged)."""
    from partitioner.cluster import cpu_cluster, replicate
    from partitioner.training.plan import predict_training

    base = cpu_cluster(1)
    e = 2.0
    dev = dataclasses.replace(base.devices[0], efficiency_by_class={"elementwise": e, "gemm": 1.0})
    slow = dataclasses.replace(dev, efficiency_by_class={"elementwise": e, "gemm": 1.0, "where": e / 10})
    same, where = (predict_training(_linear_relu_linear(), "single", 1, batch=64, loss="mse",
                                    cluster=replicate(dataclasses.replace(base, devices=[d]), 1)) for d in (dev, slow))
    n = 64 * 256
    where_bytes = n * 1 + n * 4 + 4 + n * 4  # cond (bool), dy, the scalar zero, dx
    t_elem = where_bytes / (dev.memory_bandwidth * e)
    assert where.breakdown["forward_s"] == pytest.approx(same.breakdown["forward_s"], rel=1e-12)
    assert where.breakdown["backward_s"] - same.breakdown["backward_s"] == pytest.approx(9 * t_elem, rel=1e-6)


def test_where_probe_is_the_relu_gradient_form() -> None:
    """The ``where`` probe is one Where whose condition is a bool input (``mask``) with about
    half its entries true, and the calibration's roofline prices it with the same byte count as
    a step's Where (one formula for calibrating and predicting); a cluster file may carry the
    class. Fails with ``WHERE_PROBE`` off (no such probe)."""
    import onnx

    from partitioner.calibrate import _feeds, backward_kernels, kernel_model, kernel_roof
    from partitioner.cluster import Cluster, Device, cpu_cluster

    k = next(k for k in backward_kernels() if k.op_class == "where")
    model = kernel_model(k)
    assert [n.op_type for n in model.graph.node] == ["Where"]
    assert model.graph.input[0].type.tensor_type.elem_type == onnx.TensorProto.BOOL
    mask = _feeds(k)["mask"]
    assert mask.dtype == np.bool_ and 0.4 < mask.mean() < 0.6
    bw = 1e9
    dev = Device("probe", "cpu", {"float32": 1e15}, 1e9, bw)  # compute free: memory bound
    n = int(np.prod(mask.shape))
    roof, launches = kernel_roof(model, dev)
    assert roof == pytest.approx((n * 1 + n * 4 + 4 + n * 4) / bw, rel=1e-6)
    assert launches == 1
    doc = cpu_cluster(1).to_json()
    doc["devices"][0]["efficiency_by_class"] = {"elementwise": 2.0, "where": 0.2}
    assert Cluster.from_json(doc).devices[0].class_efficiency("where") == 0.2


def test_conv_transpose_probes_take_their_weights_as_an_input() -> None:
    """Every ConvTranspose probe (``conv_backward`` and its small-map points) takes its filter as
    a graph input, as the training step does (ONNX Runtime prepacks only a constant filter);
    the FLOPs are the forward conv's either way. Fails with ``CONV_TRANSPOSE_WEIGHT_INPUT`` off
    (the filter is then an initializer)."""
    from partitioner.calibrate import backward_kernels, kernel_model

    probes = [k for k in backward_kernels() if any(op == "ConvTranspose" for op, *_ in k.nodes)]
    assert {k.op_class for k in probes} == {"conv_backward", "conv_backward_px16", "conv_backward_px4"}
    for k in probes:
        model = kernel_model(k)
        assert "w" in {v.name for v in model.graph.input}, k.name
        assert not model.graph.initializer, k.name


def _batched_matmul(batch: int = 8, tokens: int = 16, k: int = 64, n: int = 128):
    """x [batch, tokens, k] -> MatMul(w [k, n]) -> y: the weight gradient is a batched product
    summed over the batch (a ReduceSum over axis 0 of [batch, k, n])."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    w = numpy_helper.from_array((rng.standard_normal((k, n)) * 0.1).astype(np.float32), "w")
    g = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"], name="fc")], "bmm",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, tokens, k])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, tokens, n])], [w])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])


def test_batched_weight_gradient_sum_runs_at_the_reduce_batch_class(monkeypatch) -> None:
    """Rule 1 (``node_class``): a ReduceSum over axis 0 of a 3-D tensor (the batched MatMul's
    weight gradient, [8, 64, 128] -> [1, 64, 128]) runs at ``reduce_batch`` when calibrated: at
    a tenth of ``reduction`` the backward grows by exactly 9x its memory time at ``reduction``
    (hand-counted bytes: the input, the output and the 8-byte axes), the forward not at all.
    Fails with ``TRAIN_REDUCE_BATCH_CLASS`` off (checked: the backward is then unchanged). The
    step is built with the flat MatMul weight gradient rule off (``linear.MATMUL_FLAT_WEIGHT_GRAD``:
    on, this MatMul's weight gradient is one Gemm and has no such sum)."""
    from partitioner.cluster import cpu_cluster, replicate
    from partitioner.cost.training import _sums_the_batch
    from partitioner.training.optimizers import make_optimizer
    from partitioner.training.plan import predict_training
    from partitioner.training.rules import linear
    from partitioner.training.step import build_training_graph

    monkeypatch.setattr(linear, "MATMUL_FLAT_WEIGHT_GRAD", False)

    step = build_training_graph(_batched_matmul(), loss="mse", optimizer=make_optimizer("sgd", 1e-3), batch=8)
    assert sum(_sums_the_batch(n) for n in step.graph) == 1
    base = cpu_cluster(1)
    e = 0.5
    table = {"reduction": e, "gemm": 1.0, "gemm_backward": 1.0, "elementwise": 2.0}
    dev = dataclasses.replace(base.devices[0], efficiency_by_class=table)
    slow = dataclasses.replace(dev, efficiency_by_class={**table, "reduce_batch": e / 10})
    same, summed = (predict_training(_batched_matmul(), "single", 1, batch=8, loss="mse",
                                     cluster=replicate(dataclasses.replace(base, devices=[d]), 1)) for d in (dev, slow))
    nbytes = 4 * (8 * 64 * 128 + 64 * 128) + 8
    assert summed.breakdown["forward_s"] == pytest.approx(same.breakdown["forward_s"], rel=1e-12)
    assert summed.breakdown["backward_s"] - same.breakdown["backward_s"] == \
        pytest.approx(9 * nbytes / (dev.memory_bandwidth * e), rel=1e-6)


def test_reduce_batch_probe_is_the_weight_gradient_sum() -> None:
    """The ``reduce_batch`` probe is a ReduceSum over axis 0 of a [4, 256, 1024] input (batch 4,
    as the other backward probes), its axes a Constant node. Fails with
    ``REDUCE_BATCH_PROBE`` off (no such probe)."""
    import onnx_ir as ir

    from partitioner.calibrate import backward_kernels, kernel_model

    k = next(k for k in backward_kernels() if k.op_class == "reduce_batch")
    graph = ir.serde.deserialize_model(kernel_model(k)).graph
    reduce = next(n for n in graph if n.op_type == "ReduceSum")
    assert list(reduce.inputs[0].shape) == [4, 256, 1024]
    assert reduce.inputs[1].producer().op_type == "Constant"


def test_onnxruntime_optimizer_is_priced_from_the_steps_update_nodes() -> None:
    """Rule 2 (``optimizer_seconds``): on an ONNX Runtime device the SGD update is its step
    nodes, each its own kernel: ``Mul(g, lr)`` (reads g and the scalar, writes g's size) and
    ``Sub(W, that)`` (reads two, writes one): 5 weight-sized passes (hand-counted) at the
    elementwise rate plus two launches; on a TVM device the fused formula's 3 passes at the
    copy bandwidth. Fails with ``OPTIMIZER_FROM_STEP`` off (the ONNX Runtime device then gets the
    formula too)."""
    from partitioner.cluster import cpu_cluster, replicate
    from partitioner.training.plan import predict_training

    base = cpu_cluster(1)
    e = 2.0
    table = {"elementwise": e, "gemm": 1.0, "gemm_backward": 1.0, "reduction": 1.0}
    got = {}
    for runtime in ("onnxruntime", "tvm"):
        dev = dataclasses.replace(base.devices[0], efficiency_by_class=table, runtime=runtime)
        got[runtime] = predict_training(_batched_matmul(), "single", 1, batch=8, loss="mse",
                                        cluster=replicate(dataclasses.replace(base, devices=[dev]), 1))
    dev = base.devices[0]
    w = 64 * 128 * 4
    ort = (2 * w + 4 + 3 * w) / (dev.memory_bandwidth * e) + 2 * dev.launch_overhead_s
    assert got["onnxruntime"].breakdown["optimizer_s"] == pytest.approx(ort, rel=1e-9)
    assert got["tvm"].breakdown["optimizer_s"] == pytest.approx(3 * w / dev.memory_bandwidth, rel=1e-9)


def test_cpu_clock_calibration_leaves_out_time_off_the_cpu(monkeypatch) -> None:
    """``PARTITIONER_CALIBRATE_CLOCK=cpu`` times the probes in the process's CPU time: a
    probe that sleeps 2 ms (time a loaded machine gives other processes) measures near 0 with
    it and at least 2 ms without (the default, wall time)."""
    import time

    from partitioner.calibrate import CLOCK_ENV, _median_time

    monkeypatch.delenv(CLOCK_ENV, raising=False)
    assert _median_time(lambda: time.sleep(0.002), quick=True) >= 0.002
    monkeypatch.setenv(CLOCK_ENV, "cpu")
    assert _median_time(lambda: time.sleep(0.002), quick=True) < 0.0005


@pytest.mark.parametrize("backend", ["onnxruntime", "tvm"])
def test_new_probes_build_and_run_on_both_backends(backend, tmp_path) -> None:
    """The session-9 probes (``where``, ``reduce_batch``, the 16 MiB maps) build and run on
    both backends' calibration runners (TVM's ONNX importer refused a Constant's ``value_ints``,
    which failed ``partitioner calibrate --backend tvm`` as a whole)."""
    from partitioner.calibrate import _feeds, _runner, kernel_model, micro_kernels

    classes = {"where", "reduce_batch", "elementwise_large", "data_movement_large"}
    probes = [k for k in micro_kernels(quick=True) if k.op_class in classes]
    assert {k.op_class for k in probes} == classes
    for k in probes:
        out = _runner(backend, kernel_model(k), tmp_path)(_feeds(k))
        assert len(out) == len(k.outputs), k.name


def test_probes_are_timed_in_interleaved_rounds(monkeypatch, tmp_path) -> None:
    """``calibrate._time_kernels``: every kernel is built first, then timed in ``PROBE_ROUNDS``
    rounds, each round every kernel in turn (the order rotated); a kernel's time is the median of
    its rounds. A fake runner whose one kernel is slow in one round only (a burst of load) keeps
    its usual time. Fails with the kernels timed back to back (one round)."""
    import partitioner.calibrate as cal

    kernels = [k for k in cal.micro_kernels(True) if k.name in ("gemm_128x256x256", "conv3x3_32c_16")]
    order: list[str] = []
    rounds = {"n": 0}

    def runner(backend, model, work, threads=1):
        def run(feeds):
            order.append(model.graph.name)
        return run

    def median_time(fn, quick, share=1.0):
        fn()
        rounds["n"] += 1
        slow = order[-1] == "conv3x3_32c_16" and rounds["n"] <= 2  # its first round only
        return 5.0 if slow else 1.0

    monkeypatch.setattr(cal, "_runner", runner)
    monkeypatch.setattr(cal, "_median_time", median_time)
    monkeypatch.setattr(cal, "PROBE_ROUNDS", 5)
    monkeypatch.delenv(cal.ROUNDS_ENV, raising=False)
    device = cal.Device("probe", "cpu", {"float32": 1e11}, 1e9, 2e10)
    rows = cal._time_kernels(kernels, "tvm", tmp_path, True, device)
    assert order == ["gemm_128x256x256", "conv3x3_32c_16", "conv3x3_32c_16", "gemm_128x256x256"] * 2 \
        + ["gemm_128x256x256", "conv3x3_32c_16"]
    assert [r["measured_s"] for r in rows] == [1.0, 1.0]
    assert [len(r["rounds_s"]) for r in rows] == [5, 5]


def test_tvm_weight_input_probes_feed_the_weight_read_only() -> None:
    """``calibrate._resident_weights``: on TVM the ``w`` input (a weight as a graph input) is a
    read-only copy (the executable then copies it once, not every run); other inputs and ONNX
    Runtime feeds are as given."""
    from partitioner.calibrate import _resident_weights

    feeds = {"x": np.ones((2, 2), np.float32), "w": np.ones((2, 2), np.float32)}
    tvm = _resident_weights(feeds, "tvm")
    assert not tvm["w"].flags.writeable and tvm["x"] is feeds["x"] and feeds["w"].flags.writeable
    assert _resident_weights(feeds, "onnxruntime") is feeds


@pytest.mark.parametrize("value", ["x", "0", "-3", "2.5", ""])
def test_a_bad_rounds_value_is_one_line_and_exit_2(value, monkeypatch, tmp_path, capsys) -> None:
    """``$PARTITIONER_CALIBRATE_ROUNDS`` is read when the probes run, not at import: a bad value
    does not break ``import partitioner.calibrate`` (every command imports it), and
    ``partitioner calibrate`` refuses it in one line with exit 2 before any probe starts (the
    probe subprocess is replaced by one that fails the test)."""
    import subprocess
    import sys

    env = {**os.environ, "PARTITIONER_CALIBRATE_ROUNDS": value}
    out = subprocess.run([sys.executable, "-c", "import partitioner.calibrate"], env=env,
                         capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr

    import partitioner.calibrate as cal
    from partitioner.cli import main

    def no_probe(*args, **kwargs):
        raise AssertionError("a probe started with a bad rounds value")

    monkeypatch.setattr(cal, "_run_probe", no_probe)
    monkeypatch.setenv("PARTITIONER_CALIBRATION", str(tmp_path / "local.json"))
    monkeypatch.setenv(cal.ROUNDS_ENV, value)
    assert main(["calibrate", "--quick"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "PARTITIONER_CALIBRATE_ROUNDS" in err, err
    assert not (tmp_path / "local.json").exists()


def test_good_rounds_values_are_read_when_used(monkeypatch) -> None:
    """``probe_rounds``: unset gives the default, a whole number >= 1 is taken as given."""
    import partitioner.calibrate as cal

    monkeypatch.delenv(cal.ROUNDS_ENV, raising=False)
    assert cal.probe_rounds() == cal.PROBE_ROUNDS == 5
    monkeypatch.setenv(cal.ROUNDS_ENV, "1")
    assert cal.probe_rounds() == 1
    monkeypatch.setenv(cal.ROUNDS_ENV, " 7 ")
    assert cal.probe_rounds() == 7
