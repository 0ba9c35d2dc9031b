"""``backends.tvm.resize_inputs.DropEmptyResizeInputs`` (an onnx-ir pass): Paddle2ONNX's ``Resize(x, roi=[], scales=[], sizes)`` builds with
TVM (its converter asserted that only one of scales and sizes may be given) and matches ONNX
Runtime exactly (nearest, asymmetric, floor: a gather)."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper


def _model() -> onnx.ModelProto:
    inits = [numpy_helper.from_array(np.zeros((0,), np.float32), "roi"),
             numpy_helper.from_array(np.zeros((0,), np.float32), "scales"),
             numpy_helper.from_array(np.array([1, 2, 6, 8], np.int64), "sizes")]
    nodes = [helper.make_node("Resize", ["x", "roi", "scales", "sizes"], ["r"], mode="nearest",
                              coordinate_transformation_mode="asymmetric", nearest_mode="floor"),
             helper.make_node("Relu", ["r"], ["y"])]
    g = helper.make_graph(nodes, "resize", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2, 3, 4])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2, 6, 8])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])


def test_rewrite_drops_the_empty_inputs_only():
    from backends.tvm.resize_inputs import DropEmptyResizeInputs

    model = ir.serde.deserialize_model(_model())
    assert DropEmptyResizeInputs()(model).modified
    out = ir.serde.serialize_model(model)
    assert list(out.graph.node[0].input) == ["x", "", "", "sizes"]
    assert list(out.graph.node[1].input) == ["r"]
    assert not DropEmptyResizeInputs()(ir.serde.deserialize_model(out)).modified


def test_paddle_style_resize_builds_with_tvm_and_matches_ort(tmp_path):
    from partitioner.compiler import compile as compile_artifact, load_artifact
    from partitioner.runtime.launch import run_in_process

    m = _model()
    x = np.random.default_rng(0).standard_normal((1, 2, 3, 4)).astype(np.float32)
    want = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    art = compile_artifact(m, "cpu:1", backend="tvm", out_dir=tmp_path / "art", jobs=1, progress=False)
    got, _ = run_in_process(load_artifact(art.root), {"x": x}, timeout=300)
    np.testing.assert_array_equal(got["y"], want)
