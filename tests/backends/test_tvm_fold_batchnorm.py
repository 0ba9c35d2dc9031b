"""Batch norm folding on the Relax module (backends/tvm/fold_batchnorm.py) keeps numerics.

Cases: a conv -> BN (rule 2: the scale goes into the weights), a grouped conv -> BN, and a BN
that follows an Add (rule 1 only: one multiply-add, no conv to fold into). Each is compiled
through the ``scheduled`` pipeline and compared with ONNX Runtime (rtol 1e-4, atol 1e-5) with
random, non-trivial batch-norm statistics; the structure check is that no kernel divides
(the unfolded form divides by sqrt(var + eps) per element) and, for rule 2, that no kernel
multiplies after the conv either.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import tvm
from onnx import TensorProto, helper, numpy_helper
from tvm import relax

from backends.tvm.lower import lower_program
from backends.tvm.pipeline import run_pipeline
from backends.tvm.target import detect_host_target


def _model(kind: str) -> onnx.ModelProto:
    rng = np.random.default_rng(7)
    f32 = np.float32
    c = 24
    inits = [numpy_helper.from_array(rng.uniform(0.5, 2.0, c).astype(f32), "scale"),
             numpy_helper.from_array((rng.standard_normal(c) * 0.5).astype(f32), "shift"),
             numpy_helper.from_array((rng.standard_normal(c) * 0.5).astype(f32), "mean"),
             numpy_helper.from_array(rng.uniform(0.2, 3.0, c).astype(f32), "var")]
    if kind == "add":
        inits.append(numpy_helper.from_array(rng.standard_normal((1, c, 1, 1)).astype(f32), "w"))
        first = helper.make_node("Add", ["x", "w"], ["t"])
    else:
        group = 3 if kind == "grouped" else 1
        inits.append(numpy_helper.from_array((rng.standard_normal((c, 12 // group, 3, 3)) * 0.3).astype(f32), "w"))
        inits.append(numpy_helper.from_array((rng.standard_normal(c) * 0.1).astype(f32), "b"))
        first = helper.make_node("Conv", ["x", "w", "b"], ["t"], kernel_shape=[3, 3], pads=[1, 1, 1, 1], group=group)
    cin = c if kind == "add" else 12
    nodes = [first, helper.make_node("BatchNormalization", ["t", "scale", "shift", "mean", "var"], ["y"], epsilon=1e-3)]
    g = helper.make_graph(nodes, "bn", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, cin, 10, 10])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], initializer=inits)
    return onnx.shape_inference.infer_shapes(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]))


@pytest.mark.parametrize("kind", ["conv", "grouped", "add"])
def test_folded_batchnorm_matches_ort(kind: str) -> None:
    m = _model(kind)
    x = np.random.default_rng(0).standard_normal([d.dim_value for d in m.graph.input[0].type.tensor_type.shape.dim])
    x = x.astype(np.float32)
    ref = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    target = tvm.target.Target(detect_host_target())
    mod = run_pipeline(lower_program(m).mod, "scheduled", target)
    names = [gv.name_hint for gv, f in mod.functions_items() if isinstance(f, tvm.tirx.PrimFunc)]
    assert not any("divide" in n for n in names), names
    if kind != "add":
        assert not any("conv2d" in n and "multiply" in n for n in names), names
    vm = relax.VirtualMachine(tvm.compile(mod, target), tvm.cpu())
    res = vm["main"](tvm.runtime.tensor(x))
    got = res.numpy() if isinstance(res, tvm.runtime.Tensor) else res[0].numpy()
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-5)
