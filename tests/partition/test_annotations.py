"""Annotations already in the model are user constraints (partitioner/strategies/constraints.py):
``auto``, ``data`` and ``hybrid`` keep ``pipeline_stage`` pins and ``ShardingSpec`` layouts, or
refuse in one line saying which annotation they cannot keep. Every plan that is returned is run
(reference backend) and compared with ONNX Runtime (seeded inputs, rtol 1e-4, atol 1e-5).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest

import models_zoo
from partitioner.runtime.in_process import run_reference
from partitioner import cli
from partitioner.core.errors import StrategyNotApplicable
from partitioner.core.model_view import ModelView
from partitioner.partition import partition
from partitioner.core.plan import CONFIGURATION_NAME, Plan, Sharding, annotate_model
from partitioner.strategies.constraints import read_constraints, violation


def _mlp() -> onnx.ModelProto:
    return onnx.shape_inference.infer_shapes(models_zoo.build("mlp", batch=4, hidden=64, in_features=32),
                                             strict_mode=True)


def _pinned(proto: onnx.ModelProto, last_stage0: int) -> onnx.ModelProto:
    """Nodes 0..last_stage0 pinned to stage 0, the rest to stage 1."""
    out = onnx.ModelProto()
    out.CopyFrom(proto)
    for i, node in enumerate(out.graph.node):
        node.device_configurations.append(onnx.NodeDeviceConfigurationProto(
            configuration_id=CONFIGURATION_NAME, pipeline_stage=0 if i <= last_stage0 else 1))
    return out


def _check_ort(proto: onnx.ModelProto, res) -> None:  # noqa: ANN001
    feeds = models_zoo.sample_inputs(proto, 0)
    want = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    got = run_reference(res.programs, res.bindings, feeds, timeout_s=60)
    for o, w in zip(proto.graph.output, want):
        np.testing.assert_allclose(got[o.name], w, rtol=1e-4, atol=1e-5, err_msg=o.name)


def test_stage_pins_are_read_from_proto_and_ir() -> None:
    proto = _pinned(_mlp(), 3)
    from_proto = read_constraints(proto)
    from_ir = read_constraints(ir.serde.deserialize_model(proto))
    assert from_proto.stages == from_ir.stages
    assert sorted(set(from_proto.stages.values())) == [0, 1] and len(from_proto.stages) == len(proto.graph.node)


def test_auto_keeps_stage_pins_and_matches_ort() -> None:
    """Was: an mlp pinned to stages 0/1 got ``single x1`` from auto without a word."""
    proto = _pinned(_mlp(), 3)
    res = partition(ir.serde.deserialize_model(proto), "cpu:2", strategy="auto")
    assert res.plan.num_stages == 2
    for i, node in enumerate(proto.graph.node):
        assert res.plan.nodes[node.name].stage == (0 if i <= 3 else 1), node.name
    dropped = {a["candidate"]: a["not_applicable"] for a in res.alternatives if "not_applicable" in a}
    assert "pipeline_stage" in dropped["single x1"] and "pipeline_stage" in dropped["data x2"]
    _check_ort(proto, res)


@pytest.mark.parametrize("strategy", ["data", "tensor", "single"])
def test_one_stage_strategies_refuse_stage_pins_in_one_line(strategy: str) -> None:
    proto = _pinned(_mlp(), 3)
    with pytest.raises(StrategyNotApplicable, match="annotated pipeline_stage 1") as info:
        partition(ir.serde.deserialize_model(proto), "cpu:1" if strategy == "single" else "cpu:2",
                  strategy=strategy)
    assert "\n" not in str(info.value)


def test_hybrid_keeps_stage_pins_on_a_pipeline_mesh() -> None:
    proto = _pinned(_mlp(), 3)
    res = partition(ir.serde.deserialize_model(proto), "cpu:4", strategy="hybrid")
    assert res.plan.mesh_axes[0] == "pipeline" and res.plan.num_stages == 2
    for i, node in enumerate(proto.graph.node):
        assert res.plan.nodes[node.name].stage == (0 if i <= 3 else 1), node.name
    _check_ort(proto, res)


def test_stage_pins_at_zero_constrain_nothing() -> None:
    proto = _pinned(_mlp(), len(_mlp().graph.node))
    res = partition(ir.serde.deserialize_model(proto), "cpu:2", strategy="data")
    assert res.plan.strategy == "data"


def test_sharding_specs_are_read_and_auto_keeps_them() -> None:
    """A model annotated with a tensor-parallel plan: auto may only return plans with the same
    layouts (data, pipeline and single give other layouts), and data refuses naming the spec."""
    proto = _mlp()
    tensor = partition(ir.serde.deserialize_model(proto), "cpu:2", strategy="tensor")
    annotated = annotate_model(proto, tensor.plan)
    # keep only the sharding specs: no stage pins in this model
    for node in annotated.graph.node:
        for cfg in node.device_configurations:
            cfg.ClearField("pipeline_stage")
    model = ir.serde.deserialize_model(annotated)
    cons = read_constraints(model)
    assert not cons.stages and len(cons.shardings) >= len(proto.graph.node)
    assert any(c.sharding.axis is not None for c in cons.shardings)
    assert violation(tensor.plan, cons, ModelView(model)) == ""
    res = partition(model, "cpu:2", strategy="auto")
    assert res.plan.strategy == "tensor" and res.plan.world_size == 2
    assert violation(res.plan, cons, ModelView(model)) == ""
    _check_ort(proto, res)
    with pytest.raises(StrategyNotApplicable, match="ShardingSpec") as info:
        partition(model, "cpu:2", strategy="data")
    assert "\n" not in str(info.value)


def test_auto_says_why_when_no_plan_keeps_the_annotations() -> None:
    """A weight split over 4 devices cannot be kept on 2: auto refuses in one line."""
    proto = _mlp()
    annotated = annotate_model(proto, Plan("user", 4, (4,), ("tensor",), {}, {}))
    node = annotated.graph.node[0]
    spec = onnx.ShardingSpecProto(tensor_name=node.input[1], device=[0, 1, 2, 3])
    spec.sharded_dim.append(onnx.ShardedDimProto(axis=1, simple_sharding=[onnx.SimpleShardedDimProto(num_shards=4)]))
    node.device_configurations.append(onnx.NodeDeviceConfigurationProto(configuration_id=CONFIGURATION_NAME,
                                                                        sharding_spec=[spec]))
    model = ir.serde.deserialize_model(annotated)
    assert read_constraints(model).shardings[0].sharding == Sharding((0, 1, 2, 3), 1)
    with pytest.raises(StrategyNotApplicable, match="keeps the model's pipeline_stage/ShardingSpec annotations") as info:
        partition(model, "cpu:2", strategy="auto")
    assert "\n" not in str(info.value) and node.name in str(info.value)


def test_cli_plan_keeps_stage_pins(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Through the CLI (load + default passes): the pins survive the passes and auto keeps them."""
    path = tmp_path / "pinned.onnx"
    onnx.save(_pinned(_mlp(), 3), path)
    capsys.readouterr()
    assert cli.main(["plan", str(path), "--devices", "2", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["plan"]["strategy"] == "pipeline" and report["plan"]["world_size"] == 2
    dropped = {a["candidate"]: a["not_applicable"] for a in report["alternatives"] if "not_applicable" in a}
    assert "pipeline_stage" in dropped["single x1"]
