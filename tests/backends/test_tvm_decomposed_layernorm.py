"""A layer normalisation spelled out by an exporter older than opset 17 as one
``LayerNormalization`` (``backends/tvm/import_fixes.py`` rule 8, ``DecomposedLayerNorm``).

The models have the structure of openwakeword's hey_jarvis head (PyTorch 1.12, opset 13):
``Gemm -> ReduceMean, Sub, Pow, ReduceMean, Add(eps), Sqrt, Div, Mul(gamma), Add(beta) -> Relu``,
the same without the affine ``Mul``/``Add`` over the two trailing axes, and the first inside an
``If`` branch on a computed condition (hey_jarvis's verifier head). Every build matches
ONNX Runtime on the model as given (rtol 1e-4, atol 1e-5, seeded random weights and input). With
the rule the build has one ``layer_norm`` kernel (the ``Relu`` fused into it) and no separate
``power`` or ``mean`` kernel; with the knob off the decomposition stays several kernels.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from backends.tvm import import_fixes
from tvm_build_check import build_and_compare


def _model(affine: bool, axes: list[int], shape: list[int], opset: int) -> onnx.ModelProto:
    rng = np.random.default_rng(5)
    n, k = shape[0], int(np.prod(shape[1:]))
    w = rng.standard_normal((k, 24)).astype(np.float32)
    b = rng.standard_normal(24).astype(np.float32)
    inits = [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b"),
             numpy_helper.from_array(np.array(2.0, np.float32), "two"),
             numpy_helper.from_array(np.array(1e-5, np.float32), "eps")]
    nodes = [helper.make_node("Flatten", ["x"], ["f"]), helper.make_node("Gemm", ["f", "w", "b"], ["g0"])]
    x = "g0"
    if len(axes) == 2:  # normalise [4, 6] of a [n, 4, 6] view
        inits.append(numpy_helper.from_array(np.array([n, 4, 6], np.int64), "shape3"))
        nodes.append(helper.make_node("Reshape", ["g0", "shape3"], ["g"]))
        x = "g"
    nodes += [helper.make_node("ReduceMean", [x], ["m"], axes=axes),
              helper.make_node("Sub", [x, "m"], ["d"]),
              helper.make_node("Pow", ["d", "two"], ["p"]),
              helper.make_node("ReduceMean", ["p"], ["v"], axes=axes),
              helper.make_node("Add", ["v", "eps"], ["ve"]),
              helper.make_node("Sqrt", ["ve"], ["s"]),
              helper.make_node("Div", ["d", "s"], ["nrm"])]
    last = "nrm"
    if affine:
        inits += [numpy_helper.from_array(rng.standard_normal(24).astype(np.float32), "gamma"),
                  numpy_helper.from_array(rng.standard_normal(24).astype(np.float32), "beta")]
        nodes += [helper.make_node("Mul", ["nrm", "gamma"], ["sc"]), helper.make_node("Add", ["sc", "beta"], ["sh"])]
        last = "sh"
    nodes.append(helper.make_node("Relu", [last], ["y"]))
    g = helper.make_graph(nodes, "ln", [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    return onnx.shape_inference.infer_shapes(helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)]))


def _kernels(m: onnx.ModelProto) -> list[str]:
    """Build and compare with ORT; the names of the build's kernels (PrimFuncs)."""
    return [gv.name_hint for gv in build_and_compare(m).get_global_vars()]


@pytest.mark.parametrize("affine,axes,shape,opset", [
    (True, [-1], [1, 34, 3], 13),     # hey_jarvis's form: Gemm -> LN over [1, 24] -> Relu
    (False, [1, 2], [2, 5, 4], 13),   # no gamma/beta, two trailing axes
    (True, [-1], [3, 2, 8], 11),
], ids=["affine-opset13", "plain-2axes", "affine-opset11"])
def test_spelled_out_layernorm_is_one_kernel(affine: bool, axes: list[int], shape: list[int], opset: int,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    m = _model(affine, axes, shape, opset)
    kernels = _kernels(m)
    assert any("layer_norm" in k for k in kernels), kernels
    assert not any("power" in k or "mean" in k for k in kernels), kernels
    monkeypatch.setattr(import_fixes, "DECOMPOSED_LAYERNORM_AS_ONE", False)
    off = _kernels(m)
    assert not any("layer_norm" in k for k in off) and any("mean" in k for k in off), off


def _if_model() -> onnx.ModelProto:
    """hey_jarvis's verifier form: the LayerNorm inside an ``If`` branch on a computed condition
    (true for the seeded input: the branch with the LayerNorm is the one compared)."""
    flat = _model(True, [-1], [1, 34, 3], 13)
    out = [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 24])]
    body = helper.make_graph(list(flat.graph.node), "then", [], out, list(flat.graph.initializer))
    zeros = numpy_helper.from_array(np.zeros((1, 24), np.float32))
    other = helper.make_graph([helper.make_node("Constant", [], ["z"], value=zeros)], "else", [],
                              [helper.make_tensor_value_info("z", TensorProto.FLOAT, [1, 24])])
    nodes = [helper.make_node("ReduceMax", ["x"], ["mx"], keepdims=0),
             helper.make_node("Greater", ["mx", "lo"], ["cond"]),
             helper.make_node("If", ["cond"], ["out"], then_branch=body, else_branch=other)]
    g = helper.make_graph(nodes, "ln_if", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 34, 3])],
                          [helper.make_tensor_value_info("out", TensorProto.FLOAT, [1, 24])],
                          [numpy_helper.from_array(np.array(-100.0, np.float32), "lo")])
    return onnx.shape_inference.infer_shapes(helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)]))


def test_spelled_out_layernorm_in_an_if_branch(monkeypatch: pytest.MonkeyPatch) -> None:
    m = _if_model()
    kernels = _kernels(m)
    assert any("layer_norm" in k for k in kernels) and not any("power" in k for k in kernels), kernels
    monkeypatch.setattr(import_fixes, "DECOMPOSED_LAYERNORM_AS_ONE", False)
    assert not any("layer_norm" in k for k in _kernels(m))
