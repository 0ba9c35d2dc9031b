"""OPTIMIZE_PIPELINE on every zoo builder model: same outputs as the original through ORT."""

from __future__ import annotations

import numpy as np
import pytest
from passes_testkit import check_model, op_types, run_ort, seeded_feeds, to_ir, to_proto

import models_zoo
from passes import OPTIMIZE_PIPELINE, run_pipeline
from passes.fusion_groups import fusion_units, groups

SMALL = {
    "mlp": {}, "resnet": {"image": 32, "width": 16}, "resnet50": {"image": 32, "width": 8},
    "bert": {"seq": 8}, "gpt": {"seq": 8}, "unet": {"image": 32, "base": 8},
    "inception": {"image": 32}, "mobilenet": {"image": 32, "width_mult": 0.5},
}
BUILDERS = [e.name for e in models_zoo.list_models() if e.kind == "builder"]


@pytest.mark.parametrize("name", BUILDERS)
def test_optimize_pipeline_keeps_zoo_outputs(name):
    proto = models_zoo.build(name, **SMALL.get(name, {}))
    feeds = seeded_feeds(proto)  # token ids are drawn from 0..3: valid for every vocabulary
    expected = run_ort(proto, feeds)
    model = run_pipeline(to_ir(proto), list(OPTIMIZE_PIPELINE))
    after = to_proto(model)
    check_model(after)
    actual = run_ort(after, feeds)
    assert [o.name for o in after.graph.output] == [o.name for o in proto.graph.output]
    for e, a in zip(expected, actual):
        np.testing.assert_allclose(a, e, rtol=1e-4, atol=1e-5)
    # every node is in exactly one unit, and units are in a topological order
    units = fusion_units(model.graph)
    assert sum(len(u) for u in units) == len(list(model.graph))
    seen: set[int] = {id(v) for v in model.graph.inputs} | {id(v) for v in model.graph.initializers.values()}
    for unit in units:
        produced = {id(o) for n in unit for o in n.outputs}
        for n in unit:
            assert all(v is None or id(v) in seen or id(v) in produced for v in n.inputs)
        seen |= produced
    ops = op_types(model)
    if name in ("resnet", "resnet50", "mobilenet"):
        assert ops.count("BatchNormalization") == 0
    if name in ("bert", "gpt"):
        assert ops.count("LayerNormalization") == op_types(proto).count("LayerNormalization")
        # opset 18 < 20: each decomposed GELU stays, grouped with its MatMul and bias Add
        gelu_groups = [m for m in groups(model.graph).values() if any(n.op_type == "Erf" for n in m)]
        assert len(gelu_groups) == op_types(proto).count("Erf")
        assert all({"MatMul", "Add", "Erf"} <= {n.op_type for n in m} for m in gelu_groups)
