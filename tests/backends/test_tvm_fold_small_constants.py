"""``backends.tvm.fold_small_constants``: the constant index arithmetic TVM's ONNX importer writes
for a ``Gather`` with a constant index (``shape_to_tensor``/``take``/``less``/``add``/``where``)
is folded with numpy before ``FoldConstant``, which compiles every call it folds with LLVM. The
build's outputs still match ONNX Runtime (negative indices included)."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from backends.tvm.fold_small_constants import fold_small_constants_pass
from backends.tvm.lower import lower_program

ARITH = ("R.where(", "R.less(", "R.shape_to_tensor(", "R.add(")


def _model() -> onnx.ModelProto:
    """``y_k = Relu(Gather(x, idx_k))`` for a scalar index, a negative one and a vector of both."""
    idx = {"i0": np.array(1, np.int64), "i1": np.array(-1, np.int64), "i2": np.array([0, -2], np.int64)}
    nodes = [n for k, name in enumerate(idx) for n in (
        helper.make_node("Gather", ["x", name], [f"g{k}"], axis=0), helper.make_node("Relu", [f"g{k}"], [f"y{k}"]))]
    outs = [helper.make_tensor_value_info("y0", TensorProto.FLOAT, [3]),
            helper.make_tensor_value_info("y1", TensorProto.FLOAT, [3]),
            helper.make_tensor_value_info("y2", TensorProto.FLOAT, [2, 3])]
    g = helper.make_graph(nodes, "gathers", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 3])], outs,
                          [numpy_helper.from_array(v, k) for k, v in idx.items()])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])


def test_gather_index_arithmetic_is_folded():
    mod = lower_program(_model()).mod
    before = mod.script()
    assert any(op in before for op in ARITH), "the importer no longer writes index arithmetic: revisit this pass"
    after = fold_small_constants_pass()(mod).script()
    assert not any(op in after for op in ARITH), after


def test_folded_build_matches_ort(tmp_path):
    from partitioner.compiler import compile as compile_artifact, load_artifact
    from partitioner.runtime.launch import run_in_process

    m = _model()
    x = np.random.default_rng(0).standard_normal((4, 3)).astype(np.float32)
    art = compile_artifact(m, "cpu:1", backend="tvm", out_dir=tmp_path / "art", jobs=1, progress=False)
    got, _ = run_in_process(load_artifact(art.root), {"x": x}, timeout=300)
    want = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    for k, w in enumerate(want):
        np.testing.assert_array_equal(got[f"y{k}"], w)
