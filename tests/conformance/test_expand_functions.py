"""backends.tvm.expand_functions.ExpandForImport (an onnx-ir pass): ops TVM lacks become their ONNX
function bodies; others stay.

Numbers are checked against ONNX Runtime running the *original* (unexpanded) model with seeded
inputs (rtol 1e-5, atol 1e-6).
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper

from backends.tvm.expand_functions import LOCAL_DOMAIN, ExpandForImport, fold_expanded


def expand_nodes(m: onnx.ModelProto, wanted: Iterable[str] | None = None) -> tuple[onnx.ModelProto, tuple[str, ...]]:
    """The pass on ``m``'s onnx-ir form; ``m`` itself back when the pass reports no change."""
    model = ir.serde.deserialize_model(m)
    expand = ExpandForImport(wanted)
    if not expand(model).modified:
        return m, expand.expanded
    return ir.serde.serialize_model(model), expand.expanded


def _model(nodes, inputs, outputs, opset: int = 23) -> onnx.ModelProto:
    g = helper.make_graph(nodes, "g", inputs, outputs)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])


def _ort(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    import onnxruntime as ort

    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


def test_celu_is_expanded_and_matches_onnxruntime() -> None:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 4])
    m = _model([helper.make_node("Relu", ["x"], ["r"]), helper.make_node("Celu", ["r"], ["c"], alpha=0.5),
                helper.make_node("Neg", ["c"], ["y"])], [x], [y])
    out, ops = expand_nodes(m, wanted={"Relu", "Neg", "Elu", "Div", "Mul", "Constant", "Cast"})
    assert ops == ("Celu",)
    types = [n.op_type for n in out.graph.node]
    assert "Celu" not in types and types[0] == "Relu" and types[-1] == "Neg"
    assert not out.functions and all(o.domain != LOCAL_DOMAIN for o in out.opset_import)
    onnx.checker.check_model(out, full_check=True)
    feeds = {"x": np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32) - 0.5}
    # Relu then Neg keeps negatives out of Celu; use an input straight into Celu too
    np.testing.assert_allclose(_ort(out, feeds)[0], _ort(m, feeds)[0], rtol=1e-5, atol=1e-6)


def test_default_attribute_is_used_when_the_node_omits_it() -> None:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 5])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 5])
    m = _model([helper.make_node("Celu", ["x"], ["y"])], [x], [y])  # alpha defaults to 1.0
    out, ops = expand_nodes(m, wanted=set())  # nothing known: bodies of bodies expand too (Elu, ...)
    assert ops[0] == "Celu" and "Celu" not in {n.op_type for n in out.graph.node}
    feeds = {"x": np.linspace(-3, 3, 10, dtype=np.float32).reshape(2, 5)}
    expected = np.where(feeds["x"] > 0, feeds["x"], np.expm1(feeds["x"]))  # CELU with alpha 1 (hand formula)
    np.testing.assert_allclose(_ort(out, feeds)[0], expected, rtol=1e-5, atol=1e-6)


def test_known_ops_and_ops_without_body_are_left_alone() -> None:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])
    m = _model([helper.make_node("LpNormalization", ["x"], ["y"], axis=-1)], [x], [y])
    out, ops = expand_nodes(m, wanted=set())
    assert ops == () and out is m
    m2 = _model([helper.make_node("Celu", ["x"], ["y"])], [x], [y])
    out2, ops2 = expand_nodes(m2, wanted={"Celu"})
    assert ops2 == () and out2 is m2


def test_attention_is_expanded_context_dependently() -> None:
    shape = [1, 2, 4, 8]
    q, k, v = (helper.make_tensor_value_info(n, TensorProto.FLOAT, shape) for n in "qkv")
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, shape)
    m = _model([helper.make_node("Attention", ["q", "k", "v"], ["y"])], [q, k, v], [y])
    out, ops = expand_nodes(m)
    assert ops == ("Attention",)
    assert "Attention" not in {n.op_type for n in out.graph.node}
    rng = np.random.default_rng(1)
    feeds = {n: rng.standard_normal(shape).astype(np.float32) for n in "qkv"}
    np.testing.assert_allclose(_ort(out, feeds)[0], _ort(m, feeds)[0], rtol=1e-5, atol=1e-6)



def test_attention_with_omitted_middle_outputs_is_expanded() -> None:
    # outputs Y, '', '', qk_matmul_output: the body declares present_key/value but never
    # computes them when the node omits them
    shape = [1, 2, 4, 8]
    q, k, v = (helper.make_tensor_value_info(n, TensorProto.FLOAT, shape) for n in "qkv")
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, shape)
    qk = helper.make_tensor_value_info("qk", TensorProto.FLOAT, [1, 2, 4, 4])
    m = _model([helper.make_node("Attention", ["q", "k", "v"], ["y", "", "", "qk"])], [q, k, v], [y, qk])
    out, ops = expand_nodes(m)
    assert ops == ("Attention",) and "Attention" not in {n.op_type for n in out.graph.node}
    rng = np.random.default_rng(2)
    feeds = {n: rng.standard_normal(shape).astype(np.float32) for n in "qkv"}
    for got, want in zip(_ort(out, feeds), _ort(m, feeds)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)

def test_fold_expanded_replaces_shape_but_not_a_graph_output() -> None:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [6, 4])
    s = helper.make_tensor_value_info("s", TensorProto.INT64, [3])
    nodes = [helper.make_node("Shape", ["x"], ["sh"], start=1), helper.make_node("ReduceProd", ["sh"], ["p"], keepdims=1),
             helper.make_node("Shape", ["x"], ["s"]),
             helper.make_node("Reshape", ["x", "t"], ["y"])]
    m = _model(nodes, [x], [y, s])
    m.graph.initializer.append(onnx.numpy_helper.from_array(np.array([6, 4], np.int64), "t"))
    m = onnx.shape_inference.infer_shapes(m)
    model = ir.serde.deserialize_model(m)
    assert fold_expanded(model)
    out = ir.serde.serialize_model(model)
    folded = {t.name: onnx.numpy_helper.to_array(t) for t in out.graph.initializer}
    types = [n.op_type for n in out.graph.node]
    assert "ReduceProd" not in types and "sh" not in {i for n in out.graph.node for i in n.input}
    assert "s" not in folded and types.count("Shape") == 1  # the graph output stays a node's
    feeds = {"x": np.zeros((2, 3, 4), np.float32)}
    assert _ort(out, feeds)[1].tolist() == [2, 3, 4]


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn"])
def test_executable_outputs_of_dtypes_numpy_dlpack_lacks(dtype: str) -> None:
    import ml_dtypes
    import tvm

    from backends.tvm.executable import _output_array

    want = np.array([1.5, -2.0, 0.25], dtype=getattr(ml_dtypes, dtype))
    got = _output_array(tvm.runtime.tensor(want))
    assert got.dtype == want.dtype and got.astype(np.float32).tolist() == [1.5, -2.0, 0.25]
    shape = _output_array(tvm.runtime.ShapeTuple([2, 3]))
    assert shape.dtype == np.int64 and shape.tolist() == [2, 3]
