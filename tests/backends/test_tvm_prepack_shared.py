"""A constant weight read by many MatMuls (an unrolled LSTM's ``R``, one per time step) is packed
once: the scheduled pipeline's prepacking (``backends.tvm.schedules.gemm_packed.prepack_passes``)
must not fold one packed copy per call site (a library ``T`` times larger, and every step reading a
cold copy). Checked on the Relax module after the pipeline, and the outputs against ONNX Runtime."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper


def _chain(steps: int = 4, width: int = 64) -> onnx.ModelProto:
    """``h = tanh(h @ R + x)`` unrolled ``steps`` times with one ``R``."""
    r = (np.random.default_rng(0).standard_normal((width, width)) / np.sqrt(width)).astype(np.float32)
    nodes, h = [], "x"
    for t in range(steps):
        nodes += [helper.make_node("MatMul", [h, "R"], [f"m{t}"]), helper.make_node("Add", [f"m{t}", "x"], [f"a{t}"]),
                  helper.make_node("Tanh", [f"a{t}"], [f"h{t}"])]
        h = f"h{t}"
    g = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, width])],
                          [helper.make_tensor_value_info(h, TensorProto.FLOAT, [1, width])],
                          [numpy_helper.from_array(r, "R")])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])


def test_one_packed_copy_of_a_shared_weight():
    import tvm

    from backends.tvm.lower import lower_program
    from backends.tvm.pipeline import run_pipeline
    from backends.tvm.target import target_dict

    mod = run_pipeline(lower_program(_chain()).mod, "scheduled", tvm.target.Target(target_dict(None)))
    consts: list[object] = []

    def visit(expr: object) -> None:
        if isinstance(expr, tvm.ir.expr.GenericConst) and len(expr.value.shape) >= 2:
            consts.append(expr)

    for _, func in mod.functions.items():
        if isinstance(func, tvm.relax.Function):
            tvm.relax.analysis.post_order_visit(func.body, visit)
    distinct: list[object] = []
    for c in consts:  # the same Constant node at every call site when the packing was merged
        if not any(c.same_as(d) for d in distinct):
            distinct.append(c)
    assert len(consts) >= 3, "the MatMuls should read a (packed) constant weight"
    assert len(distinct) == 1, f"{len(distinct)} packed copies of one weight for {len(consts)} MatMuls"


def test_shared_weight_chain_matches_ort(tmp_path):
    from partitioner.compiler import compile as compile_artifact, load_artifact
    from partitioner.runtime.launch import run_in_process

    m = _chain()
    x = np.random.default_rng(1).standard_normal((1, 64)).astype(np.float32)
    want = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    art = compile_artifact(m, "cpu:1", backend="tvm", out_dir=tmp_path / "art", jobs=1, progress=False)
    got, _ = run_in_process(load_artifact(art.root), {"x": x}, timeout=300)
    np.testing.assert_allclose(got[m.graph.output[0].name], want, rtol=1e-5, atol=1e-6)
