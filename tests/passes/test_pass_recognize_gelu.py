from __future__ import annotations

import math

import numpy as np
import pytest
from onnx import helper
from passes_testkit import assert_same_outputs, check_model, const, make_model, op_types, tensor_info, to_ir

from passes.dead_code_elimination import DeadCodeElimination
from passes.fusion_groups import group_of, groups
from passes.recognize_gelu import RecognizeGelu

SQRT2 = np.float32(math.sqrt(2.0))
INV_SQRT2 = np.float32(1 / math.sqrt(2.0))


def _gelu_model(variant: str, opset: int):
    """x -> Relu -> decomposed GELU (variant) -> Neg -> y."""
    inits = [const("one", np.float32(1.0)), const("half", np.float32(0.5)),
             const("sqrt2", SQRT2), const("inv_sqrt2", INV_SQRT2)]
    nodes = [helper.make_node("Relu", ["x"], ["h"], name="relu")]
    if variant in ("A", "C"):
        nodes.append(helper.make_node("Div", ["h", "sqrt2"], ["s"], name="scale"))
    else:
        nodes.append(helper.make_node("Mul", ["inv_sqrt2", "h"], ["s"], name="scale"))
    nodes += [helper.make_node("Erf", ["s"], ["e"], name="erf"),
              helper.make_node("Add", ["one", "e"], ["a"], name="add1")]
    if variant == "A":
        nodes += [helper.make_node("Mul", ["h", "a"], ["m"], name="mul_x"),
                  helper.make_node("Mul", ["m", "half"], ["g"], name="mul_half")]
    elif variant == "B":
        nodes += [helper.make_node("Mul", ["a", "half"], ["m"], name="mul_half"),
                  helper.make_node("Mul", ["m", "h"], ["g"], name="mul_x")]
    else:
        nodes += [helper.make_node("Mul", ["half", "h"], ["m"], name="mul_half"),
                  helper.make_node("Mul", ["a", "m"], ["g"], name="mul_x")]
    nodes.append(helper.make_node("Neg", ["g"], ["y"], name="neg"))
    return make_model(nodes, [tensor_info("x", [2, 5])], [tensor_info("y", [2, 5])], inits, opset=opset)


@pytest.mark.parametrize("variant", ["A", "B", "C"])
def test_gelu_becomes_one_op_at_opset_20(variant):
    proto = _gelu_model(variant, 20)
    model = to_ir(proto)
    assert RecognizeGelu()(model).modified
    DeadCodeElimination()(model)
    assert op_types(model) == ["Relu", "Gelu", "Neg"]
    assert not model.graph.initializers
    assert_same_outputs(proto, model, rtol=1e-5, atol=1e-5)
    check_model(model)


@pytest.mark.parametrize("variant", ["A", "B", "C"])
def test_gelu_is_grouped_below_opset_20(variant):
    proto = _gelu_model(variant, 18)
    model = to_ir(proto)
    assert RecognizeGelu()(model).modified
    assert op_types(model) == op_types(proto)
    found = groups(model.graph)
    assert len(found) == 1
    (members,) = found.values()
    assert sorted(n.name for n in members) == ["add1", "erf", "mul_half", "mul_x", "scale"]
    assert group_of(model.graph.node(0)) is None  # Relu stays out
    assert not RecognizeGelu()(model).modified  # idempotent
    assert_same_outputs(proto, model, rtol=1e-5, atol=1e-5)
    check_model(model)


def test_gelu_output_as_graph_output_and_approximate_constants():
    inits = [const("one", np.float32(1.0)), const("half", np.float32(0.5)), const("c", np.float32(1.4142))]
    nodes = [
        helper.make_node("Div", ["x", "c"], ["s"]),
        helper.make_node("Erf", ["s"], ["e"]),
        helper.make_node("Add", ["e", "one"], ["a"]),
        helper.make_node("Mul", ["a", "x"], ["m"]),
        helper.make_node("Mul", ["m", "half"], ["y"]),
    ]
    proto = make_model(nodes, [tensor_info("x", [4])], [tensor_info("y", [4])], inits, opset=20)
    model = to_ir(proto)
    RecognizeGelu()(model)
    assert op_types(model) == ["Gelu"]
    assert [o.name for o in model.graph.outputs] == ["y"]
    # 1.4142 differs from sqrt(2) by 1.5e-5 relative: the outputs agree to 1e-4
    assert_same_outputs(proto, model, rtol=1e-4, atol=1e-5)
    check_model(model)


def test_not_gelu_when_constant_is_wrong_or_value_escapes():
    inits = [const("one", np.float32(1.0)), const("half", np.float32(0.5)), const("c", np.float32(2.0))]
    nodes = [
        helper.make_node("Div", ["x", "c"], ["s"]),  # divides by 2, not sqrt(2)
        helper.make_node("Erf", ["s"], ["e"]),
        helper.make_node("Add", ["e", "one"], ["a"]),
        helper.make_node("Mul", ["a", "x"], ["m"]),
        helper.make_node("Mul", ["m", "half"], ["y"]),
    ]
    proto = make_model(nodes, [tensor_info("x", [4])], [tensor_info("y", [4])], inits, opset=20)
    model = to_ir(proto)
    assert not RecognizeGelu()(model).modified
    nodes[0] = helper.make_node("Div", ["x", "sqrt2"], ["s"])
    proto = make_model(nodes, [tensor_info("x", [4])], [tensor_info("y", [4]), tensor_info("a", [4])],
                       [*inits, const("sqrt2", SQRT2)], opset=20)
    model = to_ir(proto)
    assert not RecognizeGelu()(model).modified  # "a" is a graph output
