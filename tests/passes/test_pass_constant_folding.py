from __future__ import annotations

import logging
import time

import numpy as np
import onnx
import onnx_ir as ir
from onnx import TensorProto, helper
from passes_testkit import assert_same_outputs, check_model, const, make_model, op_types, tensor_info, to_ir

import passes
from passes.constant_folding import ConstantFolding
from passes.dead_code_elimination import DeadCodeElimination
from passes.shape_inference import ShapeInference


def test_folds_constant_arithmetic_into_initializers():
    # y = x * (Constant(2) + b) ; the Add and the Constant fold, the Mul stays.
    nodes = [
        helper.make_node(
            "Constant", [], ["two"], name="two",
            value=onnx.numpy_helper.from_array(np.full((3,), 2.0, np.float32)),
        ),
        helper.make_node("Add", ["two", "b"], ["scale"], name="add"),
        helper.make_node("Mul", ["x", "scale"], ["y"], name="mul"),
    ]
    b = np.array([0.5, -1.0, 3.0], dtype=np.float32)
    proto = make_model(nodes, [tensor_info("x", [4, 3])], [tensor_info("y", [4, 3])], [const("b", b)])
    model = to_ir(proto)
    assert op_types(model) == ["Constant", "Add", "Mul"]
    result = passes.PassManager([ShapeInference(), ConstantFolding(), DeadCodeElimination()])(model)
    model = result.model
    assert result.modified
    assert op_types(model) == ["Mul"]
    # stable, readable name: the initializer is named after the value it replaces
    assert "scale" in model.graph.initializers
    np.testing.assert_array_equal(model.graph.initializers["scale"].const_value.numpy(), b + 2.0)
    assert "b" not in model.graph.initializers  # no longer used, removed by DCE
    assert_same_outputs(proto, model)
    check_model(model)


def test_folds_shape_arithmetic_chain_of_static_shape():
    # x[2,3,4] -> Shape -> Gather(0) -> Unsqueeze -> Concat([-1]) -> Reshape(x) : y[2,12]
    nodes = [
        helper.make_node("Shape", ["x"], ["s"], name="shape"),
        helper.make_node("Gather", ["s", "zero"], ["n"], name="gather", axis=0),
        helper.make_node("Unsqueeze", ["n", "axes"], ["n1"], name="unsqueeze"),
        helper.make_node("Concat", ["n1", "minus_one"], ["new_shape"], name="concat", axis=0),
        helper.make_node("Reshape", ["x", "new_shape"], ["y"], name="reshape"),
    ]
    inits = [
        const("zero", np.array(0, dtype=np.int64)),
        const("axes", np.array([0], dtype=np.int64)),
        const("minus_one", np.array([-1], dtype=np.int64)),
    ]
    proto = make_model(nodes, [tensor_info("x", [2, 3, 4])], [tensor_info("y", None)], inits)
    model = to_ir(proto)
    assert op_types(model) == ["Shape", "Gather", "Unsqueeze", "Concat", "Reshape"]
    model = passes.run_pipeline(model, ["shape_inference", "constant_folding", "dead_code_elimination"])
    assert op_types(model) == ["Reshape"]
    np.testing.assert_array_equal(model.graph.initializers["new_shape"].const_value.numpy(), [2, -1])
    assert model.graph.outputs[0].shape == ir.Shape([2, 12])
    assert_same_outputs(proto, model)
    check_model(model)


def test_shape_with_start_end_and_size():
    nodes = [
        helper.make_node("Shape", ["x"], ["s"], name="shape", start=1, end=-1),
        helper.make_node("Size", ["x"], ["n"], name="size"),
        helper.make_node("Cast", ["s"], ["sf"], name="cast_s", to=TensorProto.FLOAT),
        helper.make_node("Cast", ["n"], ["nf"], name="cast_n", to=TensorProto.FLOAT),
        helper.make_node("Mul", ["sf", "nf"], ["k"], name="mul"),
        helper.make_node("Add", ["x2", "k"], ["y"], name="add"),
    ]
    inputs = [tensor_info("x", [2, 3, 5, 7]), tensor_info("x2", [2])]
    proto = make_model(nodes, inputs, [tensor_info("y", None)])
    names = ["shape_inference", "constant_folding", "dead_code_elimination"]
    model = passes.run_pipeline(to_ir(proto), names)
    assert op_types(model) == ["Add"]
    np.testing.assert_array_equal(model.graph.initializers["k"].const_value.numpy(), [3 * 210.0, 5 * 210.0])
    assert_same_outputs(proto, model)
    check_model(model)


def test_materialises_light_squeezenet_weights(light_squeezenet):
    proto = light_squeezenet
    model = to_ir(proto)
    before = op_types(model)
    assert before.count("ConstantOfShape") == 39
    model = passes.run_pipeline(model, ["shape_inference", "constant_folding", "dead_code_elimination"])
    after = op_types(model)
    assert "ConstantOfShape" not in after
    assert after == [t for t in before if t != "ConstantOfShape"]
    # the weights keep their names: conv1_w_0 is an initializer of shape [64, 3, 3, 3]
    w = model.graph.initializers["conv1_w_0"].const_value.numpy()
    assert w.shape == (64, 3, 3, 3)
    np.testing.assert_allclose(w, np.float32(0.02))
    assert [i.name for i in model.graph.inputs] == ["data_0"]
    assert_same_outputs(proto, model, rtol=1e-4, atol=1e-6)
    check_model(model)


def test_size_guard_refuses_a_billion_element_constant(caplog):
    nodes = [
        helper.make_node("ConstantOfShape", ["big_shape"], ["big"], name="big",
                         value=helper.make_tensor("v", TensorProto.FLOAT, [1], [1.0])),
        helper.make_node("ReduceSum", ["big"], ["y"], name="sum", keepdims=0),
    ]
    big_shape = const("big_shape", np.array([10**9], dtype=np.int64))
    proto = make_model(nodes, [], [tensor_info("y", None)], [big_shape])
    model = to_ir(proto)
    caplog.set_level(logging.INFO, logger="passes.constant_folding")
    start = time.perf_counter()
    # twice: once with shapes inferred (IR shape says 1e9), once without (probe inference)
    ConstantFolding()(model)
    assert op_types(model) == ["ConstantOfShape", "ReduceSum"]
    ShapeInference()(model)
    result = ConstantFolding()(model)
    assert op_types(result.model) == ["ConstantOfShape", "ReduceSum"]
    assert not result.modified
    assert time.perf_counter() - start < 10
    assert "over the size limit" in caplog.text  # refused by the guard, not by accident


def test_size_limit_is_configurable():
    nodes = [
        helper.make_node("ConstantOfShape", ["shape"], ["c"], name="cos",
                         value=helper.make_tensor("v", TensorProto.FLOAT, [1], [3.0])),
        helper.make_node("Add", ["x", "c"], ["y"], name="add"),
    ]
    proto = make_model(nodes, [tensor_info("x", [4, 8])], [tensor_info("y", [4, 8])],
                       [const("shape", np.array([4, 8], dtype=np.int64))])
    small = ConstantFolding(size_limit=16)(to_ir(proto))
    assert op_types(small.model) == ["ConstantOfShape", "Add"]
    model = ConstantFolding(size_limit=32)(to_ir(proto)).model
    assert op_types(model) == ["Add"]
    assert_same_outputs(proto, model)
    check_model(model)


def test_does_not_fold_comm_ops_or_random_ops():
    nodes = [
        helper.make_node("AllReduce", ["w"], ["w_sum"], domain="partitioner.comm", name="ar"),
        helper.make_node("RandomUniformLike", ["w"], ["noise"], name="rnd"),
        helper.make_node("Add", ["w_sum", "noise"], ["y"], name="add"),
    ]
    proto = make_model(nodes, [], [tensor_info("y", [3])], [const("w", np.ones(3, np.float32))], comm=True)
    model = ConstantFolding()(to_ir(proto)).model
    assert op_types(model) == ["AllReduce", "RandomUniformLike", "Add"]


def test_node_feeding_graph_output_is_kept_but_its_consumers_fold():
    nodes = [
        helper.make_node("Neg", ["c"], ["y"], name="neg"),
        helper.make_node("Neg", ["y"], ["z"], name="neg2"),
        helper.make_node("Add", ["x", "z"], ["w"], name="add"),
    ]
    proto = make_model(
        nodes, [tensor_info("x", [2])], [tensor_info("y", [2]), tensor_info("w", [2])],
        [const("c", np.array([1.0, 2.0], np.float32))],
    )
    model = ConstantFolding()(to_ir(proto)).model
    assert op_types(model) == ["Neg", "Add"]
    assert_same_outputs(proto, model)
    check_model(model)
