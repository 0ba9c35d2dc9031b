from __future__ import annotations

import numpy as np
from onnx import helper
from passes_testkit import assert_same_outputs, check_model, const, make_model, op_types, tensor_info, to_ir

import models_zoo
from passes.dead_code_elimination import DeadCodeElimination
from passes.layout_nhwc import LayoutNHWC
from passes.shape_inference import ShapeInference

TO_NCHW, TO_NHWC = [0, 3, 1, 2], [0, 2, 3, 1]


def _run(proto):
    model = to_ir(proto)
    ShapeInference()(model)
    result = LayoutNHWC()(model)
    DeadCodeElimination()(model)
    return model, result.modified


def test_nhwc_island_between_convs_loses_its_transposes():
    rng = np.random.default_rng(0)
    nodes = [
        helper.make_node("Transpose", ["x"], ["xt"], perm=TO_NCHW),  # TF-style NHWC input
        helper.make_node("Conv", ["xt", "w1"], ["c1"], pads=[1, 1, 1, 1]),
        helper.make_node("Transpose", ["c1"], ["h"], perm=TO_NHWC),
        helper.make_node("Add", ["h", "bias"], ["hb"]),  # bias over C, the last NHWC axis
        helper.make_node("Relu", ["hb"], ["hr"]),
        helper.make_node("Mul", ["hr", "two"], ["hm"]),
        helper.make_node("Transpose", ["hm"], ["ht"], perm=TO_NCHW),
        helper.make_node("Conv", ["ht", "w2"], ["c2"]),
        helper.make_node("Transpose", ["c2"], ["y"], perm=TO_NHWC),  # NHWC output
    ]
    inits = [const("w1", rng.standard_normal((4, 3, 3, 3)).astype(np.float32)),
             const("w2", rng.standard_normal((5, 4, 1, 1)).astype(np.float32)),
             const("bias", rng.standard_normal(4).astype(np.float32)),
             const("two", np.float32(2.0))]
    proto = make_model(nodes, [tensor_info("x", [1, 6, 6, 3])], [tensor_info("y", [1, 6, 6, 5])], inits)
    model, modified = _run(proto)
    assert modified
    assert op_types(model) == ["Transpose", "Conv", "Add", "Relu", "Mul", "Conv", "Transpose"]
    assert op_types(model).count("Transpose") == 2  # the boundary ones stay
    assert [o.name for o in model.graph.outputs] == ["y"]
    assert_same_outputs(proto, model, rtol=1e-5, atol=1e-5)
    check_model(model)


def test_compose_concat_and_two_transposed_operands():
    nodes = [
        helper.make_node("Transpose", ["a"], ["at"], perm=[0, 2, 1]),
        helper.make_node("Transpose", ["b"], ["bt"], perm=[0, 2, 1]),
        helper.make_node("Concat", ["at", "bt"], ["cat"], axis=2),
        helper.make_node("Transpose", ["a"], ["at2"], perm=[0, 2, 1]),
        helper.make_node("Transpose", ["b2"], ["bt2"], perm=[0, 2, 1]),
        helper.make_node("Sub", ["at2", "bt2"], ["d"]),
        helper.make_node("Transpose", ["cat"], ["t1"], perm=[1, 0, 2]),
        helper.make_node("Transpose", ["t1"], ["y"], perm=[1, 2, 0]),  # composes with t1 and the sunk one
        helper.make_node("Transpose", ["d"], ["y2"], perm=[0, 2, 1]),  # cancels the sunk one
    ]
    proto = make_model(
        nodes,
        [tensor_info("a", [2, 3, 4]), tensor_info("b", [2, 5, 4]), tensor_info("b2", [2, 3, 4])],
        [tensor_info("y", [2, 8, 4]), tensor_info("y2", [2, 3, 4])],
    )
    model, modified = _run(proto)
    assert modified
    # (0,2,1) then (1,0,2) then (1,2,0) composes to the identity: y = Concat(a, b, axis=1)
    assert sorted(op_types(model)) == ["Concat", "Sub"]
    assert [n.attributes.get_int("axis") for n in model.graph if n.op_type == "Concat"] == [1]
    assert_same_outputs(proto, model, rtol=1e-5, atol=1e-5)
    check_model(model)


def test_transposes_before_non_agnostic_ops_stay():
    nodes = [
        helper.make_node("Transpose", ["x"], ["xt"], perm=TO_NCHW),
        helper.make_node("MaxPool", ["xt"], ["p"], kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node("Transpose", ["p"], ["y"], perm=TO_NHWC),
    ]
    proto = make_model(nodes, [tensor_info("x", [1, 4, 4, 3])], [tensor_info("y", [1, 2, 2, 3])])
    model, modified = _run(proto)
    assert not modified
    assert op_types(model).count("Transpose") == 2


def test_zoo_bert_keeps_its_attention_transposes():
    proto = models_zoo.build("bert", seq=8)
    model, _ = _run(proto)
    # each of the 8 Transposes feeds a MatMul or Reshape, which the pass does not cross
    assert op_types(model).count("Transpose") == 8
    assert_same_outputs(proto, model, rtol=1e-5, atol=1e-5)
