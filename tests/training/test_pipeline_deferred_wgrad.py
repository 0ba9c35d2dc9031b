"""Pipeline rule 10 (:mod:`partitioner.training.deferred_wgrad`): weight gradients deferred to one
whole-batch program per stage and step, against 1 rank (10 steps, SGD and AdamW, weights within
rtol 1e-4, atol 1e-5) and, for a BatchNormalization CNN (micro-batch statistics, so no 1-rank
equivalence), against the same pipeline with the knob off."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import models_zoo
from partitioner.runtime.comm_local import LocalWorld
from partitioner.training import SGD, AdamW, build_training_graph, deferred_wgrad
from partitioner.training.deferred_wgrad import batch_axis
from partitioner.training.pipeline import build_pipeline
from partitioner.training.pipeline_runner import PipelineRunner, gathered_state
from partitioner.training.runner import StepRunner
from tests.training.test_pipeline_training import _run_pipeline

TOL = {"rtol": 1e-4, "atol": 1e-5}


def _runners(plan) -> list[PipelineRunner]:
    world = LocalWorld(plan.num_stages, timeout_s=60)
    return [PipelineRunner(plan, s, comm=world.communicator(s)) for s in range(plan.num_stages)]


def _outputs(program) -> set[str]:
    return {o.name for o in program.graph.output} if program is not None else set()


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("optimizer", [SGD(lr=0.1), AdamW(lr=1e-2, weight_decay=0.01)], ids=["sgd", "adamw"])
@pytest.mark.parametrize("earlier", [False, True], ids=["last", "every"])
def test_deferred_weight_gradients_match_one_rank(schedule, optimizer, earlier, monkeypatch) -> None:
    """The mlp (Gemm and MatMul+Add layers, batch 8 in 4 micro-batches): every weight gradient of
    a deferring stage (the last; every stage with DEFER_EARLIER_STAGES) is deferred (no
    per-micro-batch program outputs one; the whole-batch program outputs them all), and 10 steps
    match 1 rank. Fails with DEFER_WEIGHT_GRADIENTS off (no whole-batch program)."""
    monkeypatch.setattr(deferred_wgrad, "DEFER_EARLIER_STAGES", earlier)
    monkeypatch.setattr(deferred_wgrad, "DEFER_ALWAYS", True)  # not the timing-dependent choice (deferred_cut)
    model = models_zoo.build("mlp", batch=8, hidden=32, in_features=16)
    rng = np.random.default_rng(5)
    batches = [(rng.standard_normal((8, 16)).astype(np.float32), rng.integers(0, 10, 8)) for _ in range(10)]
    plan = build_pipeline(model, "cross_entropy", optimizer, batch=8, stages=2, micro_batches=4, schedule=schedule)
    assert plan.stages[0].weight_grad is None if not earlier else True
    for st in plan.stages if earlier else plan.stages[-1:]:
        grads = {f"{w}.grad" for w in st.weights}
        assert st.weight_grad is not None and _outputs(st.weight_grad) == grads
        per_micro = _outputs(st.forward) | _outputs(st.backward) | _outputs(st.fused)
        assert not per_micro & grads
        assert st.w_stash and all(st.w_axes[v] == 0 for v in st.w_stash)  # [batch, features] values
    one = StepRunner(build_training_graph(model, optimizer=optimizer))
    one_losses = [one.step({"input": x}, y) for x, y in batches]
    runners = _runners(plan)
    np.testing.assert_allclose(_run_pipeline(runners, batches), one_losses, **TOL)
    full = gathered_state(runners)
    for name, w in one.state.items():
        np.testing.assert_allclose(full[name], w, err_msg=name, **TOL)


def _bn_cnn() -> onnx.ModelProto:
    """Conv+BN+Relu, Conv(stride 2)+Relu, GlobalAveragePool, Flatten, Gemm: 8x3x8x8 -> 10."""
    rng = np.random.default_rng(1)

    def init(name, *shape, scale=0.3):
        return numpy_helper.from_array((rng.standard_normal(shape) * scale).astype(np.float32), name)

    inits = [init("c1.w", 6, 3, 3, 3), init("c1.b", 6), numpy_helper.from_array(np.ones(6, np.float32), "bn.s"),
             numpy_helper.from_array(np.zeros(6, np.float32), "bn.b"),
             numpy_helper.from_array(np.zeros(6, np.float32), "bn.mean"),
             numpy_helper.from_array(np.ones(6, np.float32), "bn.var"), init("c2.w", 8, 6, 3, 3), init("fc.w", 10, 8),
             init("fc.b", 10)]
    nodes = [helper.make_node("Conv", ["x", "c1.w", "c1.b"], ["c1"], pads=[1, 1, 1, 1], name="c1"),
             helper.make_node("BatchNormalization", ["c1", "bn.s", "bn.b", "bn.mean", "bn.var"], ["bn"], name="bn"),
             helper.make_node("Relu", ["bn"], ["r1"], name="r1"),
             helper.make_node("Conv", ["r1", "c2.w"], ["c2"], pads=[1, 1, 1, 1], strides=[2, 2], name="c2"),
             helper.make_node("Relu", ["c2"], ["r2"], name="r2"),
             helper.make_node("GlobalAveragePool", ["r2"], ["gap"], name="gap"),
             helper.make_node("Flatten", ["gap"], ["flat"], name="flat"),
             helper.make_node("Gemm", ["flat", "fc.w", "fc.b"], ["logits"], transB=1, name="fc")]
    graph = helper.make_graph(nodes, "bn_cnn", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [8, 3, 8, 8])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [8, 10])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _train_bn(defer: bool, monkeypatch) -> tuple[object, dict[str, np.ndarray], list[float]]:
    monkeypatch.setattr(deferred_wgrad, "DEFER_WEIGHT_GRADIENTS", defer)
    monkeypatch.setattr(deferred_wgrad, "DEFER_EARLIER_STAGES", True)  # both stages' programs checked
    monkeypatch.setattr(deferred_wgrad, "DEFER_ALWAYS", True)
    plan = build_pipeline(_bn_cnn(), "cross_entropy", SGD(lr=0.05), batch=8, stages=2, micro_batches=4)
    rng = np.random.default_rng(2)
    batches = [(rng.standard_normal((8, 3, 8, 8)).astype(np.float32), rng.integers(0, 10, 8)) for _ in range(10)]
    runners = _runners(plan)
    losses = []
    for x, y in batches:
        losses += _run_pipeline_x(runners, x, y)
    return plan, gathered_state(runners), losses


def _run_pipeline_x(runners, x, y) -> list[float]:
    import threading

    out: list[float | None] = [None] * len(runners)
    threads = [threading.Thread(target=lambda r=r: out.__setitem__(r, runners[r].step({"x": x}, y)))
               for r in range(len(runners))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert all(o is not None for o in out)
    return [out[0]]


def test_batchnorm_cnn_deferred_matches_per_micro_batch_gradients(monkeypatch) -> None:
    """Rule 2 on convolutions (NCHW values, batch axis 0) and BatchNormalization: the conv
    weights are deferred, the BN scale and bias (their gradient reads a per-micro-batch sum
    shared with the input gradient) stay per micro-batch; 10 SGD steps equal the same pipeline
    with the knob off (both use micro-batch statistics, rule 7)."""
    plan_on, state_on, losses_on = _train_bn(True, monkeypatch)
    plan_off, state_off, losses_off = _train_bn(False, monkeypatch)
    deferred = set().union(*(_outputs(st.weight_grad) for st in plan_on.stages))
    assert {"c1.w.grad", "c2.w.grad", "fc.w.grad"} <= deferred
    assert all(st.weight_grad is None for st in plan_off.stages)
    np.testing.assert_allclose(losses_on, losses_off, **TOL)
    assert sorted(state_on) == sorted(state_off)
    for name, w in state_off.items():
        np.testing.assert_allclose(state_on[name], w, err_msg=name, **TOL)


def test_no_deferral_under_a_memory_limit_or_one_micro_batch() -> None:
    """Rule 4: a ``--memory-limit`` plan keeps 1F1B's stash bound (no whole-batch program)."""
    model = models_zoo.build("mlp", batch=8, hidden=32, in_features=16)
    limited = build_pipeline(model, "cross_entropy", SGD(lr=0.1), batch=8, stages=2, micro_batches=4,
                             memory_limit=2**30)
    single = build_pipeline(model, "cross_entropy", SGD(lr=0.1), batch=8, stages=2, micro_batches=1)
    assert all(st.weight_grad is None for st in limited.stages + single.stages)


def test_batch_axis() -> None:
    assert batch_axis((2, 16), (16, 16), 8) == 0
    assert batch_axis((4, 2, 8), (4, 16, 8), 8) == 1
    assert batch_axis((16,), (16,), 8) is None  # no batch axis: a per-micro-batch statistic
    assert batch_axis((2, 3), (16, 24), 8) is None  # two axes grew
    assert batch_axis((2, 3), (8, 3), 8) is None  # grew, but not M times


def test_measured_cut_profiles_the_deferred_programs(monkeypatch, tmp_path) -> None:
    """measured_cut rule 7: a deferring plan measures, in the same interleaved runs, rule 1's
    gradients-only step at the micro-batch and the last stage's prices: its per-micro-batch
    program at the micro-batch plus its weight-gradient program at the whole batch; both rows
    cached in one entry, every node priced (fails with the knob off: one program, one row)."""
    from partitioner.training import measured_cut

    monkeypatch.setattr(measured_cut, "_cache_file", lambda key: tmp_path / f"{key}.npy")
    profiled: list[list[tuple[str, int]]] = []
    run = measured_cut._run_profiles

    def spy(steps, names):
        profiled.append([(s.graph.name, s.graph.input[0].type.tensor_type.shape.dim[0].dim_value) for s in steps])
        return run(steps, names)

    monkeypatch.setattr(measured_cut, "_run_profiles", spy)
    monkeypatch.setattr(deferred_wgrad, "DEFER_ALWAYS", True)
    model = models_zoo.build("mlp", batch=8, hidden=32, in_features=16)
    plan = build_pipeline(model, "cross_entropy", SGD(lr=0.1), batch=8, stages=2, micro_batches=4)
    assert plan.cut == measured_cut.MEASURED
    assert len(profiled) == 1 and len(profiled[0]) == 3, profiled
    (_, step_rows), (fb, fb_rows), (w, w_rows) = profiled[0]
    assert (step_rows, fb_rows, w_rows) == (2, 2, 8) and fb.endswith(".FB") and w.endswith(".W")
    files = list(tmp_path.glob("*.npy"))
    assert len(files) == 1
    t = np.load(files[0])
    assert t.shape == (3, len(model.graph.node)) and (t[:2] > 0).all() and (t[2] >= 0).all()
    assert (t[2] <= t[1]).all() and t[2].sum() > 0  # the weight-gradient share is part of the deferring price


def test_deferred_cut_defers_only_small_weight_gradients() -> None:
    """Rule 10's choice (deferred_wgrad rule 6): the mlp at micro-batches of 2 rows (its weight
    gradients sum over 2 rows, <= DEFER_MAX_ROWS) defers its last stage; at 128 rows it does not
    and keeps rule 1's cut; the zoo resnet-18 on 64x64 at 2 images defers (layer4's 2x2 maps)."""
    from partitioner.training.pipeline import deferred_cut, stage_cut
    from partitioner.training.step import _load

    model = models_zoo.build("mlp", batch=1024, layers=4, hidden=32, in_features=16)
    for micro, expect in ((2, True), (128, False)):
        graph = _load(model, micro).graph
        rows = np.stack([np.ones(len(list(graph))), np.full(len(list(graph)), 0.5), np.zeros(len(list(graph)))])
        ends, defer = deferred_cut(graph, 2, 8, rows)
        assert defer is expect
        if not expect:
            assert ends == stage_cut(graph, 2, seconds=rows[0])[0]
    resnet = _load(models_zoo.build("resnet", batch=16, image=64, classes=10), 2).graph
    n = len(list(resnet))
    assert deferred_cut(resnet, 2, 8, np.stack([np.ones(n), np.ones(n), np.zeros(n)]))[1]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("optimizer", [SGD(lr=0.1), AdamW(lr=1e-2, weight_decay=0.01)], ids=["sgd", "adamw"])
def test_tail_deferral_matches_one_rank(schedule, optimizer, monkeypatch) -> None:
    """deferred_wgrad rule 7 (the ZB-H1 tail): where rule 6 does not defer the whole batch
    (DEFER_MAX_ROWS 0 here), the last stage runs its full program for micro-batches 0-1 and the
    program without weight gradients for the last 2 (``FBt``, called twice per step), and one
    weight-gradient program over those 2 added to the sum; 10 steps match 1 rank (rtol 1e-4,
    atol 1e-5). Fails with DEFER_TAIL_MICRO_BATCHES 0 (no tail program)."""
    monkeypatch.setattr(deferred_wgrad, "DEFER_MAX_ROWS", 0)
    model = models_zoo.build("mlp", batch=8, hidden=32, in_features=16)
    rng = np.random.default_rng(7)
    batches = [(rng.standard_normal((8, 16)).astype(np.float32), rng.integers(0, 10, 8)) for _ in range(10)]
    plan = build_pipeline(model, "cross_entropy", optimizer, batch=8, stages=2, micro_batches=4, schedule=schedule)
    first, last = plan.stages
    grads = {f"{w}.grad" for w in last.weights}
    assert first.weight_grad is None and first.fused_tail is None
    assert last.w_tail == 2 and last.fused_tail is not None, "no tail deferral"
    assert grads <= _outputs(last.fused) and not grads & _outputs(last.fused_tail)
    assert _outputs(last.weight_grad) == grads
    assert last.weight_grad.graph.input[0].type.tensor_type.shape.dim[0].dim_value == 4  # 2 micro-batches of 2
    one = StepRunner(build_training_graph(model, optimizer=optimizer))
    one_losses = [one.step({"input": x}, y) for x, y in batches]
    runners = _runners(plan)
    calls = {"FB": 0, "FBt": 0, "W": 0}
    for kind in calls:
        exe = runners[-1]._exe[kind]
        exe.run = (lambda f, k=kind: lambda *a: (calls.__setitem__(k, calls[k] + 1), f(*a))[1])(exe.run)
    np.testing.assert_allclose(_run_pipeline(runners, batches), one_losses, **TOL)
    assert calls == {"FB": 20, "FBt": 20, "W": 10}, calls
    full = gathered_state(runners)
    for name, w in one.state.items():
        np.testing.assert_allclose(full[name], w, err_msg=name, **TOL)


def test_tail_only_where_the_last_stage_gradients_are_big(monkeypatch) -> None:
    """deferred_wgrad rule 7's choice: the train_step mlp (128-row micro-batches, above
    DEFER_MAX_ROWS) defers its last 2 micro-batches; the resnet-18 at 2 images (layer4's 2x2
    maps, small) does not (a TVM plan keeps per-micro-batch gradients there); neither with the
    knob at 0 or with no more micro-batches than the tail."""
    from partitioner.training.pipeline import _tail, stage_cut
    from partitioner.training.step import _load

    mlp = _load(models_zoo.build("mlp", batch=1024, layers=4, hidden=64, in_features=16), 128).graph
    mlp_ends = stage_cut(mlp, 2)[0]
    resnet = _load(models_zoo.build("resnet", batch=16, image=64, classes=10), 2).graph
    n = len(list(resnet))
    assert _tail(mlp, mlp_ends, 8) == 2
    assert _tail(resnet, [n // 2, n - 1], 8) == 0
    assert _tail(mlp, mlp_ends, 2) == 0
    monkeypatch.setattr(deferred_wgrad, "DEFER_TAIL_MICRO_BATCHES", 0)
    assert _tail(mlp, mlp_ends, 8) == 0


def test_tvm_tail_deferral_matches_one_rank(monkeypatch, tmp_path) -> None:
    """deferred_wgrad rule 7 on a TVM plan (DEFER_MAX_ROWS 0: its weight gradients count as big):
    the last stage has the tail programs, and 4 SGD steps of its 2 TVM stages match a 1-rank
    ONNX Runtime step (rtol 1e-4, atol 1e-5). Fails with DEFER_TAIL_MICRO_BATCHES 0."""
    from .test_pipeline_training import _tvm_pipeline_trains_like_one_rank

    monkeypatch.setattr(deferred_wgrad, "DEFER_MAX_ROWS", 0)
    model = models_zoo.build("mlp", batch=8, hidden=32, in_features=16)
    plan = build_pipeline(model, "cross_entropy", SGD(lr=0.1), batch=8, stages=2, micro_batches=4, backend="tvm")
    last = plan.stages[-1]
    assert last.w_tail == 2 and last.fused_tail is not None and last.weight_grad is not None, "no tail on TVM"
    _tvm_pipeline_trains_like_one_rank(model, plan, (16,), tmp_path)
