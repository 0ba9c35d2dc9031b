"""backends/tvm/executable.py rule 10: the fast call path gives the general path's results bit
for bit (one output; several outputs, one of them a view of an input buffer), against ONNX
Runtime too (seeded normals, rtol 1e-5, atol 1e-6); it is taken for a plain program and not for
one with comm ops; a feed of another shape goes back to the general path."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

import backends.tvm.executable as executable
from backends.tvm.build import build_one
from backends.tvm.target import target_dict
from partitioner.core.comm_ops import make_node, opset_import
from partitioner.core.errors import RunFailed
from partitioner.runtime.comm_local import LocalWorld

F = TensorProto.FLOAT
RTOL, ATOL = 1e-5, 1e-6


def _model(nodes, inputs, outputs, comm: bool = False) -> onnx.ModelProto:
    vi = helper.make_tensor_value_info
    shape = helper.make_tensor("shape", TensorProto.INT64, [2], [4, 16])
    g = helper.make_graph(nodes, "fast", [vi(n, F, s) for n, s in inputs], [vi(n, F, s) for n, s in outputs], [shape])
    opsets = [helper.make_opsetid("", 17)] + ([opset_import()] if comm else [])
    return helper.make_model(g, opset_imports=opsets, ir_version=8)


def _one_output() -> onnx.ModelProto:
    return _model([helper.make_node("Add", ["x", "z"], ["s"]), helper.make_node("Tanh", ["s"], ["y"])],
                  [("x", [8, 8]), ("z", [8, 8])], [("y", [8, 8])])


def _three_outputs() -> onnx.ModelProto:
    """``v`` = Reshape(x): a view of x's input buffer (rule 5 copies it); ``r``, ``m`` fresh."""
    nodes = [helper.make_node("Reshape", ["x", "shape"], ["v"]), helper.make_node("Add", ["x", "z"], ["s"]),
             helper.make_node("Relu", ["s"], ["r"]), helper.make_node("Mul", ["x", "z"], ["m"])]
    return _model(nodes, [("x", [8, 8]), ("z", [8, 8])], [("v", [4, 16]), ("r", [8, 8]), ("m", [8, 8])])


def _load(program: onnx.ModelProto, path: Path) -> executable.TvmRankExecutable:
    build_one(program, path, target_dict(None))
    return executable.TvmRankExecutable(program, path)


def _general_calls(exe: executable.TvmRankExecutable) -> dict[str, int]:
    """Counts the general path's input filling (rule 5), which the fast path does not call."""
    calls = {"n": 0}
    real = exe._input_buffers

    def counted(feeds):
        calls["n"] += 1
        return real(feeds)

    exe._input_buffers = counted
    return calls


def _compare(program: onnx.ModelProto, tmp_path: Path) -> None:
    fast, general = _load(program, tmp_path / "fast.so"), _load(program, tmp_path / "general.so")
    general.fast_path = False
    assert fast.fast_path
    calls = _general_calls(fast)
    sess = ort.InferenceSession(program.SerializeToString(), providers=["CPUExecutionProvider"])
    comm = LocalWorld(1).communicator(0)
    rng = np.random.default_rng(15)
    kept = []
    for _ in range(4):
        feeds = {n: rng.standard_normal((8, 8)).astype(np.float32) for n in ("x", "z")}
        a, b = fast.run(feeds, comm), general.run(feeds, comm)
        ref = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))
        assert list(a) == list(b) == list(ref)
        for name in a:
            np.testing.assert_array_equal(a[name], b[name])
            assert a[name].dtype == b[name].dtype
            np.testing.assert_allclose(a[name], ref[name], rtol=RTOL, atol=ATOL)
        kept.append((a, ref))
    for a, ref in kept:  # an earlier call's outputs are not overwritten by later calls
        for name in a:
            np.testing.assert_allclose(a[name], ref[name], rtol=RTOL, atol=ATOL)
    assert calls["n"] == 1, calls  # the first call only (buffers made, aliasing checked); fails when off


def test_fast_path_matches_general_path_one_output(tmp_path: Path) -> None:
    _compare(_one_output(), tmp_path)


def test_fast_path_matches_general_path_several_outputs(tmp_path: Path) -> None:
    _compare(_three_outputs(), tmp_path)


def test_new_dtype_takes_general_path_and_comes_back(tmp_path: Path) -> None:
    """A feed of another dtype goes back to the general path (the fast path's dtype check refuses
    it); after the general path has made a matching buffer again, the calls are fast again."""
    exe = _load(_one_output(), tmp_path / "a.so")
    calls = _general_calls(exe)
    comm = LocalWorld(1).communicator(0)
    x = np.ones((8, 8), np.float32)
    exe.run({"x": x, "z": x}, comm)
    exe.run({"x": x, "z": x}, comm)
    assert calls["n"] == 1
    with pytest.raises(RunFailed):  # the general path made a float64 buffer; the VM refuses it
        exe.run({"x": x.astype(np.float64), "z": x}, comm)
    assert calls["n"] == 2
    for k in (2, 3):  # a float32 buffer again (general), then fast
        y = exe.run({"x": x, "z": k * x}, comm)["y"]
        np.testing.assert_allclose(y, np.tanh((k + 1) * x), rtol=RTOL, atol=ATOL)
    assert calls["n"] == 3


def test_not_taken_with_comm_ops(tmp_path: Path) -> None:
    """A program with a comm op (a 1-rank AllReduce) binds its communicator thread-locally
    (rule 2): never the fast path."""
    nodes = [helper.make_node("Add", ["x", "z"], ["s"]),
             make_node("AllReduce", ["s"], ["y"], name="ar", group=[0], reduction="sum", tag=1)]
    program = _model(nodes, [("x", [8, 8]), ("z", [8, 8])], [("y", [8, 8])], comm=True)
    exe = _load(program, tmp_path / "c.so")
    assert not exe.fast_path
    calls = _general_calls(exe)
    comm = LocalWorld(1).communicator(0)
    rng = np.random.default_rng(3)
    for _ in range(3):
        x, z = (rng.standard_normal((8, 8)).astype(np.float32) for _ in range(2))
        np.testing.assert_allclose(exe.run({"x": x, "z": z}, comm)["y"], x + z, rtol=RTOL, atol=ATOL)
    assert calls["n"] == 3


def test_module_constant_off_means_general_path(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(executable, "FAST_CALL_PATH", False)
    assert not _load(_one_output(), tmp_path / "a.so").fast_path
