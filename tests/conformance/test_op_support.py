"""The TVM op/dtype support table, the form rewrites and the data-dependent-shape refusal, each
checked on the ONNX node cases that failed or mismatched before them (onnx's expected outputs,
the case's own rtol/atol, :func:`cases.run_case`).

- a rewritten form must now *pass* on TVM (it errored or mismatched before);
- a refused form must be a clean ``refused`` (it was a build error or a silent mismatch), and
  under ``--fallback onnxruntime`` the refused node runs on ONNX Runtime and the case passes.
"""

from __future__ import annotations

import onnx
import pytest
from onnx import TensorProto, helper

import tvm  # noqa: F401  (a broken install fails, never skips)

from backends.tvm import op_support
from backends.tvm.form_rewrites import conv_transpose_pads

from .cases import load_cases, run_case

# Each failed before this table or rewrite existed (status in the last full run before it).
REWRITTEN = (
    "test_sinh",  # error: LLVM has no sinh intrinsic
    "test_isinf_negative",  # mismatch: TVM ignored detect_positive=0
    "test_squeeze_negative_axes",  # error: std::bad_alloc in the build
    "test_convtranspose_output_shape",  # mismatch: output_shape ignored
)
REFUSED = (
    "test_layer_normalization_2d_axis0",  # mismatch: Mean/InvStdDev outputs empty
    "test_batchnorm_example_training_mode",  # mismatch: inference statistics used
    "test_resize_downsample_scales_linear",  # mismatch: TVM samples differently when downsampling
    "test_cast_FLOAT_to_FLOAT8E4M3FN",  # error: TVM build failure on float8
    "test_unique_length_1",  # error: shape-inference failure (data-dependent shape)
)


@pytest.fixture(scope="module")
def cases():
    return load_cases()


@pytest.mark.parametrize("name", REWRITTEN)
def test_rewritten_form_passes_on_tvm(cases, name: str) -> None:
    result, exc = run_case(cases[name], ranks=1)
    assert result.status == "pass", (result.status, result.reason)


@pytest.mark.parametrize("name", REFUSED)
def test_refused_form_is_a_clean_refusal(cases, name: str) -> None:
    result, _ = run_case(cases[name], ranks=1)
    assert (result.status, result.kind) == ("refused", "unsupported"), result.reason


@pytest.mark.parametrize("name", ["test_batchnorm_example_training_mode", "test_cast_FLOAT_to_FLOAT8E4M3FN"])
def test_refused_form_runs_under_the_ort_fallback(cases, name: str) -> None:
    result, _ = run_case(cases[name], ranks=1, fallback="onnxruntime")
    assert result.status == "pass", (result.status, result.reason)


def _model(node: onnx.NodeProto, inputs, outputs) -> onnx.ModelProto:
    g = helper.make_graph([node], "g", inputs, outputs)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)])


def test_table_names_every_refused_node_and_leaves_plain_forms_alone() -> None:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])
    plain = _model(helper.make_node("LayerNormalization", ["x", "s"], ["y"], name="ln", axis=-1),
                   [x, helper.make_tensor_value_info("s", TensorProto.FLOAT, [3])],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])])
    assert op_support.refusals(plain) == []
    with_mean = _model(helper.make_node("LayerNormalization", ["x", "s"], ["y", "mean"], name="ln", axis=-1),
                       [x, helper.make_tensor_value_info("s", TensorProto.FLOAT, [3])],
                       [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3]),
                        helper.make_tensor_value_info("mean", TensorProto.FLOAT, [2, 1])])
    found = op_support.refusals(with_mean)
    assert [(n.name, n.op_type) for n, _ in found] == [("ln", "LayerNormalization")]
    with pytest.raises(op_support.UnsupportedByBackendError, match=r"ln: LayerNormalization with its Mean"):
        op_support.check(with_mean)


def test_conv_transpose_pads_follow_onnx_formula() -> None:
    # stride 3, input 3, kernel 3: full output 9; output_shape 10 -> one extra zero row at the end
    node = helper.make_node("ConvTranspose", ["x", "w"], ["y"], strides=[3, 2], output_shape=[10, 8])
    assert conv_transpose_pads(node, [1, 1, 3, 3], [1, 2, 3, 3]) == ([0, 0, 0, 0], [1, 1])
    smaller = helper.make_node("ConvTranspose", ["x", "w"], ["y"], output_shape=[4, 4])
    assert conv_transpose_pads(smaller, [1, 1, 3, 3], [1, 1, 3, 3]) == ([1, 1, 0, 0], [0, 0])
    assert conv_transpose_pads(smaller, None, [1, 1, 3, 3]) is None
