from __future__ import annotations

import numpy as np
from onnx import helper
from passes_testkit import assert_same_outputs, check_model, const, make_model, op_types, tensor_info, to_ir

import models_zoo
from passes.dead_code_elimination import DeadCodeElimination
from passes.fold_conv_batchnorm import FoldConvBatchNorm

RTOL, ATOL = 1e-4, 1e-5


def _bn_params(rng: np.random.Generator, prefix: str, c: int) -> list:
    return [
        const(f"{prefix}_gamma", rng.uniform(0.5, 1.5, c).astype(np.float32)),
        const(f"{prefix}_beta", rng.standard_normal(c).astype(np.float32)),
        const(f"{prefix}_mean", rng.standard_normal(c).astype(np.float32)),
        const(f"{prefix}_var", rng.uniform(0.5, 2.0, c).astype(np.float32)),
    ]


def _bn(prefix: str, x: str, y: str, eps: float = 1e-3):
    ins = [x] + [f"{prefix}_{k}" for k in ("gamma", "beta", "mean", "var")]
    return helper.make_node("BatchNormalization", ins, [y], name=f"{prefix}_bn", epsilon=eps)


def test_folds_conv_with_and_without_bias_and_grouped():
    rng = np.random.default_rng(0)
    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
        _bn("bn1", "c1", "r1"),
        helper.make_node("Relu", ["r1"], ["a1"], name="relu"),
        helper.make_node("Conv", ["a1", "w2"], ["c2"], name="conv2", group=2),  # no bias, grouped
        _bn("bn2", "c2", "y", eps=1e-5),  # output of the BN is a graph output
    ]
    inits = [
        const("w1", rng.standard_normal((4, 3, 3, 3)).astype(np.float32)),
        const("b1", rng.standard_normal(4).astype(np.float32)),
        const("w2", rng.standard_normal((6, 2, 1, 1)).astype(np.float32)),
        *_bn_params(rng, "bn1", 4),
        *_bn_params(rng, "bn2", 6),
    ]
    proto = make_model(nodes, [tensor_info("x", [2, 3, 8, 8])], [tensor_info("y", [2, 6, 8, 8])], inits)
    model = to_ir(proto)
    assert FoldConvBatchNorm()(model).modified
    DeadCodeElimination()(model)
    assert op_types(model) == ["Conv", "Relu", "Conv"]
    assert [o.name for o in model.graph.outputs] == ["y"]
    assert not any(name.startswith("bn") for name in model.graph.initializers)
    assert not FoldConvBatchNorm()(model).modified
    assert_same_outputs(proto, model, rtol=RTOL, atol=ATOL)
    check_model(model)


def test_leaves_bn_when_conv_output_has_other_readers_or_weights_are_inputs():
    rng = np.random.default_rng(1)
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"], name="conv"),
        _bn("bn", "c", "n"),
        helper.make_node("Add", ["c", "n"], ["y"], name="add"),  # c has two readers
        helper.make_node("Conv", ["x", "w_in"], ["c2"], name="conv_dyn"),
        _bn("bn2", "c2", "y2"),
    ]
    inits = [
        const("w", rng.standard_normal((2, 3, 1, 1)).astype(np.float32)),
        *_bn_params(rng, "bn", 2),
        *_bn_params(rng, "bn2", 2),
    ]
    proto = make_model(
        nodes,
        [tensor_info("x", [1, 3, 4, 4]), tensor_info("w_in", [2, 3, 1, 1])],
        [tensor_info("y", [1, 2, 4, 4]), tensor_info("y2", [1, 2, 4, 4])],
        inits,
    )
    model = to_ir(proto)
    assert not FoldConvBatchNorm()(model).modified
    assert op_types(model) == ["Conv", "BatchNormalization", "Add", "Conv", "BatchNormalization"]


def test_zoo_resnet_has_no_batchnorm_after_folding():
    proto = models_zoo.build("resnet", image=32, width=16)
    model = to_ir(proto)
    before = op_types(model).count("BatchNormalization")
    assert before > 0
    FoldConvBatchNorm()(model)
    DeadCodeElimination()(model)
    assert op_types(model).count("BatchNormalization") == 0
    assert op_types(model).count("Conv") == before
    assert_same_outputs(proto, model, rtol=RTOL, atol=ATOL)
    check_model(model)
