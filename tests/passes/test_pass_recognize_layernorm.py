from __future__ import annotations

import numpy as np
import pytest
from onnx import helper
from passes_testkit import assert_same_outputs, check_model, const, make_model, op_types, tensor_info, to_ir

import models_zoo
from passes.dead_code_elimination import DeadCodeElimination
from passes.recognize_layernorm import RecognizeLayerNorm
from passes.shape_inference import ShapeInference


def _layernorm_model(*, opset: int, axes: list[int], square: str = "Pow", affine: bool = True,
                     eps: float = 1e-5, shape=(2, 3, 8)):
    rng = np.random.default_rng(0)
    reduced = {a % len(shape) for a in axes}
    norm_shape = [d if i in reduced else 1 for i, d in enumerate(shape)][min(reduced):]
    inits = [const("two", np.float32(2.0)), const("eps", np.float32(eps)),
             const("gamma", rng.uniform(0.5, 1.5, norm_shape).astype(np.float32)),
             const("beta", rng.standard_normal(norm_shape).astype(np.float32))]
    if opset >= 18:
        inits.append(const("axes", np.array(axes, np.int64)))
        mean1 = helper.make_node("ReduceMean", ["x", "axes"], ["m"])
        mean2 = helper.make_node("ReduceMean", ["p", "axes"], ["v"])
    else:
        mean1 = helper.make_node("ReduceMean", ["x"], ["m"], axes=axes)
        mean2 = helper.make_node("ReduceMean", ["p"], ["v"], axes=axes)
    sq = (helper.make_node("Pow", ["d", "two"], ["p"]) if square == "Pow"
          else helper.make_node("Mul", ["d", "d"], ["p"]))
    nodes = [
        helper.make_node("Relu", ["x0"], ["x"]),
        mean1, helper.make_node("Sub", ["x", "m"], ["d"]), sq, mean2,
        helper.make_node("Add", ["eps", "v"], ["ve"]),
        helper.make_node("Sqrt", ["ve"], ["s"]),
        helper.make_node("Div", ["d", "s"], ["n"] if affine else ["y"]),
    ]
    if affine:
        nodes += [helper.make_node("Mul", ["gamma", "n"], ["g"]),
                  helper.make_node("Add", ["g", "beta"], ["y"])]
    io = ([tensor_info("x0", list(shape))], [tensor_info("y", list(shape))])
    return make_model(nodes, *io, inits, opset=opset)


@pytest.mark.parametrize(
    ("opset", "axes", "square", "affine", "axis"),
    [(18, [-1], "Pow", True, 2), (17, [2], "Mul", True, 2),
     (18, [1, 2], "Pow", True, 1), (18, [-1], "Pow", False, 2)],
)
def test_decomposed_layernorm_becomes_one_op(opset, axes, square, affine, axis):
    proto = _layernorm_model(opset=opset, axes=axes, square=square, affine=affine, eps=1e-3)
    model = to_ir(proto)
    ShapeInference()(model)  # the match needs the rank of x
    assert RecognizeLayerNorm()(model).modified
    DeadCodeElimination()(model)
    assert op_types(model) == ["Relu", "LayerNormalization"]
    ln = model.graph.node(1)
    assert ln.attributes.get_int("axis") == axis
    assert ln.attributes.get_float("epsilon") == pytest.approx(1e-3)
    assert [o.name for o in model.graph.outputs] == ["y"]
    assert_same_outputs(proto, model, rtol=1e-5, atol=1e-5)
    check_model(model)


def test_not_rewritten_for_leading_axes_or_old_opset():
    model = to_ir(_layernorm_model(opset=18, axes=[1]))  # axis 1 of 3: not trailing
    ShapeInference()(model)
    assert not RecognizeLayerNorm()(model).modified
    model = to_ir(_layernorm_model(opset=16, axes=[2]))  # LayerNormalization needs opset 17
    assert not RecognizeLayerNorm()(model).modified


@pytest.mark.parametrize("name", ["bert", "gpt"])
def test_zoo_transformers_keep_their_layernorms(name):
    proto = models_zoo.build(name, seq=8)
    model = to_ir(proto)
    before = op_types(model)
    assert not RecognizeLayerNorm()(model).modified
    assert op_types(model) == before
    assert before.count("LayerNormalization") == 5
