"""Hoist rule 4's phase form: a stride-2 ``ConvTranspose(dY, W)`` of a weight (a strided conv's
input gradient) becomes ``DepthToSpace(Conv(dY, W_phase))``, cropped when the output is odd.

Checked against ONNX Runtime's ConvTranspose on the original graph (seeded inputs, rtol 1e-4,
atol 1e-4): the rewritten graph run by ONNX Runtime over many kernel / pads / output_padding /
odd-even cases, and by TVM on the resnet forms and odd sizes in one program; and a TVM training
step with a stride-2 conv trains like the ONNX Runtime step. With
``hoist.STRIDED_CONV_TRANSPOSE_AS_CONV`` off the strided ConvTransposes stay (the tests that
assert their absence fail)."""

from __future__ import annotations

import itertools

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from partitioner.training import SGD, build_training_graph
from partitioner.training import hoist
from partitioner.training.runner import StepRunner

#: (dY channels, dX channels, kernel, pads [t, l, b, r], output_padding, dY map [h, w])
CASES = [(8, 4, 3, 1, [1, 1, 1, 1], [1, 1], [4, 4]),     # resnet's 3x3 stride-2 conv, even input
         (8, 4, 3, 1, [1, 1, 1, 1], [0, 0], [4, 5]),     # odd input (7 or 9 wide): a crop
         (8, 4, 1, 1, [0, 0, 0, 0], [1, 1], [4, 4]),     # resnet's 1x1 downsample
         (6, 3, 5, 2, [2, 1, 2, 0], [1, 0], [3, 5]),     # asymmetric pads, 5x5 kernel
         (6, 3, 2, 1, [0, 0, 0, 0], [0, 1], [5, 4])]     # kernel == stride


def _graph(cases: list, batch: int = 2) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    rng = np.random.default_rng(11)
    nodes, inputs, outputs, feeds = [], [], [], {}
    for i, (m, c, k, _, pads, extra, hw) in enumerate(cases):
        feeds[f"dy{i}"] = rng.standard_normal((batch, m, *hw)).astype(np.float32)
        feeds[f"w{i}"] = rng.standard_normal((m, c, k, k)).astype(np.float32)
        inputs += [helper.make_tensor_value_info(f"dy{i}", TensorProto.FLOAT, [batch, m, *hw]),
                   helper.make_tensor_value_info(f"w{i}", TensorProto.FLOAT, [m, c, k, k])]
        out = [(hw[a] - 1) * 2 + extra[a] + k - pads[a] - pads[a + 2] for a in range(2)]
        outputs.append(helper.make_tensor_value_info(f"dx{i}", TensorProto.FLOAT, [batch, c, *out]))
        nodes.append(helper.make_node("ConvTranspose", [f"dy{i}", f"w{i}"], [f"dx{i}"], name=f"ct{i}",
                                      strides=[2, 2], pads=pads, output_padding=extra))
    g = helper.make_graph(nodes, "strided_ct", inputs, outputs)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), feeds


def _ort(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)


def _rewritten(model: onnx.ModelProto) -> onnx.ModelProto:
    out = onnx.ModelProto()
    out.CopyFrom(model)
    hoist.conv_transpose_as_conv(out, {vi.name for vi in out.graph.input if vi.name.startswith("w")})
    return out


GRID = [(4, 3, k, 1, pads, extra, hw) for k, pads, extra, hw in itertools.product(
    [1, 2, 3, 4, 5], [[0, 0, 0, 0], [1, 1, 1, 1], [1, 0, 0, 1]], [[0, 0], [1, 1], [0, 1]], [[3, 3], [4, 5]])]


def test_phase_form_equals_conv_transpose_under_onnx_runtime() -> None:
    """Every stride-2 case with pads below the kernel is rewritten and matches, shape and values."""
    model, feeds = _graph(GRID)
    new = _rewritten(model)
    onnx.checker.check_model(new, full_check=True)
    left = [n.name for n in new.graph.node if n.op_type == "ConvTranspose"]
    assert left == [f"ct{i}" for i, c in enumerate(GRID) if max(c[4]) >= c[2]], "only pads >= kernel may stay"
    for i, (want, got) in enumerate(zip(_ort(model, feeds), _ort(new, feeds))):
        assert got.shape == want.shape, GRID[i]
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4, err_msg=str(GRID[i]))


@pytest.mark.slow
def test_phase_form_on_tvm_equals_onnx_runtime_conv_transpose(tmp_path) -> None:
    from partitioner.training.pipeline_runner import executable

    model, feeds = _graph(CASES)
    new = _rewritten(model)
    assert {n.op_type for n in new.graph.node} >= {"Conv", "DepthToSpace", "Slice"}
    assert not any(n.op_type == "ConvTranspose" for n in new.graph.node)
    got = executable(new, "tvm", tmp_path, 1).run(feeds, None)
    for i, want in enumerate(_ort(model, feeds)):
        np.testing.assert_allclose(got[f"dx{i}"], want, rtol=1e-4, atol=1e-4, err_msg=str(CASES[i]))


def _strided_net() -> onnx.ModelProto:
    """Conv 3x3 -> Relu -> MaxPool 3x3 stride 2 (pad 1, resnet's stem pool, 7x7 -> 4x4: an odd
    input) -> Conv 3x3 stride 2 (pad 1, 4x4 -> 2x2) -> Relu -> Flatten -> Gemm."""
    rng = np.random.default_rng(4)
    inits = [numpy_helper.from_array((rng.standard_normal(s) * 0.2).astype(np.float32), n) for n, s in
             (("c1.weight", (4, 2, 3, 3)), ("c2.weight", (6, 4, 3, 3)), ("fc.weight", (10, 6 * 2 * 2)))]
    nodes = [helper.make_node("Conv", ["input", "c1.weight"], ["c1"], name="c1", pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c1"], ["r1a"], name="r1"),
             helper.make_node("MaxPool", ["r1a"], ["r1"], name="pool", kernel_shape=[3, 3], strides=[2, 2],
                              pads=[1, 1, 1, 1]),
             helper.make_node("Conv", ["r1", "c2.weight"], ["c2"], name="c2", pads=[1, 1, 1, 1], strides=[2, 2]),
             helper.make_node("Relu", ["c2"], ["r2"], name="r2"),
             helper.make_node("Flatten", ["r2"], ["flat"], name="flat"),
             helper.make_node("Gemm", ["flat", "fc.weight"], ["logits"], name="fc", transB=1)]
    g = helper.make_graph(nodes, "strided", [helper.make_tensor_value_info("input", TensorProto.FLOAT, [8, 2, 7, 7])],
                          [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [8, 10])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.slow
def test_tvm_step_with_a_strided_conv_trains_like_onnx_runtime(tmp_path) -> None:
    """The 1-rank TVM step (runner.TVM_CONV_TRANSPOSE_AS_CONV) runs c2's input gradient and the
    MaxPool gradient's scatter (a ConvTranspose of a constant one-hot filter, hoist.CONSTANT_FILTERS)
    in the phase form; weights after 4 SGD steps within rtol 1e-4, atol 1e-5 of the ONNX Runtime step."""
    step = build_training_graph(_strided_net(), optimizer=SGD(lr=0.1))
    ref = StepRunner(step)
    strided = [n for n in ref.program.graph.node if n.op_type == "ConvTranspose"
               and any(a.name == "strides" and list(a.ints) == [2, 2] for a in n.attribute)]
    assert len(strided) == 2, "the case must have c2's input gradient and the MaxPool's scatter"
    tvm = StepRunner(step, backend="tvm", workdir=tmp_path)
    assert not any(n.op_type == "ConvTranspose" for n in tvm.program.graph.node)
    from .test_tvm_step_conv_transpose import _tvm_steps_match_ort

    _tvm_steps_match_ort(tvm, ref, (2, 7, 7), seed=6)


def _stage_convs(plan) -> list[tuple[onnx.NodeProto, dict[str, onnx.NodeProto], set[str]]]:
    out = []
    for st in plan.stages:
        for p in (st.forward, st.backward, st.fused):
            if p is not None:
                producers = {o: n for n in p.graph.node for o in n.output}
                inputs = {vi.name for vi in p.graph.input}
                out += [(n, producers, inputs) for n in p.graph.node if n.op_type == "Conv"]
    return out


@pytest.mark.parametrize("on", [None, False])  # None: the module default (on)
def test_stage_conv_weights_are_hoisted_in_hwio(monkeypatch, on) -> None:
    """Rule 5 (hoist.HWIO_CONV_WEIGHTS): every per-micro-batch Conv of a weight reads
    ``Transpose(hoisted HWIO value, [3, 2, 0, 1])``, the one transpose TVM cancels against its own
    HWIO permute; off, the Conv reads the weight (or its hoisted form) as a program input."""
    from partitioner.training.pipeline import build_pipeline

    if on is not None:
        monkeypatch.setattr(hoist, "HWIO_CONV_WEIGHTS", on)
    on = on is None
    plan = build_pipeline(_strided_net(), "cross_entropy", SGD(lr=0.1), batch=8, stages=2, micro_batches=4,
                          backend="tvm")
    weight_convs = [(n, prod) for n, prod, ins in _stage_convs(plan) if n.input[1] in ins or n.input[1] in prod
                    and prod[n.input[1]].op_type == "Transpose" and prod[n.input[1]].input[0] in ins]
    assert len(weight_convs) == 3  # c1, c2 and c2's phase-form input gradient (not the MaxPool's constant ones)
    for n, prod in weight_convs:
        t = prod.get(n.input[1])
        assert (t is not None and t.op_type == "Transpose" and list(t.attribute[0].ints) == [3, 2, 0, 1]
                and t.input[0].startswith(hoist.PREFIX)) is on, n.name


@pytest.mark.slow
def test_tvm_pipeline_with_a_strided_conv_trains_like_one_rank(tmp_path) -> None:
    """Rules 4 (phase form) and 5 (HWIO weights) in TVM pipeline stages: 2 stages x 4 micro-batches
    against a 1-rank ONNX Runtime step, 4 SGD steps, rtol 1e-4, atol 1e-5, every state entry."""
    from partitioner.training.pipeline import build_pipeline

    from .test_pipeline_training import _tvm_pipeline_trains_like_one_rank

    model = _strided_net()
    plan = build_pipeline(model, "cross_entropy", SGD(lr=0.1), batch=8, stages=2, micro_batches=4, backend="tvm")
    assert not any(n.op_type == "ConvTranspose" for st in plan.stages for p in (st.forward, st.backward, st.fused)
                   if p is not None for n in p.graph.node)
    _tvm_pipeline_trains_like_one_rank(model, plan, (2, 7, 7), tmp_path)


@pytest.mark.parametrize("on", [None, False])  # None: the module default (on)
def test_constant_filters_take_the_phase_form(monkeypatch, on) -> None:
    """hoist.CONSTANT_FILTERS: a strided ConvTranspose of an initializer (the MaxPool gradient's
    one-hot scatter) is rewritten too and still matches ONNX Runtime; off, it stays."""
    if on is not None:
        monkeypatch.setattr(hoist, "CONSTANT_FILTERS", on)
    on = on is None
    model, feeds = _graph(CASES[:2])
    w = feeds.pop("w0")
    model.graph.initializer.append(numpy_helper.from_array(w, "w0"))
    kept = [vi for vi in model.graph.input if vi.name != "w0"]
    del model.graph.input[:]
    model.graph.input.extend(kept)
    new = onnx.ModelProto()
    new.CopyFrom(model)
    hoist.conv_transpose_as_conv(new, {"w1"})
    assert [n.name for n in new.graph.node if n.op_type == "ConvTranspose"] == ([] if on else ["ct0"])
    for want, got in zip(_ort(model, feeds), _ort(new, feeds)):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
