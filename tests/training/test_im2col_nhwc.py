"""linear.IM2COL_NHWC (session 18): the GEMM weight gradient's im2col built channels last.

The input goes to [N, H, W, C], is padded on H and W, each kernel offset's slice [N, Ho, Wo, C]
is concatenated on the channel axis (``[N, Ho, Wo, K*C]``, reshaped for free to ``cols [N*Ho*Wo,
K*C]``), and ``dY [O, N*Ho*Wo] @ cols`` ([O, kh, kw, C]) is transposed to OIHW. Taken only where the
columns are at least as large as dW. Checked: which form each setting builds; the form against
central finite differences (float64, ONNX Runtime; test_rules.py's tolerances); the TVM schedule
of its fused im2col (one vector loop per kernel offset: ``injective.CONCAT_THROUGH_RESHAPE``)
against numpy; a TVM 1F1B pipeline with the rule (and with pipeline rule 14, which then feeds the
im2col the NHWC stash) against a 1-rank ONNX Runtime step after 10 SGD steps, and the 1-rank TVM
step with the rule on against off after 10 steps (rtol 1e-4, atol 1e-5).
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from partitioner.training.rules import linear
from tests.training.gradcheck import finite_differences, gradients
from tests.training.test_rules import (GEMM_FORM, _feeds, _model, _small_conv_step, _trainable,
                                       _transpose_perms)

NHWC_COLUMNS = [0, 3, 1, 2]  # dW [O, kh, kw, C] -> OIHW: the form's last transpose
OTHER_COLUMNS = [0, 3, 4, 1, 2]  # the other form's [N, C, K, Ho, Wo] -> [N, Ho, Wo, C, K]


@pytest.mark.parametrize("on", [True, False])
@pytest.mark.parametrize("case", GEMM_FORM)
def test_columns_form_and_finite_differences(case: str, on: bool, monkeypatch) -> None:
    """On (the default): the slices concatenated on axis 3 (channels last) and dW transposed from
    [O, kh, kw, C]; off: the other form's 5-D transpose. Both give the finite-difference gradients."""
    monkeypatch.setattr(linear, "IM2COL_NHWC", on)
    model, _, _ = _model(case)
    _, grads, prog, weights = gradients(model, _feeds(case), "mse", _trainable(case))
    perms = _transpose_perms(prog)
    kernel1 = "1x1" in case
    assert (NHWC_COLUMNS in perms) is on, perms
    assert (OTHER_COLUMNS in perms) is not on, perms
    concat_axes = [a.i for n in prog.graph.node if n.op_type == "Concat" for a in n.attribute if a.name == "axis"]
    assert concat_axes == ([] if kernel1 else [3 if on else 2])
    bad = finite_differences(prog, _feeds(case), weights, grads)
    assert not bad, f"{case} (NHWC im2col {on}): " + "; ".join(bad[:5])


@pytest.mark.parametrize("out_channels", [4, 16])
def test_only_columns_at_least_as_large_as_the_weight_gradient(out_channels: int, monkeypatch) -> None:
    """A 3x3 conv on 2x2 maps of one image (4 column rows): 4 output channels take the NHWC form,
    16 (dW 4x the columns' rows) keep the other form."""
    monkeypatch.setattr(linear, "IM2COL_NHWC", True)
    assert (NHWC_COLUMNS in _transpose_perms(_small_conv_step(out_channels))) is (out_channels == 4)


def _columns_program(n: int, c: int, hw: int, stride: int) -> onnx.ModelProto:
    """The NHWC im2col alone: x [n, hw, hw, c] padded by 1, nine 3x3-offset slices with ``stride``
    concatenated on channels, reshaped to [rows, 9c]."""
    ho = (hw + 2 - 3) // stride + 1
    inits = [numpy_helper.from_array(np.array(v, np.int64), k) for k, v in
             (("pads", [0, 1, 1, 0, 0, 1, 1, 0]), ("axes", [1, 2]), ("steps", [stride, stride]),
              ("shape", [n * ho * ho, 9 * c]))]
    nodes, parts = [helper.make_node("Pad", ["x", "pads"], ["xp"])], []
    for kh in range(3):
        for kw in range(3):
            k = kh * 3 + kw
            end = [kh + (ho - 1) * stride + 1, kw + (ho - 1) * stride + 1]
            inits += [numpy_helper.from_array(np.array([kh, kw], np.int64), f"s{k}"),
                      numpy_helper.from_array(np.array(end, np.int64), f"e{k}")]
            nodes.append(helper.make_node("Slice", ["xp", f"s{k}", f"e{k}", "axes", "steps"], [f"p{k}"]))
            parts.append(f"p{k}")
    nodes += [helper.make_node("Concat", parts, ["cat"], axis=3), helper.make_node("Reshape", ["cat", "shape"], ["y"])]
    g = helper.make_graph(nodes, "cols", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [n, hw, hw, c])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [n * ho * ho, 9 * c])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("stride", [1, 2])
def test_nhwc_columns_run_one_vector_loop_per_offset(stride: int, monkeypatch) -> None:
    """TVM fuses pad, slices, concat and reshape into one kernel; with CONCAT_THROUGH_RESHAPE its
    channel loop is split per kernel offset (9 vector loops), off one loop with a select chain.
    Both match numpy's im2col exactly (a copy)."""
    import tvm
    from tvm import relax

    from backends.tvm import parallel_scope
    from backends.tvm.lower import lower_program
    from backends.tvm.pipeline import run_pipeline
    from backends.tvm.schedules import injective as inj
    from backends.tvm.target import detect_host_target

    n, c, hw = 2, 16, 6
    x = np.random.default_rng(1).standard_normal((n, hw, hw, c)).astype(np.float32)
    xp = np.pad(x, ((0, 0), (1, 1), (1, 1), (0, 0)))
    ho = (hw - 1) // stride + 1
    want = np.concatenate([xp[:, kh:kh + (ho - 1) * stride + 1:stride, kw:kw + (ho - 1) * stride + 1:stride, :]
                           for kh in range(3) for kw in range(3)], axis=3).reshape(n * ho * ho, 9 * c)
    target = tvm.target.Target(detect_host_target())
    loops = {}
    for on in (True, False):
        monkeypatch.setattr(inj, "CONCAT_THROUGH_RESHAPE", on)
        mod = run_pipeline(lower_program(_columns_program(n, c, hw, stride)).mod, "scheduled", target)
        got = relax.VirtualMachine(parallel_scope.compile(mod, target), tvm.cpu())["main"](tvm.runtime.tensor(x))
        np.testing.assert_array_equal((got if isinstance(got, tvm.runtime.Tensor) else got[0]).numpy(), want)
        loops[on] = [f.script().count("T.vectorized(") for gv, f in mod.functions.items()
                     if isinstance(f, tvm.tirx.PrimFunc) and "concatenate" in gv.name_hint]
    assert loops[True] == [9] and loops[False] == [1], loops


@pytest.mark.slow
@pytest.mark.parametrize("stash", [False, True], ids=["nchw_stash", "nhwc_stash"])
def test_tvm_pipeline_with_nhwc_columns_trains_like_one_rank(stash: bool, tmp_path, monkeypatch) -> None:
    """Two TVM stages (1F1B x4; 3x3 convs with padding, the conv net of test_pipeline_nhwc_stash.py)
    with the NHWC im2col, and with pipeline rule 14 (its rule 5 then feeds the im2col the stash as F
    wrote it: no Transpose of a ``.nhwc`` value left in B) against a 1-rank ONNX Runtime step, 10
    SGD steps, every weight."""
    from partitioner.training import SGD, nhwc_stash
    from partitioner.training import pipeline as pipe
    from partitioner.training.pipeline import build_pipeline

    from .test_pipeline_nhwc_stash import IMAGE, _resnet_like
    from .test_pipeline_training import _tvm_pipeline_trains_like_one_rank

    monkeypatch.setattr(linear, "IM2COL_NHWC", True)
    monkeypatch.setattr(nhwc_stash, "NHWC_STASH", stash)
    monkeypatch.setattr(pipe, "CUT_AFTER", ("r2",))
    model = _resnet_like()
    plan = build_pipeline(model, "cross_entropy", SGD(lr=0.1), batch=8, stages=2, micro_batches=4, backend="tvm")
    bwd = plan.stages[0].backward
    assert NHWC_COLUMNS in _transpose_perms(bwd)
    if stash:
        fed = [n for n in bwd.graph.node if n.op_type == "Identity" and n.input[0].endswith(nhwc_stash.SUFFIX)]
        assert fed, "rule 5: the im2col reads a .nhwc stash value directly"
        nchw = {i.name[:-len(nhwc_stash.SUFFIX)] for i in bwd.graph.input if i.name.endswith(nhwc_stash.SUFFIX)}
        to_nhwc = [n.input[0] for n in bwd.graph.node if n.op_type == "Transpose"
                   and any(a.name == "perm" and list(a.ints) == [0, 2, 3, 1] for a in n.attribute)]
        assert not set(to_nhwc) & nchw, "a stash value transposed back and forth"
    _tvm_pipeline_trains_like_one_rank(model, plan, IMAGE, tmp_path, steps=10)


@pytest.mark.slow
def test_tvm_step_weights_match_with_the_rule_off(tmp_path, monkeypatch) -> None:
    """The 1-rank TVM step of the conv net, rule on against off: 10 SGD steps on seeded batches,
    losses and every weight within rtol 1e-4, atol 1e-5."""
    from partitioner.training import SGD, build_training_graph
    from partitioner.training.runner import StepRunner

    from .test_pipeline_nhwc_stash import IMAGE, _resnet_like

    rng = np.random.default_rng(7)
    batches = [(rng.standard_normal((8, *IMAGE)).astype(np.float32), rng.integers(0, 10, 8)) for _ in range(10)]
    runs = {}
    for on in (True, False):
        monkeypatch.setattr(linear, "IM2COL_NHWC", on)
        step = build_training_graph(_resnet_like(), optimizer=SGD(lr=0.1))
        r = StepRunner(step, backend="tvm", workdir=tmp_path / str(on))
        runs[on] = ([r.step({"input": x}, y) for x, y in batches], r.state)
    np.testing.assert_allclose(runs[True][0], runs[False][0], rtol=1e-4, atol=1e-5)
    for name, w in runs[False][1].items():
        np.testing.assert_allclose(runs[True][1][name], w, rtol=1e-4, atol=1e-5, err_msg=name)
