"""``passes/unroll_loop.py``: a ``Loop`` whose trip count constants fix is unrolled; one that stops
on data stays. Each unrolled graph is compared with ONNX Runtime on the original model (seeded
inputs, rtol/atol 1e-6: the same float ops in the same order)."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto as T
from onnx import helper as h
from onnx import numpy_helper as nh

from partitioner.core.errors import PassError
from partitioner.load import load
from passes import run_pipeline
from passes.unroll_loop import unroll_loops_proto


def _i64(v, name):
    return nh.from_array(np.array(v, np.int64), name)


def _counter_loop(limit: int = 5, stop_on_data: bool = False, scan: bool = True) -> onnx.ModelProto:
    """Paddle2ONNX's decoder loop in miniature: ``M = 1024``; carried (i, limit, acc); the body
    computes ``acc' = tanh(acc @ w + x) `` (``x`` read from the outer scope), ``i' = i + 1``,
    ``cond' = i' < limit`` (or, with ``stop_on_data``, ``cond' = sum(acc') < 2``); scan output acc'."""
    body_nodes = [
        h.make_node("MatMul", ["acc_in", "w"], ["mm"]), h.make_node("Add", ["mm", "x"], ["pre"]),
        h.make_node("Tanh", ["pre"], ["acc_out"]),
        h.make_node("Add", ["i_in", "one"], ["i_out"]), h.make_node("Identity", ["lim_in"], ["lim_out"]),
    ]
    if stop_on_data:
        body_nodes += [h.make_node("ReduceSum", ["acc_out"], ["s"], keepdims=0),
                       h.make_node("Less", ["s", "two"], ["cond_out"])]
    else:
        body_nodes += [h.make_node("Less", ["i_out", "lim_in"], ["cond_out"])]
    outs = [h.make_tensor_value_info("cond_out", T.BOOL, []), h.make_tensor_value_info("i_out", T.INT64, []),
            h.make_tensor_value_info("lim_out", T.INT64, []), h.make_tensor_value_info("acc_out", T.FLOAT, [2, 3])]
    if scan:
        body_nodes.append(h.make_node("Identity", ["acc_out"], ["row"]))
        outs.append(h.make_tensor_value_info("row", T.FLOAT, [2, 3]))
    body = h.make_graph(
        body_nodes, "body",
        [h.make_tensor_value_info("iter", T.INT64, []), h.make_tensor_value_info("cond_in", T.BOOL, []),
         h.make_tensor_value_info("i_in", T.INT64, []), h.make_tensor_value_info("lim_in", T.INT64, []),
         h.make_tensor_value_info("acc_in", T.FLOAT, [2, 3])],
        outs, [_i64(1, "one"), nh.from_array(np.array(2.0, np.float32), "two")])
    loop_outs = ["i_f", "lim_f", "acc_f"] + (["rows"] if scan else [])
    nodes = [h.make_node("Less", ["i0", "lim0"], ["c0"]),
             h.make_node("Loop", ["M", "c0", "i0", "lim0", "acc0"], loop_outs, name="decoder_loop", body=body),
             h.make_node("Relu", ["acc_f"], ["y"])]
    outputs = [h.make_tensor_value_info("y", T.FLOAT, [2, 3])]
    if scan:
        nodes.append(h.make_node("Relu", ["rows"], ["y_rows"]))
        outputs.append(h.make_tensor_value_info("y_rows", T.FLOAT, ["n", 2, 3]))
    rng = np.random.default_rng(0)
    inits = [_i64(1024, "M"), _i64(0, "i0"), _i64(limit, "lim0"),
             nh.from_array(np.zeros((2, 3), np.float32), "acc0"),
             nh.from_array(rng.standard_normal((3, 3)).astype(np.float32), "w")]
    g = h.make_graph(nodes, "loop", [h.make_tensor_value_info("x", T.FLOAT, [2, 3])], outputs, inits)
    m = h.make_model(g, opset_imports=[h.make_opsetid("", 17)])
    m.ir_version = 8
    return m


def _ort(m: onnx.ModelProto, feeds: dict) -> list[np.ndarray]:
    return ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)


@pytest.mark.parametrize("limit,scan", [(5, True), (1, True), (4, False), (40, True)])  # 40 rows: a Concat tree (rule 6)
def test_counter_loop_is_unrolled_and_matches_ort(limit, scan):
    m = _counter_loop(limit, scan=scan)
    prepared = run_pipeline(load(m))
    assert "Loop" not in [n.op_type for n in prepared.graph]
    x = np.random.default_rng(1).standard_normal((2, 3)).astype(np.float32)
    want = _ort(m, {"x": x})
    got = _ort(ir.serde.serialize_model(prepared), {"x": x})
    for g, w in zip(got, want):
        assert g.shape == w.shape
        np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6)
    if scan:
        assert want[1].shape == (limit, 2, 3)
    if limit > 16:
        assert max(len(n.inputs) for n in prepared.graph if n.op_type == "Concat") <= 16


def test_loop_that_stops_on_data_is_left_and_refused_by_name():
    m = _counter_loop(stop_on_data=True)
    out, done = unroll_loops_proto(onnx.load_from_string(m.SerializeToString()))
    assert done == 0 and "Loop" in [n.op_type for n in out.graph.node]
    with pytest.raises(PassError, match="decoder_loop"):
        run_pipeline(load(m))


def test_trip_count_above_the_cap_is_left():
    m = _counter_loop(50)
    del m.graph.node[0]  # the initial condition as a constant (constant folding does this in the pipeline)
    m.graph.initializer.append(nh.from_array(np.array(True), "c0"))
    out, done = unroll_loops_proto(m, max_steps=10)
    assert done == 0
    out, done = unroll_loops_proto(m, max_steps=64)
    assert done == 1 and sum(n.op_type == "Tanh" for n in out.graph.node) == 50


def test_counter_loop_compiles_for_tvm_and_matches_ort(tmp_path):
    """TVM's importer has no Loop: after unrolling, the model builds and runs with TVM alone."""
    from partitioner.compiler import compile as compile_artifact, load_artifact

    m = _counter_loop(3)
    art = compile_artifact(m, "cpu:1", backend="tvm", out_dir=tmp_path / "art", jobs=1, progress=False)
    x = np.random.default_rng(5).standard_normal((2, 3)).astype(np.float32)
    res = load_artifact(art.root).run({"x": x}, check=True, in_process=True, timeout=300)
    want = _ort(m, {"x": x})
    np.testing.assert_allclose(res.outputs["y"], want[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(res.outputs["y_rows"], want[1], rtol=1e-5, atol=1e-6)
    assert res.check.ok


def _invariant_loop(steps: int) -> onnx.ModelProto:
    """A counter ``Loop`` of ``steps`` steps whose body carries a weight ``w`` through unchanged (as
    Paddle2ONNX carries decoder weights) and uses ``Transpose(w)`` and a ``Constant``: both
    loop-invariant; ``acc' = tanh(acc @ Transpose(w) * c)``."""
    body = h.make_graph(
        [h.make_node("Transpose", ["w_in"], ["wt"], perm=[1, 0]),
         h.make_node("Constant", [], ["c"], value=nh.from_array(np.array(0.9, np.float32))),
         h.make_node("MatMul", ["acc_in", "wt"], ["mm"]), h.make_node("Mul", ["mm", "c"], ["pre"]),
         h.make_node("Tanh", ["pre"], ["acc_out"]),
         h.make_node("Add", ["i_in", "one"], ["i_out"]), h.make_node("Less", ["i_out", "lim"], ["cond_out"])],
        "body",
        [h.make_tensor_value_info("iter", T.INT64, []), h.make_tensor_value_info("cond_in", T.BOOL, []),
         h.make_tensor_value_info("i_in", T.INT64, []), h.make_tensor_value_info("w_in", T.FLOAT, [3, 3]),
         h.make_tensor_value_info("acc_in", T.FLOAT, [2, 3])],
        [h.make_tensor_value_info("cond_out", T.BOOL, []), h.make_tensor_value_info("i_out", T.INT64, []),
         h.make_tensor_value_info("w_in", T.FLOAT, [3, 3]), h.make_tensor_value_info("acc_out", T.FLOAT, [2, 3])],
        [_i64(1, "one")])
    rng = np.random.default_rng(2)
    g = h.make_graph(
        [h.make_node("Loop", ["M", "", "i0", "w", "x"], ["i_f", "w_f", "acc_f"], name="decoder_loop", body=body),
         h.make_node("Relu", ["acc_f"], ["y"])],
        "g", [h.make_tensor_value_info("x", T.FLOAT, [2, 3])], [h.make_tensor_value_info("y", T.FLOAT, [2, 3])],
        [_i64(1024, "M"), _i64(0, "i0"), _i64(steps, "lim"),
         nh.from_array(rng.standard_normal((3, 3)).astype(np.float32) * 0.5, "w")])
    return h.make_model(g, opset_imports=[h.make_opsetid("", 17)])


def test_loop_invariant_body_nodes_are_emitted_once():
    """Rule 4b: 30 steps give one Transpose and one Constant c, not 30 of each, and no Identity per
    step for the passed-through weight; the outputs match ORT on the original loop."""
    m = _invariant_loop(30)
    out, done = unroll_loops_proto(onnx.load_from_string(m.SerializeToString()))
    assert done == 1
    ops = [n.op_type for n in out.graph.node]
    assert ops.count("Tanh") == 30
    assert ops.count("Transpose") == 1
    assert [n.output[0] for n in out.graph.node if n.op_type == "Identity" and "w" in n.input] == ["w_f"]
    assert sum(1 for n in out.graph.node if n.op_type == "Constant" and n.output[0].startswith("c__")) == 1
    x = np.random.default_rng(3).standard_normal((2, 3)).astype(np.float32)
    np.testing.assert_allclose(_ort(out, {"x": x})[0], _ort(m, {"x": x})[0], rtol=1e-6, atol=1e-6)
