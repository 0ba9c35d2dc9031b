"""Partitioning end to end: plans lowered to per-rank programs, run in one process with
LocalWorld comms (run_reference) and compared with an unpartitioned ONNX Runtime run
(seeded inputs, rtol 1e-4, atol 1e-5)."""

from __future__ import annotations

import time
from collections import Counter

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

import models_zoo
from partitioner.cluster import Cluster, gpu_cluster
from partitioner.core import comm_ops
from partitioner.core.bindings import Bindings, Placement, TensorBinding
from partitioner.core.errors import StrategyNotApplicable, VerifyError
from partitioner.core.model_view import ModelView
from partitioner.core.plan import Plan, annotate_model, pinned_stages
from partitioner.lowering.lower import check_programs, lower, verify_programs
from partitioner.partition import partition
from partitioner.runtime.in_process import run_reference
from partitioner.strategies import pipeline as pipeline_strategy

from applicability import DEVICES, MODELS, STRATEGIES, partition_as_expected

SMALL = {
    "mlp": dict(batch=4, hidden=64, in_features=32),
    "gpt": dict(batch=4, seq=16, hidden=32, heads=4, vocab=64),
    "bert": dict(batch=4, seq=16, hidden=32, heads=4, vocab=64),
    "resnet": dict(batch=4, image=32, width=8, classes=10),
    "resnet50": dict(batch=4, image=32, width=8),
    "inception": dict(batch=4, image=32),
    "unet": dict(batch=4, image=32),
    "mobilenet": dict(batch=4, image=32),
}


def load(name: str, **kw) -> tuple[onnx.ModelProto, ir.Model]:
    proto = onnx.shape_inference.infer_shapes(models_zoo.build(name, **{**SMALL[name], **kw}), strict_mode=True)
    return proto, ir.serde.deserialize_model(proto)


def feeds_for(proto: onnx.ModelProto) -> dict[str, np.ndarray]:
    return models_zoo.sample_inputs(proto, 0)


def check_against_ort(name: str, strategy: str, devices: int) -> None:
    """Partition ``name`` and compare with ONNX Runtime; a refusal must be the one the
    applicability table (tests/partition/applicability.py) lists, never a silent pass."""
    proto, model = load(name)
    batch = SMALL[name]["batch"]
    res = partition_as_expected(name, strategy, devices, batch, lambda: partition(
        model, Cluster.resolve(f"cpu:{devices}"), strategy=strategy, degree=devices))
    if res is None:
        return
    check_programs(res.programs)
    verify_programs(res.programs, res.bindings)
    feeds = feeds_for(proto)
    ref = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    got = run_reference(res.programs, res.bindings, feeds, timeout_s=60)
    for out, want in zip(proto.graph.output, ref):
        np.testing.assert_allclose(got[out.name], want, rtol=1e-4, atol=1e-5, err_msg=f"{name} {strategy} x{devices}")


FAST = [("mlp", "tensor", 2), ("gpt", "tensor", 2), ("bert", "data", 2), ("resnet", "spatial", 2),
        ("inception", "pipeline", 2), ("unet", "pipeline", 2), ("mlp", "single", 1), ("resnet", "hybrid", 4)]


@pytest.mark.parametrize("name,strategy,devices", FAST)
def test_matches_onnxruntime_fast(name: str, strategy: str, devices: int) -> None:
    check_against_ort(name, strategy, devices)


@pytest.mark.parametrize("devices", DEVICES)
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("name", MODELS)
def test_applicability_table(name: str, strategy: str, devices: int) -> None:
    """Every cell of the table, partition only (fast): applies, or is refused with its reason."""
    _, model = load(name)
    res = partition_as_expected(name, strategy, devices, SMALL[name]["batch"], lambda: partition(
        model, Cluster.resolve(f"cpu:{devices}"), strategy=strategy, degree=devices))
    if res is not None:
        assert res.plan.world_size == devices and res.plan.strategy == strategy


@pytest.mark.slow
@pytest.mark.parametrize("devices", [2, 4])
@pytest.mark.parametrize("strategy", ["data", "pipeline", "tensor", "spatial", "hybrid"])
@pytest.mark.parametrize("name", list(SMALL))
def test_matches_onnxruntime_all(name: str, strategy: str, devices: int) -> None:
    check_against_ort(name, strategy, devices)


def test_data_parallel_says_why_on_batch_1() -> None:
    _, model = load("mlp", batch=1)
    with pytest.raises(StrategyNotApplicable, match="batch 1 < 2 devices"):
        partition(model, Cluster.resolve("cpu:2"), strategy="data")


@pytest.mark.parametrize("name", ["bert", "gpt"])
def test_megatron_two_allreduce_per_layer(name: str) -> None:
    _, model = load(name, layers=3)
    res = partition(model, Cluster.resolve("cpu:2"), strategy="tensor")
    view = ModelView(model)
    for prog in res.programs:
        per_layer: dict[str, Counter] = {}
        for node in prog.graph.node:
            if node.domain != comm_ops.DOMAIN:
                continue
            value = node.input[0]
            base = value.split("__")[0]
            producer = view.producer.get(base, "")
            layer = producer.split(".")[0] if producer.startswith("layer") else "outside"
            per_layer.setdefault(layer, Counter())[node.op_type] += 1
        for i in range(3):
            assert per_layer[f"layer{i}"] == Counter({"AllReduce": 2}), per_layer


@pytest.mark.parametrize("strategy", ["tensor", "pipeline"])
def test_parameter_bytes_sum_to_original(strategy: str) -> None:
    _, model = load("gpt", layers=2)
    view = ModelView(model)
    total = view.param_bytes()
    small = sum(view.nbytes(n) for n in view.initializers if len(view.shape(n)) <= 1 or view.nbytes(n) <= 4096)
    res = partition(model, Cluster.resolve("cpu:2"), strategy=strategy)
    per_rank = [sum(np.prod(t.dims) * 4 for t in p.graph.initializer if t.data_type == TensorProto.FLOAT)
                for p in res.programs]
    big = total - small
    assert sum(per_rank) >= big
    assert sum(per_rank) <= total + small * (len(per_rank) - 1) + 1024


def test_pipeline_dp_equals_brute_force_chain() -> None:
    rng = np.random.default_rng(1)
    for _ in range(20):
        n, p = 7, 3
        base = rng.uniform(0.1, 2.0, n)
        times = [base * rng.uniform(0.5, 1.5) for _ in range(p)]  # heterogeneous devices
        send = rng.uniform(0.0, 1.0, n - 1)
        ends, best = pipeline_strategy.best_split(times, send)
        assert best == pytest.approx(pipeline_strategy.brute_force_split(times, send))
        assert ends[-1] == n - 1 and ends == sorted(ends)


def _branchy_model() -> ir.Model:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 8])
    nodes = [helper.make_node("Relu", ["x"], ["a"], name="n0"),
             helper.make_node("Sigmoid", ["a"], ["b"], name="n1"),
             helper.make_node("Tanh", ["a"], ["c"], name="n2"),
             helper.make_node("Exp", ["b"], ["d"], name="n3"),
             helper.make_node("Neg", ["c"], ["e"], name="n4"),
             helper.make_node("Add", ["d", "e"], ["f"], name="n5"),
             helper.make_node("Mul", ["f", "a"], ["g"], name="n6"),
             helper.make_node("Abs", ["g"], ["y"], name="n7")]
    proto = helper.make_model(helper.make_graph(nodes, "branchy", [x], [y]), opset_imports=[helper.make_opsetid("", 18)])
    return ir.serde.deserialize_model(onnx.shape_inference.infer_shapes(proto, strict_mode=True))


def test_pipeline_dp_equals_brute_force_branchy_dag() -> None:
    model = _branchy_model()
    view = ModelView(model)
    order = [n.name for n in view.nodes]
    cut = pipeline_strategy.cut_bytes(view, order)
    # the skip a -> n6 crosses every boundary between n0 and n6
    assert cut[0] == 64 and cut[3] == 64 * 3  # after n3: a (to n6), c (to n4), d (to n5)
    rng = np.random.default_rng(2)
    for p in (2, 3, 4):
        times = [rng.uniform(0.5, 1.5, len(order)) for _ in range(p)]
        send = cut[:-1] * 1e-3
        _, best = pipeline_strategy.best_split(times, send)
        assert best == pytest.approx(pipeline_strategy.brute_force_split(times, send))
    proto = ir.serde.serialize_model(model)
    res = partition(model, Cluster.resolve("cpu:3"), strategy="pipeline")
    feeds = {"x": np.random.default_rng(0).standard_normal((2, 8)).astype(np.float32)}
    want = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    np.testing.assert_allclose(run_reference(res.programs, res.bindings, feeds)["y"], want, rtol=1e-4, atol=1e-5)


def test_pinned_stage_is_honoured_and_plan_round_trips() -> None:
    proto, model = load("mlp")
    last = model.graph.node(len(model.graph) - 1) if hasattr(model.graph, "node") else list(model.graph)[-1]
    first = list(model.graph)[0]
    pinned = annotate_model(proto, Plan("user", 2, (2,), ("pipeline",), {}, {}))
    for node in pinned.graph.node:
        if node.name == first.name:
            node.device_configurations.append(onnx.NodeDeviceConfigurationProto(configuration_id="partitioner", pipeline_stage=1))
    with pytest.raises(StrategyNotApplicable):  # stage 1 cannot precede stage 0 in a chain
        partition(ir.serde.deserialize_model(pinned), Cluster.resolve("cpu:2"), strategy="pipeline")
    for node in pinned.graph.node:
        del node.device_configurations[:]
        if node.name == last.name or node.name == list(model.graph)[1].name:
            node.device_configurations.append(onnx.NodeDeviceConfigurationProto(configuration_id="partitioner", pipeline_stage=1))
    pm = ir.serde.deserialize_model(pinned)
    assert pinned_stages(pm)[last.name] == 1
    res = partition(pm, Cluster.resolve("cpu:2"), strategy="pipeline")
    assert res.plan.nodes[list(model.graph)[1].name].stage == 1
    assert Plan.from_json(res.plan.to_json()) == res.plan
    ann = annotate_model(proto, res.plan)
    assert ann.configuration[0].num_devices == 2
    stages = {n.name: n.device_configurations[0].pipeline_stage for n in ann.graph.node}
    assert stages[last.name] == 1 and stages[first.name] == 0


def test_auto_respects_memory_limit() -> None:
    _, model = load("gpt", layers=4, hidden=64, vocab=256)
    weights = ModelView(model).param_bytes()
    limit = weights * 0.6
    res = partition(model, Cluster.resolve("cpu:4"), strategy="auto", memory_limit=limit)
    assert res.prediction["fits_memory"]
    assert max(d["peak_memory_bytes"] for d in res.prediction["per_device"]) <= limit
    params = [sum(np.prod(t.dims) * 4 for t in p.graph.initializer if t.data_type == TensorProto.FLOAT) for p in res.programs]
    assert max(params) < limit
    assert "which fits" in res.explanation and res.alternatives


@pytest.mark.slow
def test_auto_search_48_layer_gpt_32_devices_is_fast() -> None:
    proto = onnx.shape_inference.infer_shapes(models_zoo.build("gpt", batch=4, layers=48), strict_mode=True)
    model = ir.serde.deserialize_model(proto)
    t = time.perf_counter()
    res = partition(model, gpu_cluster("h200", 4, 8), strategy="auto")
    assert time.perf_counter() - t < 30
    assert res.plan.world_size <= 32


def _recv(peer: int, tag: int, out: str) -> onnx.NodeProto:
    return comm_ops.make_node("Recv", [], [out], name=f"recv{tag}", peer=peer, tag=tag, shape=[2], dtype=TensorProto.FLOAT)


def test_hand_made_deadlock_is_caught() -> None:
    progs = []
    for r in range(2):
        nodes = [_recv(1 - r, 10 + r, "y"),
                 comm_ops.make_node("Send", ["x"], [], name="send", peer=1 - r, tag=11 - r)]
        g = helper.make_graph(nodes, f"r{r}", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
        progs.append(helper.make_model(g, opset_imports=[helper.make_opsetid("", 18), comm_ops.opset_import()]))
    b = Bindings((TensorBinding("x", (2,), "float32", (Placement(0, "x"), Placement(1, "x"))),),
                 (TensorBinding("y", (2,), "float32", (Placement(0, "y"),)),), 2)
    with pytest.raises(VerifyError, match="deadlock.*rank 0.*rank 1"):
        verify_programs(progs, b)
    # the same programs with Send first on both ranks are fine
    for p in progs:
        nodes = list(p.graph.node)
        del p.graph.node[:]
        p.graph.node.extend([nodes[1], nodes[0]])
    verify_programs(progs, b)


def test_unmatched_send_is_caught() -> None:
    _, model = load("mlp")
    res = partition(model, Cluster.resolve("cpu:2"), strategy="pipeline")
    progs = [onnx.ModelProto() for _ in res.programs]
    for p, q in zip(progs, res.programs):
        p.CopyFrom(q)
    recvs = [n for n in progs[1].graph.node if n.op_type == "Recv"]
    progs[1].graph.node.remove(recvs[0])
    with pytest.raises(VerifyError):
        verify_programs(progs, res.bindings)


@pytest.mark.parametrize("devices", [2, 4])
def test_one_weird_trick_splits_the_classifier(devices: int) -> None:
    """Data-parallel convolutions, tensor-parallel classifier (survey §6.4): the batch is gathered
    once before the classifier, whose weight each rank holds 1/devices of."""
    from partitioner.strategies import hybrid

    proto, model = load("resnet", classes=8)  # 8 classes: the weight's columns divide by 2 and 4
    view = ModelView(model)
    plan = hybrid.data_conv_tensor_fc(view, devices, None)
    low = lower(view, plan)
    fc = next(n for n in proto.graph.node if n.op_type == "Gemm")
    full = next(t for t in proto.graph.initializer if t.name == fc.input[1])
    for prog in low.programs:
        comm = Counter(n.op_type for n in prog.graph.node if n.domain == comm_ops.DOMAIN)
        assert comm == {"AllGather": 1}
        w = next(t for t in prog.graph.initializer if t.name.startswith(fc.input[1]))
        assert np.prod(w.dims) * devices == np.prod(full.dims)
    feeds = feeds_for(proto)
    ref = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    got = run_reference(low.programs, low.bindings, feeds, timeout_s=60)
    np.testing.assert_allclose(got[proto.graph.output[0].name], ref[0], rtol=1e-4, atol=1e-5)


def test_pipeline_never_cuts_a_fusion_group() -> None:
    """After the optimisation passes, Conv+Relu / Add+Relu groups are single kernels: stage
    boundaries fall between groups, and the result still matches ONNX Runtime."""
    from passes import run_pipeline
    from passes.fusion_groups import group_of

    proto, _ = load("resnet")
    model = run_pipeline(ir.serde.deserialize_model(proto), ["optimize"])
    groups = {group_of(n) for n in model.graph if group_of(n)}
    assert len(groups) >= 10
    res = partition(model, Cluster.resolve("cpu:4"), strategy="pipeline", degree=4)
    stage_of_group: dict[str, set[int]] = {}
    for n in model.graph:
        if group_of(n):
            stage_of_group.setdefault(group_of(n), set()).add(res.plan.nodes[n.name].stage)
    assert all(len(s) == 1 for s in stage_of_group.values())
    assert res.plan.num_stages == 4
    feeds = feeds_for(proto)
    ref = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    got = run_reference(res.programs, res.bindings, feeds, timeout_s=60)
    np.testing.assert_allclose(got[proto.graph.output[0].name], ref[0], rtol=1e-4, atol=1e-5)
