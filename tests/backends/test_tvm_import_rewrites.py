"""``backends.tvm.lower.rewrite_for_import``: Sum/Mean become Add chains and inference Dropout
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

pytest.importorskip("tvm")

import backends.tvm as bt  # noqa: E402
from backends.tvm.lower import rewrite_for_import  # noqa: E402
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
    out = rewrite_for_import(_conv_sum_model())
    ops = [n.op_type for n in out.graph.node]
    assert "Sum" not in ops and "Mean" not in ops and "Dropout" not in ops
    assert ops.count("Add") == 3 and ops.count("Div") == 1 and ops.count("Identity") == 1
    onnx.checker.check_model(out, full_check=True)


def test_rewritten_model_matches_ort_through_the_scheduled_pipeline(tmp_path: Path) -> None:
    m = _conv_sum_model()
    x = np.random.default_rng(1).standard_normal((2, 4, 8, 8)).astype(np.float32)
    sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    want = sess.run(["y"], {"x": x})[0]
    for expr in (rewrite_for_import(m),):  # the rewrite alone is exact up to float rounding
        got_ref = ort.InferenceSession(expr.SerializeToString(), providers=["CPUExecutionProvider"]).run(["y"], {"x": x})[0]
        np.testing.assert_allclose(got_ref, want, rtol=RTOL, atol=ATOL)
    bt.build(m, tmp_path / "rank0.so")  # default (scheduled, NHWC) pipeline: failed before the rewrite
    got = bt.load(m, tmp_path / "rank0.so").run({"x": x}, LocalWorld(1).communicator(0))["y"]
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)


def test_dropout_with_a_read_mask_is_kept() -> None:
    m = _conv_sum_model()
    m.graph.output.append(helper.make_tensor_value_info("mask", TensorProto.BOOL, [2, 8, 8, 8]))
    ops = [n.op_type for n in rewrite_for_import(m).graph.node]
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
    assert [n.op_type for n in rewrite_for_import(onnx.shape_inference.infer_shapes(m)).graph.node] == ["Constant", "Add"]
    bt.build(m, tmp_path / "rank0.so")
    got = bt.load(m, tmp_path / "rank0.so").run(feeds, LocalWorld(1).communicator(0))["y"]
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)
