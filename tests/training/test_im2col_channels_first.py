"""linear.IM2COL_CHANNELS_FIRST: the GEMM weight gradient's im2col built as ``cols^T`` [C*K,
N*Ho*Wo] (the input's planes sliced at each kernel offset, concatenated on a channel-major axis)
and multiplied by ``dY`` as [N*Ho*Wo, O], so no transpose of the K-times-larger columns.

The knob is off by default (no step-level win in paired runs: linear.py's docstring), so every
test here turns it on. Checked: which form each knob setting builds; both forms against central finite differences
(float64, ONNX Runtime; the tolerances of test_rules.py); and a TVM pipeline built with the
default against a 1-rank ONNX Runtime step after 10 SGD steps (rtol 1e-4, atol 1e-5).
"""

from __future__ import annotations

import pytest

from partitioner.training.rules import linear
from tests.training.gradcheck import finite_differences, gradients
from tests.training.test_rules import (GEMM_FORM, _feeds, _model, _small_conv_step, _trainable,
                                       _transpose_perms)

COLUMNS_TRANSPOSE = [0, 3, 4, 1, 2]  # the [N, C, K, Ho, Wo] -> [N, Ho, Wo, C, K] columns of the other form


@pytest.mark.parametrize("on", [True, False])
@pytest.mark.parametrize("case", GEMM_FORM)
def test_columns_form_and_finite_differences(case: str, on: bool, monkeypatch) -> None:
    """On (the default): the columns are concatenated on axis 1 of [C, K, N, Ho, Wo] and never
    transposed; off: the [N*Ho*Wo, C*K] columns through the 5-D transpose. Both forms give the
    finite-difference gradients."""
    monkeypatch.setattr(linear, "IM2COL_CHANNELS_FIRST", on)
    monkeypatch.setattr(linear, "IM2COL_NHWC", False)  # off: the NCHW form (test_im2col_nhwc.py has the other)
    model, _, _ = _model(case)
    _, grads, prog, weights = gradients(model, _feeds(case), "mse", _trainable(case))
    assert (COLUMNS_TRANSPOSE in _transpose_perms(prog)) is not on
    concat_axes = [a.i for n in prog.graph.node if n.op_type == "Concat" for a in n.attribute if a.name == "axis"]
    kernel = 1 if "1x1" in case else 2  # a 1x1 kernel has one offset: no Concat
    assert concat_axes == ([] if kernel == 1 else [1 if on else 2])
    bad = finite_differences(prog, _feeds(case), weights, grads)
    assert not bad, f"{case} (channels first {on}): " + "; ".join(bad[:5])


@pytest.mark.parametrize("out_channels", [4, 16])
def test_only_columns_at_least_as_large_as_the_weight_gradient(out_channels: int, monkeypatch) -> None:
    """A 3x3 conv on 2x2 maps of one image (N*Ho*Wo = 4 columns rows): with 4 output channels the
    columns are channels first, with 16 (dW 4x the columns' rows) they keep the other form."""
    monkeypatch.setattr(linear, "IM2COL_CHANNELS_FIRST", True)
    monkeypatch.setattr(linear, "IM2COL_NHWC", False)  # 16 channels: the NCHW form, not the NHWC one
    assert (COLUMNS_TRANSPOSE in _transpose_perms(_small_conv_step(out_channels))) is (out_channels > 4)


@pytest.mark.slow
def test_tvm_pipeline_with_the_columns_trains_like_one_rank(tmp_path, monkeypatch) -> None:
    """Two TVM stages (1F1B x4, 3x3 convs with padding, one stride 2: both take the GEMM weight
    gradient channels first) against a 1-rank ONNX Runtime step, 10 SGD steps, every state entry."""
    from partitioner.training import SGD
    from partitioner.training.pipeline import build_pipeline

    from .test_pipeline_training import _tvm_pipeline_trains_like_one_rank
    from .test_strided_conv_transpose import _strided_net

    monkeypatch.setattr(linear, "IM2COL_CHANNELS_FIRST", True)
    model = _strided_net()
    plan = build_pipeline(model, "cross_entropy", SGD(lr=0.1), batch=8, stages=2, micro_batches=4, backend="tvm")
    assert not any(COLUMNS_TRANSPOSE in _transpose_perms(p)
                   for st in plan.stages for p in (st.forward, st.backward, st.fused)
                   if p is not None)
    _tvm_pipeline_trains_like_one_rank(model, plan, (2, 7, 7), tmp_path, steps=10)
