"""Every gradient rule, on a one-op float64 graph, against central finite differences run by
ONNX Runtime and against TVM Relax's ``relax.transform.Gradient`` of the same forward model.

Every float operand of the op is a trainable initializer, so the check covers the gradient of
each input, not only of weights. The loss is MSE against seeded random labels, so the cotangent
reaching the op is a generic dense tensor. Tolerances: finite differences (eps 1e-6) rtol 1e-4,
atol 1e-7; Relax (float64 both ways) rtol 1e-6, atol 1e-9.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from partitioner.training import GRADIENTS
from tests.training.gradcheck import finite_differences, gradients, relax_gradients, with_mse_loss

R = np.random.default_rng(1234)


def _r(*shape: int, positive: bool = False) -> np.ndarray:
    x = R.standard_normal(shape)
    return np.abs(x) + 0.5 if positive else x


def _i(values) -> np.ndarray:
    return np.asarray(values, dtype=np.int64)


# name -> (op_type, inputs {name: array}, attributes, output shape); input order = op input order
CASES: dict[str, tuple[str, dict[str, np.ndarray], dict, tuple[int, ...]]] = {
    "Add_broadcast": ("Add", {"a": _r(2, 3, 4), "b": _r(3, 1)}, {}, (2, 3, 4)),
    "Sub_broadcast": ("Sub", {"a": _r(2, 3), "b": _r(3)}, {}, (2, 3)),
    "Mul_broadcast": ("Mul", {"a": _r(2, 1, 4), "b": _r(3, 4)}, {}, (2, 3, 4)),
    "Div_broadcast": ("Div", {"a": _r(2, 3), "b": _r(1, 3, positive=True)}, {}, (2, 3)),
    "Pow": ("Pow", {"a": _r(2, 3, positive=True), "b": _r(2, 3)}, {}, (2, 3)),
    "Sqrt": ("Sqrt", {"x": _r(2, 5, positive=True)}, {}, (2, 5)),
    "Exp": ("Exp", {"x": _r(2, 5)}, {}, (2, 5)),
    "Log": ("Log", {"x": _r(2, 5, positive=True)}, {}, (2, 5)),
    "Neg": ("Neg", {"x": _r(4)}, {}, (4,)),
    "Reciprocal": ("Reciprocal", {"x": _r(2, 3, positive=True)}, {}, (2, 3)),
    "Erf": ("Erf", {"x": _r(2, 5)}, {}, (2, 5)),
    "Identity": ("Identity", {"x": _r(2, 5)}, {}, (2, 5)),
    "Dropout": ("Dropout", {"x": _r(2, 5)}, {}, (2, 5)),
    "Cast": ("Cast", {"x": _r(2, 5)}, {"to": TensorProto.DOUBLE}, (2, 5)),
    "Where": ("Where", {"c": R.standard_normal((2, 3)) > 0, "a": _r(2, 3), "b": _r(3)}, {}, (2, 3)),
    "Expand": ("Expand", {"x": _r(3, 1), "shape": _i([2, 3, 4])}, {}, (2, 3, 4)),
    "Relu": ("Relu", {"x": _r(3, 4)}, {}, (3, 4)),
    "LeakyRelu": ("LeakyRelu", {"x": _r(3, 4)}, {"alpha": 0.2}, (3, 4)),
    "Clip": ("Clip", {"x": _r(3, 4) * 4, "lo": np.asarray(0.0), "hi": np.asarray(2.0)}, {}, (3, 4)),
    "Sigmoid": ("Sigmoid", {"x": _r(3, 4)}, {}, (3, 4)),
    "Tanh": ("Tanh", {"x": _r(3, 4)}, {}, (3, 4)),
    "Softmax": ("Softmax", {"x": _r(2, 3, 5)}, {"axis": -1}, (2, 3, 5)),
    "Softmax_axis1": ("Softmax", {"x": _r(2, 3, 5)}, {"axis": 1}, (2, 3, 5)),
    "LogSoftmax": ("LogSoftmax", {"x": _r(2, 5)}, {"axis": -1}, (2, 5)),
    "MatMul": ("MatMul", {"a": _r(3, 4), "b": _r(4, 5)}, {}, (3, 5)),
    "MatMul_batched_broadcast": ("MatMul", {"a": _r(2, 3, 4), "b": _r(4, 5)}, {}, (2, 3, 5)),
    "MatMul_batched": ("MatMul", {"a": _r(2, 2, 3, 4), "b": _r(2, 1, 4, 5)}, {}, (2, 2, 3, 5)),
    "Gemm": ("Gemm", {"a": _r(3, 4), "b": _r(4, 5), "c": _r(5)}, {"alpha": 0.7, "beta": 1.3}, (3, 5)),
    "Gemm_transA": ("Gemm", {"a": _r(4, 3), "b": _r(4, 5), "c": _r(3, 5)}, {"transA": 1}, (3, 5)),
    "Gemm_transB": ("Gemm", {"a": _r(3, 4), "b": _r(5, 4), "c": _r(1, 5)}, {"transB": 1}, (3, 5)),
    "Gemm_transAB": ("Gemm", {"a": _r(4, 3), "b": _r(5, 4)}, {"transA": 1, "transB": 1}, (3, 5)),
    "Conv": ("Conv", {"x": _r(2, 3, 7, 7), "w": _r(4, 3, 3, 3), "b": _r(4)}, {"pads": [1, 1, 1, 1]}, (2, 4, 7, 7)),
    "Conv_stride_pad": ("Conv", {"x": _r(2, 3, 8, 8), "w": _r(4, 3, 3, 3)},
                        {"strides": [2, 2], "pads": [1, 0, 1, 1]}, (2, 4, 4, 4)),
    "Conv_dilation": ("Conv", {"x": _r(1, 2, 9, 9), "w": _r(3, 2, 3, 3)}, {"dilations": [2, 2], "strides": [2, 1]},
                      (1, 3, 3, 5)),
    "Conv_groups": ("Conv", {"x": _r(2, 4, 6, 6), "w": _r(6, 2, 3, 3), "b": _r(6)}, {"group": 2, "pads": [1, 1, 1, 1]},
                    (2, 6, 6, 6)),
    "Conv_depthwise": ("Conv", {"x": _r(2, 4, 6, 6), "w": _r(4, 1, 3, 3)},
                       {"group": 4, "strides": [2, 2], "pads": [1, 1, 1, 1]}, (2, 4, 3, 3)),
    "Conv1d": ("Conv", {"x": _r(2, 3, 9), "w": _r(4, 3, 3)}, {"strides": [2]}, (2, 4, 4)),
    "Conv_1x1_stride": ("Conv", {"x": _r(2, 3, 7, 7), "w": _r(4, 3, 1, 1)}, {"strides": [2, 2]}, (2, 4, 4, 4)),
    "Conv_3x1_dilation_pad": ("Conv", {"x": _r(2, 3, 8, 6), "w": _r(4, 3, 3, 1)},
                              {"dilations": [2, 1], "pads": [2, 0, 1, 1], "strides": [1, 2]}, (2, 4, 7, 4)),
    "Conv_5x5": ("Conv", {"x": _r(1, 2, 8, 8), "w": _r(3, 2, 5, 5)}, {"pads": [2, 2, 2, 2]}, (1, 3, 8, 8)),
    "ConvTranspose": ("ConvTranspose", {"x": _r(2, 3, 4, 4), "w": _r(3, 2, 3, 3), "b": _r(2)},
                      {"strides": [2, 2], "pads": [1, 1, 1, 1], "output_padding": [1, 1]}, (2, 2, 8, 8)),
    "ConvTranspose_groups": ("ConvTranspose", {"x": _r(1, 4, 3, 3), "w": _r(4, 1, 2, 2)},
                             {"strides": [2, 2], "group": 2}, (1, 2, 6, 6)),
    "MaxPool": ("MaxPool", {"x": _r(2, 3, 7, 7)}, {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]},
                (2, 3, 4, 4)),
    "MaxPool_2x2": ("MaxPool", {"x": _r(1, 2, 6, 6)}, {"kernel_shape": [2, 2], "strides": [2, 2]}, (1, 2, 3, 3)),
    "AveragePool": ("AveragePool", {"x": _r(2, 3, 6, 6)}, {"kernel_shape": [2, 2], "strides": [2, 2]}, (2, 3, 3, 3)),
    "AveragePool_pad_exclude": ("AveragePool", {"x": _r(1, 2, 5, 5)},
                                {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]}, (1, 2, 3, 3)),
    "GlobalAveragePool": ("GlobalAveragePool", {"x": _r(2, 3, 4, 5)}, {}, (2, 3, 1, 1)),
    "GlobalMaxPool": ("GlobalMaxPool", {"x": _r(2, 3, 4, 5)}, {}, (2, 3, 1, 1)),
    "LayerNormalization": ("LayerNormalization", {"x": _r(2, 3, 8), "scale": _r(8), "bias": _r(8)},
                           {"axis": -1, "epsilon": 1e-5}, (2, 3, 8)),
    "LayerNormalization_axis1": ("LayerNormalization", {"x": _r(2, 3, 4), "scale": _r(3, 4), "bias": _r(3, 4)},
                                 {"axis": 1}, (2, 3, 4)),
    "BatchNormalization_train": ("BatchNormalization", {"x": _r(4, 3, 3, 3), "scale": _r(3), "bias": _r(3),
                                                        "mean": _r(3), "var": _r(3, positive=True)}, {}, (4, 3, 3, 3)),
    "Flatten": ("Flatten", {"x": _r(2, 3, 4)}, {"axis": 1}, (2, 12)),
    "Reshape": ("Reshape", {"x": _r(2, 3, 4), "shape": _i([4, -1])}, {}, (4, 6)),
    "Squeeze": ("Squeeze", {"x": _r(2, 1, 4), "axes": _i([1])}, {}, (2, 4)),
    "Unsqueeze": ("Unsqueeze", {"x": _r(2, 4), "axes": _i([0])}, {}, (1, 2, 4)),
    "Transpose": ("Transpose", {"x": _r(2, 3, 4)}, {"perm": [2, 0, 1]}, (4, 2, 3)),
    "Concat": ("Concat", {"a": _r(2, 3), "b": _r(2, 2)}, {"axis": 1}, (2, 5)),
    "Split": ("Split", {"x": _r(2, 6), "split": _i([4, 2])}, {"axis": 1}, (2, 4)),
    "Slice": ("Slice", {"x": _r(4, 6), "starts": _i([1, 0]), "ends": _i([3, 5]), "axes": _i([0, 1])}, {}, (2, 5)),
    "Slice_steps": ("Slice", {"x": _r(4, 6), "starts": _i([0, 5]), "ends": _i([4, 0]), "axes": _i([0, 1]),
                              "steps": _i([2, -2])}, {}, (2, 3)),
    "Gather_embedding": ("Gather", {"table": _r(7, 4), "idx": _i([[1, 3, 1], [6, 0, 3]])}, {"axis": 0}, (2, 3, 4)),
    "Gather_axis1": ("Gather", {"table": _r(2, 5, 3), "idx": _i([[4, 0], [1, 4]])}, {"axis": 1}, (2, 2, 2, 3)),
    "Gather_class_token": ("Gather", {"table": _r(2, 5, 3), "idx": _i(0)}, {"axis": 1}, (2, 3)),
    "Gather_last_axis": ("Gather", {"table": _r(3, 4), "idx": _i([3, 1, 3])}, {"axis": -1}, (3, 3)),
    "ReduceMean": ("ReduceMean", {"x": _r(2, 3, 4), "axes": _i([1, 2])}, {"keepdims": 0}, (2,)),
    "ReduceMean_keep": ("ReduceMean", {"x": _r(2, 3, 4), "axes": _i([-1])}, {"keepdims": 1}, (2, 3, 1)),
    "ReduceSum": ("ReduceSum", {"x": _r(2, 3, 4), "axes": _i([0])}, {"keepdims": 0}, (3, 4)),
    "ReduceSum_all": ("ReduceSum", {"x": _r(2, 3)}, {"keepdims": 1}, (1, 1)),
    "Sum": ("Sum", {"a": _r(2, 3), "b": _r(3), "c": _r(2, 1)}, {}, (2, 3)),
    "Resize_nearest_x2": ("Resize", {"x": _r(1, 2, 3, 3), "roi": np.zeros(0, np.float32),
                                     "scales": np.array([1.0, 1.0, 2.0, 2.0], np.float32)}, {"mode": "nearest"},
                          (1, 2, 6, 6)),
    "Resize_nearest_down": ("Resize", {"x": _r(1, 2, 6, 5), "roi": np.zeros(0, np.float32),
                                       "scales": np.array([1.0, 1.0, 0.5, 3.0], np.float32)},
                            {"mode": "nearest", "nearest_mode": "floor", "coordinate_transformation_mode": "asymmetric"},
                            (1, 2, 3, 15)),
    "Resize_linear_x2": ("Resize", {"x": _r(1, 2, 3, 4), "roi": np.zeros(0, np.float32),
                                    "scales": np.array([1.0, 1.0, 2.0, 2.0], np.float32)},
                         {"mode": "linear", "coordinate_transformation_mode": "half_pixel"}, (1, 2, 6, 8)),
    "Resize_linear_align_sizes": ("Resize", {"x": _r(2, 3, 5), "roi": np.zeros(0, np.float32), "scales": None,
                                             "sizes": np.array([2, 4, 3], np.int64)},
                                  {"mode": "linear", "coordinate_transformation_mode": "align_corners"}, (2, 4, 3)),
    "Resize_cubic_axes": ("Resize", {"x": _r(1, 2, 4, 5), "roi": np.zeros(0, np.float32),
                                     "scales": np.array([1.5, 0.6], np.float32)},
                          {"mode": "cubic", "axes": [2, 3], "exclude_outside": 1,
                           "coordinate_transformation_mode": "pytorch_half_pixel"}, (1, 2, 6, 3)),
    "Resize_linear_antialias_down": ("Resize", {"x": _r(1, 1, 8, 6), "roi": np.zeros(0, np.float32),
                                                "scales": np.array([1.0, 1.0, 0.5, 0.5], np.float32)},
                                     {"mode": "linear", "antialias": 1}, (1, 1, 4, 3)),
    "LRN_size5": ("LRN", {"x": _r(2, 7, 3, 2)}, {"size": 5, "alpha": 0.5, "beta": 0.75, "bias": 2.0}, (2, 7, 3, 2)),
    "LRN_size4_even": ("LRN", {"x": _r(1, 6, 3, 1)}, {"size": 4, "alpha": 0.3, "beta": 0.6, "bias": 1.5}, (1, 6, 3, 1)),
    "Resize_trilinear_depth": ("Resize", {"x": _r(1, 2, 3, 2, 2), "roi": np.zeros(0, np.float32),
                                          "scales": np.array([1.0, 1.0, 2.0, 1.0, 1.5], np.float32)},
                               {"mode": "linear", "coordinate_transformation_mode": "asymmetric"}, (1, 2, 6, 2, 3)),
}

#: rules TVM Relax 0.27 has no gradient for (or imports differently); checked by finite differences only
NO_RELAX = {
    "Pow": "Relax has no gradient for power",
    "Erf": "Relax has no gradient for erf",
    "Dropout": "imported as a no-op",
    "Reciprocal": "imported as divide (covered)",
    "LeakyRelu": "Relax has no gradient for leakyrelu",
    "Clip": "Relax has no gradient for clip",
    "MaxPool": "Relax has no gradient for max_pool2d with padding",
    "BatchNormalization_train": "the forward model's BN is inference mode; training mode has no Relax twin",
    "GlobalMaxPool": "Relax has no gradient for max",
    "Slice_steps": "Relax has no gradient for strided_slice with negative steps",
    "Gather_embedding": "Relax has no gradient for take",
    "Gather_axis1": "Relax has no gradient for take",
    "Gather_class_token": "Relax has no gradient for take",
    "Gather_last_axis": "Relax has no gradient for take",
    "ConvTranspose": "Relax has no gradient for conv2d_transpose",
    "ConvTranspose_groups": "Relax has no gradient for conv2d_transpose",
    "Conv1d": "Relax has no gradient for conv1d",
    "Expand": "Relax has no gradient for broadcast_to",
    "Conv_dilation": "Relax's conv2d gradient builds a conv2d_transpose with output padding >= stride and fails",
    "Conv_3x1_dilation_pad": "Relax's conv2d gradient builds a conv2d_transpose with output padding >= stride and fails",
    "Slice": "Relax has no gradient for strided_slice",
    "Squeeze": "Relax has no gradient for squeeze",
    "Sum": "imported as stack, which has no Relax gradient",
    "Resize_nearest_x2": "Relax has no gradient for image.resize2d",
    "Resize_nearest_down": "Relax has no gradient for image.resize2d",
    "Resize_linear_x2": "Relax has no gradient for image.resize2d",
    "Resize_linear_align_sizes": "Relax has no gradient for image.resize (rank 3)",
    "Resize_cubic_axes": "Relax has no gradient for image.resize2d",
    "Resize_linear_antialias_down": "Relax has no gradient for image.resize2d",
    "Resize_trilinear_depth": "Relax has no gradient for image.resize3d",
    "LRN_size5": "Relax has no gradient for nn.local_response_norm",
    "LRN_size4_even": "Relax has no gradient for nn.local_response_norm",
    "Where": "Relax's where gradient is not reduced to a broadcast operand's shape (returns (2, 3) for b (3,))",
}

#: Relax checks in the fast suite (about 1.5 s each); the others are slow-marked
FAST_RELAX = {"MatMul_batched_broadcast", "Conv_stride_pad", "LayerNormalization", "Softmax", "Gemm_transB"}


def _model(case: str) -> tuple[onnx.ModelProto, str, tuple[int, ...]]:
    op, inputs, attrs, out_shape = CASES[case]
    inits = []
    names = []
    for name, arr in inputs.items():
        if arr is None:  # an optional input left out (Resize's scales when sizes are given)
            names.append("")
            continue
        arr = np.asarray(arr)
        if arr.dtype.kind == "f" and name not in ("roi", "scales"):  # Resize's stay float32 (ONNX's type)
            arr = arr.astype(np.float64)
        inits.append(numpy_helper.from_array(arr, name))
        names.append(name)
    outputs = ["y", "y.unused"] if op == "Split" else ["y"]  # Split: the second output gets no gradient
    node = helper.make_node(op, names, outputs, name=f"{case}.node", **attrs)
    graph = helper.make_graph([node], case, [], [helper.make_tensor_value_info("y", TensorProto.DOUBLE, list(out_shape))],
                              initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 8
    return model, "y", out_shape


def _transpose_perms(prog: onnx.ModelProto) -> list[list[int]]:
    """The ``perm`` of every Transpose in ``prog``, in node order."""
    return [list(a.ints) for n in prog.graph.node if n.op_type == "Transpose"
            for a in n.attribute if a.name == "perm"]


def _small_conv_step(out_channels: int) -> onnx.ModelProto:
    """The MSE + SGD training step (a proto) of one 3x3 conv, 3 -> ``out_channels``, padded, on
    2x2 maps of one image: 4 rows of im2col columns, so its weight gradient is larger than the
    columns when ``out_channels`` > 4 (the im2col form tests of test_im2col_*.py)."""
    import onnx_ir as ir

    from partitioner.training import SGD
    from partitioner.training.step import build_training_graph

    w = numpy_helper.from_array(np.zeros((out_channels, 3, 3, 3), np.float32), "w")
    g = helper.make_graph([helper.make_node("Conv", ["input", "w"], ["out"], pads=[1, 1, 1, 1])], "c",
                          [helper.make_tensor_value_info("input", TensorProto.FLOAT, [1, 3, 2, 2])],
                          [helper.make_tensor_value_info("out", TensorProto.FLOAT, [1, out_channels, 2, 2])], [w])
    step = build_training_graph(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), loss="mse",
                                optimizer=SGD(lr=0.1))
    return ir.to_proto(step)


def _trainable(case: str) -> list[str]:
    op, inputs, _, _ = CASES[case]
    names = [n for n, a in inputs.items() if np.asarray(a).dtype.kind == "f"]
    if op in ("Clip", "Resize"):
        return ["x"]
    if op == "BatchNormalization":
        return ["x", "scale", "bias"]
    return names


def _feeds(case: str) -> dict[str, np.ndarray]:
    return {"labels": np.random.default_rng(7).standard_normal(CASES[case][3])}


@pytest.mark.parametrize("case", sorted(CASES))
def test_rule_matches_finite_differences(case: str) -> None:
    model, _, _ = _model(case)
    loss, grads, prog, weights = gradients(model, _feeds(case), "mse", _trainable(case))
    assert np.isfinite(loss)
    assert any(np.abs(g).max() > 0 for g in grads.values()), "every gradient is zero: the check would be vacuous"
    bad = finite_differences(prog, _feeds(case), weights, grads)
    assert not bad, f"{case}: " + "; ".join(bad[:5])


GEMM_FORM = ("Conv", "Conv_stride_pad", "Conv_dilation", "Conv_1x1_stride", "Conv_3x1_dilation_pad")


@pytest.mark.parametrize("case", GEMM_FORM)
def test_conv_weight_gradient_forms(case: str, monkeypatch) -> None:
    """linear.py's GEMM weight gradient rule: a one-group 2-D Conv of at most 9 kernel offsets
    takes dW as a MatMul over an im2col (no Conv in its backward: the input gradient is a
    ConvTranspose), by default; with the rule off, as a Conv again. Both forms against finite
    differences."""
    from partitioner.training.rules import linear

    model, _, _ = _model(case)  # the default: the GEMM form
    assert any(n.op_type == "MatMul" for n in gradients(model, _feeds(case), "mse", _trainable(case))[2].graph.node)
    for on in (True, False):
        monkeypatch.setattr(linear, "GEMM_WEIGHT_GRAD", on)
        model, _, _ = _model(case)
        loss, grads, prog, weights = gradients(model, _feeds(case), "mse", _trainable(case))
        convs = sum(1 for n in prog.graph.node if n.op_type == "Conv")
        assert convs == (1 if on else 2), (on, convs)  # the forward Conv (+ the weight gradient's with the rule off)
        assert any(n.op_type == "MatMul" for n in prog.graph.node) == on
        bad = finite_differences(prog, _feeds(case), weights, grads)
        assert not bad, f"{case} (GEMM form {on}): " + "; ".join(bad[:5])


@pytest.mark.parametrize("case", [c if c in FAST_RELAX else pytest.param(c, marks=pytest.mark.slow)
                                  for c in sorted(set(CASES) - set(NO_RELAX))])
def test_rule_matches_relax_gradient(case: str) -> None:
    model, out, _ = _model(case)
    feeds = _feeds(case)
    loss, grads, _, weights = gradients(model, feeds, "mse", _trainable(case))
    forward = with_mse_loss(model, out)
    # Relax takes the trainable operands as function parameters (keep_params_in_input)
    rloss, rgrads = relax_gradients(forward, feeds, weights)
    assert abs(rloss - loss) <= 1e-9 + 1e-6 * abs(loss)
    for name, g in grads.items():
        np.testing.assert_allclose(g, rgrads[name], rtol=1e-6, atol=1e-9, err_msg=f"{case}: d loss / d {name}")


def test_every_issue_rule_is_registered_and_tested() -> None:
    """The issue's op list: each has a rule and at least one case here (BN through its rewrite)."""
    ops = ["Gemm", "MatMul", "Conv", "ConvTranspose", "Add", "Sub", "Mul", "Div", "Relu", "LeakyRelu", "Sigmoid", "Tanh", "Erf", "Gelu", "Softmax", "LogSoftmax", "LayerNormalization", "BatchNormalization", "MaxPool", "AveragePool", "GlobalAveragePool", "Flatten", "Reshape", "Transpose", "Concat", "Split", "Slice", "Gather", "ReduceMean", "ReduceSum", "Dropout", "Identity", "Cast", "Where", "Pow", "Sqrt", "Exp"]
    assert not [op for op in ops if op not in GRADIENTS]
    tested = {c[0] for c in CASES.values()}
    assert not [op for op in ops if op not in tested and op != "Gelu"]
