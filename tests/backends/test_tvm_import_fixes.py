"""``backends.tvm.import_fixes``: OneHot as Equal + Where, so TVM takes a rank-1 ``depth`` (tf2onnx,
magika) and keeps float32 ``values`` float32. Checked structurally, through ONNX Runtime on the
rewritten graph, and through TVM end to end (rtol 1e-6: the result is exact selects)."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from backends.tvm.import_fixes import rewrite_one_hot


def _one_hot_model() -> onnx.ModelProto:
    inits = [numpy_helper.from_array(np.array([5], np.int64), "depth"),
             numpy_helper.from_array(np.array([-0.5, 2.0], np.float32), "values"),
             numpy_helper.from_array(np.ones((5, 3), np.float32), "w")]
    nodes = [helper.make_node("OneHot", ["idx", "depth", "values"], ["oh"], name="onehot"),
             helper.make_node("MatMul", ["oh", "w"], ["y"])]
    g = helper.make_graph(nodes, "onehot", [helper.make_tensor_value_info("idx", TensorProto.INT64, [2, 4])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4, 3])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])


def _feeds() -> dict[str, np.ndarray]:
    return {"idx": np.array([[0, 1, 4, -1], [-5, 2, 3, 2]], np.int64)}


def _ort(m: onnx.ModelProto) -> np.ndarray:
    return ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, _feeds())[0]


def test_one_hot_becomes_equal_and_where_with_the_same_values():
    m = _one_hot_model()
    out = rewrite_one_hot(m)
    assert "OneHot" not in [n.op_type for n in out.graph.node]
    onnx.checker.check_model(out, full_check=True)
    np.testing.assert_array_equal(_ort(out), _ort(m))


def test_one_hot_model_runs_through_tvm(tmp_path):
    from partitioner.compiler import compile as compile_artifact, load_artifact
    from partitioner.runtime.launch import run_in_process

    m = _one_hot_model()
    art = compile_artifact(m, "cpu:1", backend="tvm", out_dir=tmp_path / "art", jobs=1, progress=False)
    got, _ = run_in_process(load_artifact(art.root), _feeds(), timeout=300)
    assert got["y"].dtype == np.float32
    np.testing.assert_allclose(got["y"], _ort(m), rtol=1e-6, atol=1e-6)
