from __future__ import annotations

import numpy as np
from onnx import helper
from passes_testkit import assert_same_outputs, check_model, const, make_model, op_types, tensor_info, to_ir

from passes.fuse_bias_activation import FuseBiasActivation
from passes.fusion_groups import fusion_units, group_of, groups
from passes.recognize_gelu import RecognizeGelu
from passes.shape_inference import ShapeInference


def _prepared(proto):
    model = to_ir(proto)
    ShapeInference()(model)
    return model


def test_matmul_bias_relu_becomes_grouped_gemm_relu():
    rng = np.random.default_rng(0)
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["mm"], name="mm"),
        helper.make_node("Add", ["b", "mm"], ["h"], name="bias"),
        helper.make_node("Relu", ["h"], ["r"], name="relu"),
        helper.make_node("MatMul", ["r", "w2"], ["mm2"], name="mm2"),
        helper.make_node("Add", ["mm2", "b2"], ["y"], name="bias2"),  # no activation, graph output
    ]
    inits = [const("w", rng.standard_normal((6, 5)).astype(np.float32)),
             const("b", rng.standard_normal(5).astype(np.float32)),
             const("w2", rng.standard_normal((5, 3)).astype(np.float32)),
             const("b2", rng.standard_normal((1, 3)).astype(np.float32))]
    proto = make_model(nodes, [tensor_info("x", [4, 6])], [tensor_info("y", [4, 3])], inits)
    model = _prepared(proto)
    assert FuseBiasActivation()(model).modified
    assert op_types(model) == ["Gemm", "Relu", "Gemm"]
    found = groups(model.graph)
    assert [[n.op_type for n in members] for members in found.values()] == [["Gemm", "Relu"]]
    assert group_of(model.graph.node(2)) is None
    assert [len(u) for u in fusion_units(model.graph)] == [2, 1]
    assert [o.name for o in model.graph.outputs] == ["y"]
    assert not FuseBiasActivation()(model).modified
    assert_same_outputs(proto, model, rtol=1e-5, atol=1e-5)
    check_model(model)


def test_conv_bias_clip_and_3d_matmul_bias_sigmoid_are_grouped_in_place():
    rng = np.random.default_rng(1)
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"], name="conv", pads=[1, 1, 1, 1]),
        helper.make_node("Add", ["c", "cb"], ["cbias"], name="conv_bias"),
        helper.make_node("Clip", ["cbias", "lo", "hi"], ["y"], name="clip"),
        helper.make_node("MatMul", ["z", "mw"], ["m"], name="mm3d"),  # rank 3: stays MatMul
        helper.make_node("Add", ["m", "mb"], ["mbias"], name="mm_bias"),
        helper.make_node("Sigmoid", ["mbias"], ["y2"], name="sig"),
    ]
    inits = [const("w", rng.standard_normal((4, 3, 3, 3)).astype(np.float32)),
             const("cb", rng.standard_normal((4, 1, 1)).astype(np.float32)),
             const("lo", np.float32(0.0)), const("hi", np.float32(6.0)),
             const("mw", rng.standard_normal((5, 2)).astype(np.float32)),
             const("mb", rng.standard_normal(2).astype(np.float32))]
    proto = make_model(nodes, [tensor_info("x", [1, 3, 6, 6]), tensor_info("z", [2, 3, 5])],
                       [tensor_info("y", [1, 4, 6, 6]), tensor_info("y2", [2, 3, 2])], inits)
    model = _prepared(proto)
    assert FuseBiasActivation()(model).modified
    assert op_types(model) == op_types(proto)
    found = groups(model.graph)
    assert sorted(sorted(n.name for n in m) for m in found.values()) == [
        ["clip", "conv", "conv_bias"], ["mm3d", "mm_bias", "sig"]]
    assert_same_outputs(proto, model, rtol=1e-5, atol=1e-5)
    check_model(model)


def test_bias_that_broadcasts_up_or_shared_output_is_not_fused():
    rng = np.random.default_rng(2)
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["mm"], name="mm"),
        helper.make_node("Add", ["mm", "b"], ["h"], name="grow"),  # (3,1,4)+(2,4) grows the output
        helper.make_node("Relu", ["h"], ["y"], name="relu"),
        helper.make_node("Conv", ["img", "cw"], ["c"], name="conv"),
        helper.make_node("Relu", ["c"], ["r"], name="relu2"),
        helper.make_node("Add", ["c", "r"], ["y2"], name="uses_c_too"),
    ]
    inits = [const("w", rng.standard_normal((6, 4)).astype(np.float32)),
             const("b", rng.standard_normal((2, 4)).astype(np.float32)),
             const("cw", rng.standard_normal((2, 3, 1, 1)).astype(np.float32))]
    proto = make_model(nodes, [tensor_info("x", [3, 1, 6]), tensor_info("img", [1, 3, 2, 2])],
                       [tensor_info("y", [3, 2, 4]), tensor_info("y2", [1, 2, 2, 2])], inits)
    model = _prepared(proto)
    assert not FuseBiasActivation()(model).modified
    assert not groups(model.graph)


def test_decomposed_gelu_group_joins_the_bias_group():
    rng = np.random.default_rng(3)
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["mm"], name="mm"),
        helper.make_node("Add", ["mm", "b"], ["h"], name="bias"),
        helper.make_node("Div", ["h", "sqrt2"], ["s"], name="div"),
        helper.make_node("Erf", ["s"], ["e"], name="erf"),
        helper.make_node("Add", ["e", "one"], ["a"], name="add1"),
        helper.make_node("Mul", ["h", "a"], ["m"], name="mul"),
        helper.make_node("Mul", ["m", "half"], ["y"], name="half_mul"),
    ]
    inits = [const("w", rng.standard_normal((6, 4)).astype(np.float32)),
             const("b", rng.standard_normal(4).astype(np.float32)),
             const("sqrt2", np.float32(np.sqrt(2))), const("one", np.float32(1)),
             const("half", np.float32(0.5))]
    proto = make_model(nodes, [tensor_info("x", [2, 3, 6])], [tensor_info("y", [2, 3, 4])], inits, opset=18)
    model = _prepared(proto)
    RecognizeGelu()(model)
    assert FuseBiasActivation()(model).modified
    found = groups(model.graph)
    assert len(found) == 1
    assert len(next(iter(found.values()))) == 7
    assert len(fusion_units(model.graph)) == 1
    assert_same_outputs(proto, model, rtol=1e-5, atol=1e-5)
    check_model(model)
