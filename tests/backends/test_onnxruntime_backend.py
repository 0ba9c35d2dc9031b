"""The ONNX Runtime reference backend: contract (build/load/run) and failure handling."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import backends
from partitioner.core import comm_ops
from partitioner.core.bindings import Bindings, Placement, TensorBinding
from partitioner.core.errors import RunFailed
from partitioner.runtime.comm_local import LocalWorld
from partitioner.runtime.in_process import run_reference


def _prog(nodes, inputs, outputs, comm=True):
    g = helper.make_graph(nodes, "p", [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2, 3]) for n in inputs],
                          [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2, 3]) for n in outputs],
                          value_info=[helper.make_tensor_value_info(v, TensorProto.FLOAT, [2, 3]) for v in ("r", "s")])
    ops = [helper.make_opsetid("", 18)] + ([comm_ops.opset_import()] if comm else [])
    return helper.make_model(g, opset_imports=ops)


def test_build_load_run_allreduce(tmp_path) -> None:
    ort_backend = backends.get_backend("onnxruntime")
    prog = _prog([helper.make_node("Relu", ["x"], ["r"], name="relu"),
                  comm_ops.make_node("AllReduce", ["r"], ["s"], name="ar", group=[0, 1], reduction="sum", tag=1),
                  helper.make_node("Neg", ["s"], ["y"], name="neg")], ["x"], ["y"])
    facts = ort_backend.build(prog, tmp_path / "rank0.onnx")
    assert (tmp_path / "rank0.onnx").is_file() and facts["backend"] == "onnxruntime"
    x = np.arange(6, dtype=np.float32).reshape(2, 3) - 2
    b = Bindings((TensorBinding("x", (2, 3), "float32", (Placement(0, "x"), Placement(1, "x"))),),
                 (TensorBinding("y", (2, 3), "float32", (Placement(0, "y"),)),), 2)
    out = run_reference([prog, prog], b, {"x": x})
    np.testing.assert_array_equal(out["y"], -2 * np.maximum(x, 0))
    exe = ort_backend.load(prog, tmp_path / "rank0.onnx", threads=1)
    world = LocalWorld(1)
    single = _prog([helper.make_node("Relu", ["x"], ["y"], name="relu")], ["x"], ["y"], comm=False)
    np.testing.assert_array_equal(ort_backend.load(single).run({"x": x}, world.communicator(0))["y"], np.maximum(x, 0))
    assert exe.outputs == ["y"]


def test_failure_on_one_rank_ends_all_and_names_it() -> None:
    ort_backend = backends.get_backend("onnxruntime")
    waits = _prog([comm_ops.make_node("Recv", [], ["y"], name="recv", peer=1, tag=5, shape=[2, 3], dtype=TensorProto.FLOAT)],
                  [], ["y"])
    # rank 1 feeds a wrong shape to its Send: the Recv on rank 0 fails, which must not hang rank 1
    bad = _prog([comm_ops.make_node("Send", ["x"], [], name="send", peer=0, tag=5)], ["x"], [])
    bad.graph.input[0].type.tensor_type.shape.dim[0].dim_value = 4
    b = Bindings((TensorBinding("x", (4, 3), "float32", (Placement(1, "x"),)),),
                 (TensorBinding("y", (2, 3), "float32", (Placement(0, "y"),)),), 2)
    with pytest.raises(RunFailed, match="rank 0"):
        run_reference([waits, bad], b, {"x": np.zeros((4, 3), np.float32)}, timeout_s=20)


def test_timeout_is_reported_not_hung() -> None:
    ort_backend = backends.get_backend("onnxruntime")
    waits = _prog([comm_ops.make_node("Recv", [], ["y"], name="recv", peer=1, tag=5, shape=[2, 3], dtype=TensorProto.FLOAT)],
                  [], ["y"])
    idle = _prog([helper.make_node("Relu", ["x"], ["y"], name="relu")], ["x"], ["y"], comm=False)
    b = Bindings((TensorBinding("x", (2, 3), "float32", (Placement(1, "x"),)),),
                 (TensorBinding("y", (2, 3), "float32", (Placement(0, "y"),)),), 2)
    with pytest.raises(RunFailed, match="rank 0.*timed out"):
        run_reference([waits, idle], b, {"x": np.zeros((2, 3), np.float32)}, timeout_s=1)
