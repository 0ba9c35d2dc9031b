"""backends.tvm.import_pipeline.prepare_for_import: variadic Max/Min become two-input selects that keep
ONNX semantics (broadcasting, NaN propagates). Checked against ONNX Runtime on the original node
with seeded inputs holding NaNs (exact equality, NaN positions equal)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from backends.tvm.import_pipeline import prepare_for_import


def _ort(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> np.ndarray:
    import onnxruntime as ort

    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]


@pytest.mark.parametrize("op", ["Max", "Min"])
@pytest.mark.parametrize("dtype", [np.float32, np.int32])
def test_max_min_chain_matches_onnxruntime(op: str, dtype) -> None:
    et = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    ins = [helper.make_tensor_value_info("a", et, [3, 4]), helper.make_tensor_value_info("b", et, [4]),
           helper.make_tensor_value_info("c", et, [3, 1])]
    out = helper.make_tensor_value_info("y", et, [3, 4])
    m = helper.make_model(helper.make_graph([helper.make_node(op, ["a", "b", "c"], ["y"], name="m")], "g", ins, [out]),
                          opset_imports=[helper.make_opsetid("", 13)])
    r = prepare_for_import(onnx.shape_inference.infer_shapes(m))
    assert op not in {n.op_type for n in r.graph.node}
    rng = np.random.default_rng(3)
    feeds = {"a": (rng.standard_normal((3, 4)) * 5).astype(dtype), "b": (rng.standard_normal(4) * 5).astype(dtype),
             "c": (rng.standard_normal((3, 1)) * 5).astype(dtype)}
    if dtype == np.float32:
        feeds["a"][0, 1] = np.nan
        feeds["b"][2] = np.nan
    np.testing.assert_array_equal(_ort(r, feeds), _ort(m, feeds))


def test_single_input_max_is_identity() -> None:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])
    m = helper.make_model(helper.make_graph([helper.make_node("Max", ["x"], ["y"])], "g", [x],
                                            [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])]),
                          opset_imports=[helper.make_opsetid("", 13)])
    assert [n.op_type for n in prepare_for_import(m).graph.node] == ["Identity"]
