from __future__ import annotations

import pytest
from onnx import helper
from passes_testkit import make_model, tensor_info, to_ir, to_proto

from partitioner.core.errors import VerifyError
from passes.fusion_groups import FUSION_GROUP_KEY, assign_group, fusion_units, group_of, groups, is_closed


def _chain():
    nodes = [
        helper.make_node("Relu", ["x"], ["a"], name="a"),
        helper.make_node("Neg", ["a"], ["b"], name="b"),
        helper.make_node("Exp", ["x"], ["c"], name="c"),
        helper.make_node("Add", ["b", "c"], ["y"], name="y"),
    ]
    return to_ir(make_model(nodes, [tensor_info("x", [2])], [tensor_info("y", [2])]))


def test_assign_merges_groups_and_survives_serialisation():
    model = _chain()
    a, b, c, y = list(model.graph)
    g1 = assign_group(model.graph, [a, b], "t")
    assert group_of(a) == group_of(b) == g1 == "t0"
    g2 = assign_group(model.graph, [b, y], "t")  # b's group comes along
    assert {group_of(n) for n in (a, b, y)} == {g2} and g2 != g1
    assert group_of(c) is None
    assert [n.name for n in groups(model.graph)[g2]] == ["a", "b", "y"]
    proto = to_proto(model)
    assert {p.key: p.value for p in proto.graph.node[0].metadata_props} == {FUSION_GROUP_KEY: g2}
    # c feeds y from outside: units are [c] then the group, topologically
    assert [[n.name for n in u] for u in fusion_units(model.graph)] == [["c"], ["a", "b", "y"]]


def test_open_group_is_detected_and_refused_by_fusion_units():
    model = _chain()
    a, b, c, y = list(model.graph)
    assert is_closed([a, b]) and not is_closed([a, y])  # a -> b (outside) -> y: leaves and re-enters
    for n in (a, y):
        n.metadata_props[FUSION_GROUP_KEY] = "bad"
    with pytest.raises(VerifyError, match="bad"):
        fusion_units(model.graph)
