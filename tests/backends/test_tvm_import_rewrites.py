"""``backends.tvm.import_pipeline.prepare_for_import``: Sum/Mean become Add chains and inference Dropout
becomes Identity, so TVM's NHWC ``ConvertLayout`` accepts graphs that light_resnet50,
light_shufflenet and light_squeezenet contain (it rejected the importer's ``stack`` and the tuple of
``R.nn.dropout``). Checked structurally and numerically against ONNX Runtime (rtol 1e-4, atol 1e-5).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import tvm  # noqa: E402,F401  (a broken install fails, never skips)

import backends.tvm as bt  # noqa: E402
from backends.tvm.import_pipeline import prepare_for_import  # noqa: E402
from partitioner.runtime.comm_local import LocalWorld  # noqa: E402

RTOL, ATOL = 1e-4, 1e-5


def _conv_sum_model() -> onnx.ModelProto:
    """Two convs summed with a broadcast bias (Sum of 3), a Mean of 2, a Dropout whose mask nobody
    reads, then global pooling: the shape of a residual block after the partitioner's passes."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal(s).astype(np.float32) * 0.3, n)
             for n, s in (("w1", (8, 4, 3, 3)), ("w2", (8, 4, 1, 1)), ("b", (1, 8, 1, 1)))]
    nodes = [
        helper.make_node("Conv", ["x", "w1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
        helper.make_node("Conv", ["x", "w2"], ["c2"], name="conv2"),
        helper.make_node("Sum", ["c1", "c2", "b"], ["s"], name="sum3"),
        helper.make_node("Mean", ["s", "c1"], ["m"], name="mean2"),
        helper.make_node("Relu", ["m"], ["r"], name="relu"),
        helper.make_node("Dropout", ["r"], ["d", "mask"], name="drop"),
        helper.make_node("GlobalAveragePool", ["d"], ["y"], name="gap"),
    ]
    g = helper.make_graph(nodes, "sum_mean_dropout", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4, 8, 8])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 8, 1, 1])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])
    onnx.checker.check_model(m, full_check=True)
    return m


def test_rewrite_replaces_sum_mean_dropout() -> None:
    out = prepare_for_import(_conv_sum_model())
    ops = [n.op_type for n in out.graph.node]
    assert "Sum" not in ops and "Mean" not in ops and "Dropout" not in ops
    assert ops.count("Add") == 3 and ops.count("Div") == 1 and ops.count("Identity") == 1
    onnx.checker.check_model(out, full_check=True)


def test_rewritten_model_matches_ort_through_the_scheduled_pipeline(tmp_path: Path) -> None:
    m = _conv_sum_model()
    x = np.random.default_rng(1).standard_normal((2, 4, 8, 8)).astype(np.float32)
    sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    want = sess.run(["y"], {"x": x})[0]
    for expr in (prepare_for_import(m),):  # the rewrite alone is exact up to float rounding
        got_ref = ort.InferenceSession(expr.SerializeToString(), providers=["CPUExecutionProvider"]).run(["y"], {"x": x})[0]
        np.testing.assert_allclose(got_ref, want, rtol=RTOL, atol=ATOL)
    bt.build(m, tmp_path / "rank0.so")  # default (scheduled, NHWC) pipeline: failed before the rewrite
    got = bt.load(m, tmp_path / "rank0.so").run({"x": x}, LocalWorld(1).communicator(0))["y"]
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)


def test_dropout_with_a_read_mask_is_kept() -> None:
    m = _conv_sum_model()
    m.graph.output.append(helper.make_tensor_value_info("mask", TensorProto.BOOL, [2, 8, 8, 8]))
    ops = [n.op_type for n in prepare_for_import(m).graph.node]
    assert "Dropout" in ops


@pytest.mark.parametrize("op", ["ReduceSum", "ReduceProd", "ReduceMax", "ReduceMin", "ReduceL2", "ReduceLogSumExp"])
def test_reduction_over_an_empty_axis_matches_ort(op: str, tmp_path: Path) -> None:
    """A reduction over a zero-length axis: TVM's kernel returned uninitialised memory; the rewrite
    makes it the empty-set value (0, 1, -inf, inf, 0, -inf), as ONNX Runtime computes it."""
    axes = numpy_helper.from_array(np.array([1], dtype=np.int64), "axes")
    nodes = [helper.make_node(op, ["x", "axes"], ["r"], name="reduce", keepdims=1),
             helper.make_node("Add", ["r", "b"], ["y"], name="add")]
    g = helper.make_graph(nodes, f"empty_{op}", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 0, 4]),
                                                 helper.make_tensor_value_info("b", TensorProto.FLOAT, [2, 1, 4])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 1, 4])], [axes])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
    onnx.checker.check_model(m, full_check=True)
    feeds = {"x": np.zeros((2, 0, 4), np.float32), "b": np.random.default_rng(0).standard_normal((2, 1, 4)).astype(np.float32)}
    want = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(["y"], feeds)[0]
    assert [n.op_type for n in prepare_for_import(onnx.shape_inference.infer_shapes(m)).graph.node] == ["Constant", "Add"]
    bt.build(m, tmp_path / "rank0.so")
    got = bt.load(m, tmp_path / "rank0.so").run(feeds, LocalWorld(1).communicator(0))["y"]
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)


def _clip_model(opset: int, lo, hi, runtime_bound: bool = False) -> onnx.ModelProto:
    inits, ins, attrs = [], ["x"], {}
    if opset < 11:
        attrs = {k: v for k, v in (("min", lo), ("max", hi)) if v is not None}
    else:
        for name, v in (("lo", lo), ("hi", hi)):
            if v is None:
                ins.append("")
            elif runtime_bound and name == "hi":
                ins.append("hi_in")
            else:
                inits.append(numpy_helper.from_array(np.array(v, np.float32), name))
                ins.append(name)
        while ins and ins[-1] == "":
            ins.pop()
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], name="conv", pads=[1, 1, 1, 1]),
             helper.make_node("Clip", ["c", *ins[1:]], ["y"], name="clip", **attrs)]
    w = numpy_helper.from_array(np.random.default_rng(2).standard_normal((8, 4, 3, 3)).astype(np.float32), "w")
    graph_inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 6, 6])]
    if runtime_bound:
        graph_inputs.append(helper.make_tensor_value_info("hi_in", TensorProto.FLOAT, []))
    g = helper.make_graph(nodes, "clip", graph_inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8, 6, 6])],
                          [w, *inits])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])


@pytest.mark.parametrize(("opset", "lo", "hi"), [(13, 0.0, 6.0), (13, None, 1.5), (13, -1.0, float("nan")), (6, 0.0, 6.0)])
def test_clip_with_constant_bounds_becomes_selects(opset: int, lo, hi, tmp_path: Path) -> None:
    """Clip with constant bounds becomes Less/Greater + Where (TVM's Clip was a call_tir that
    ConvertLayout wrapped in transposes); same values as ONNX Runtime, NaN inputs stay NaN."""
    m = onnx.shape_inference.infer_shapes(_clip_model(opset, lo, hi))
    ops = [n.op_type for n in prepare_for_import(m).graph.node]
    assert "Clip" not in ops and "Where" in ops
    x = (np.random.default_rng(3).standard_normal((1, 4, 6, 6)) * 3).astype(np.float32)
    x[0, 0, 2, 2] = np.nan
    want = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(["y"], {"x": x})[0]
    bt.build(m, tmp_path / "rank0.so")
    got = bt.load(m, tmp_path / "rank0.so").run({"x": x}, LocalWorld(1).communicator(0))["y"]
    assert np.array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)


def test_clip_with_a_runtime_bound_is_left_alone() -> None:
    m = onnx.shape_inference.infer_shapes(_clip_model(13, 0.0, 6.0, runtime_bound=True))
    assert "Clip" in [n.op_type for n in prepare_for_import(m).graph.node]
