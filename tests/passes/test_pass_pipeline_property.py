"""Property test: the default pipeline keeps random small graphs valid and numerically equal."""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx import helper
from passes_testkit import assert_same_outputs, check_model, const, make_model, op_types, tensor_info, to_ir

import passes

_UNARY = ("Relu", "Neg", "Tanh", "Identity", "Sigmoid")
_BINARY = ("Add", "Mul", "Sub")


@st.composite
def random_graphs(draw):
    """A DAG over x[2,3] and two constants, with dead branches, duplicates and identities."""
    values = ["x", "c0", "c1"]
    nodes = []
    for k in range(draw(st.integers(2, 10))):
        out = f"v{k}"
        if draw(st.booleans()):
            op = draw(st.sampled_from(_UNARY))
            nodes.append(helper.make_node(op, [draw(st.sampled_from(values))], [out], name=f"n{k}"))
        else:
            op = draw(st.sampled_from(_BINARY))
            a, b = draw(st.sampled_from(values)), draw(st.sampled_from(values))
            nodes.append(helper.make_node(op, [a, b], [out], name=f"n{k}"))
        values.append(out)
    produced = [n.output[0] for n in nodes]
    outputs = [produced[-1]]
    if len(produced) > 2 and draw(st.booleans()):
        outputs.insert(0, draw(st.sampled_from(produced[:-1])))
    inits = [
        const("c0", np.array([[0.5, -1.0, 2.0], [1.5, 0.25, -0.75]], np.float32)),
        const("c1", np.array([0.1, 0.2, -0.3], np.float32)),
    ]
    return make_model(nodes, [tensor_info("x", [2, 3])], [tensor_info(o, None) for o in outputs], inits)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(random_graphs())
def test_default_pipeline_preserves_semantics(proto):
    model = passes.run_pipeline(to_ir(proto))
    passes.verify(model)
    assert len(op_types(model)) <= len(proto.graph.node) + len(proto.graph.output)
    assert "Identity" not in op_types(model) or any(
        n.op_type == "Identity" and n.outputs[0].is_graph_output() for n in model.graph
    )
    assert_same_outputs(proto, model)
    check_model(model)
