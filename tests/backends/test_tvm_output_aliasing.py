"""backends/tvm/executable.py rule 5: an output that shares bytes with a persistent input buffer is
copied. The check is a bisection over the input buffers' byte ranges; it must agree with
``np.may_share_memory`` on views of every kind (slices, reversed and strided views, reshapes,
whole buffers, and arrays outside every buffer)."""

from __future__ import annotations

import numpy as np

from backends.tvm.executable import TvmRankExecutable


def _executable_with_buffers(buffers: list[np.ndarray]) -> TvmRankExecutable:
    exe = object.__new__(TvmRankExecutable)  # only the buffers matter here: no library
    exe._in_bufs = [(None, b) for b in buffers] + [None]
    exe._spans = None
    return exe


def test_overlap_check_agrees_with_numpy() -> None:
    rng = np.random.default_rng(0)
    pool = np.zeros(4096, np.float32)  # buffers carved from one block: neighbours touch
    buffers = [pool[0:512], pool[512:1536].reshape(32, 32), pool[2048:2560]]
    exe = _executable_with_buffers(buffers)
    candidates = [pool[1536:2048], pool[2560:], np.zeros(16, np.float32), buffers[0], buffers[1].T,
                  buffers[1][::-1, ::3], buffers[2][::-2], pool[500:520], pool[1530:1540], pool[3000:3001],
                  buffers[1].reshape(-1)[1023:], np.zeros(0, np.float32)]
    for _ in range(200):
        a, b = sorted(rng.integers(0, 4096, 2))
        step = int(rng.integers(1, 4))
        candidates.append(pool[a:b + 1:step] if rng.random() < 0.5 else pool[b:a:-step])
    for arr in candidates:
        expected = any(np.may_share_memory(arr, buf) for buf in buffers) and arr.nbytes > 0
        assert exe._in_input_buffer(arr) == expected, (arr.shape, arr.strides)


def _reshape_program():
    """``y`` = Reshape(x) (a view of ``x``'s input buffer) and ``r`` = Relu(x + z) (fresh storage)."""
    from onnx import TensorProto, helper

    vi = helper.make_tensor_value_info
    shape = helper.make_tensor("shape", TensorProto.INT64, [2], [4, 16])
    nodes = [helper.make_node("Reshape", ["x", "shape"], ["y"]), helper.make_node("Add", ["x", "z"], ["s"]),
             helper.make_node("Relu", ["s"], ["r"])]
    g = helper.make_graph(nodes, "aliased", [vi("x", TensorProto.FLOAT, [8, 8]), vi("z", TensorProto.FLOAT, [8, 8])],
                          [vi("y", TensorProto.FLOAT, [4, 16]), vi("r", TensorProto.FLOAT, [8, 8])], [shape])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _built(tmp_path) -> TvmRankExecutable:
    from backends.tvm.build import build_one
    from backends.tvm.target import target_dict

    program = _reshape_program()
    build_one(program, tmp_path / "a.so", target_dict(None))
    return TvmRankExecutable(program, tmp_path / "a.so")


def test_aliasing_checked_once_and_outputs_survive(tmp_path) -> None:
    """Rule 5 with ``CACHE_OUTPUT_ALIASING`` (default on; this test fails with it off: every call
    checks every output): the input-buffer view ``y`` is copied on every call, so each call's
    result keeps its values after later calls, and only the first call checks the outputs.
    Values are exact (a reshape and a Relu of seeded normals)."""
    from partitioner.runtime.comm_local import LocalWorld

    exe, comm = _built(tmp_path), LocalWorld(1).communicator(0)
    checks = {"n": 0}
    check = exe._in_input_buffer

    def counted(arr):
        checks["n"] += 1
        return check(arr)

    exe._in_input_buffer = counted
    rng = np.random.default_rng(0)
    xs = [rng.standard_normal((8, 8)).astype(np.float32) for _ in range(3)]
    z = np.zeros((8, 8), np.float32)
    outs = [exe.run({"x": x, "z": z}, comm) for x in xs]
    for x, out in zip(xs, outs):
        np.testing.assert_array_equal(out["y"], x.reshape(4, 16))
        np.testing.assert_array_equal(out["r"], np.maximum(x, 0))
    assert checks["n"] == 2, checks  # the two outputs, on the first call only


def test_aliasing_rechecked_when_inputs_come_as_tensors(tmp_path) -> None:
    """Rule 9 then rule 5: a call whose ``x`` is a TVM tensor (nothing aliases an input buffer)
    does not hide the view on the next call, whose ``x`` is copied into the buffer again (fails
    when the remembered aliasing is kept across a change of the inputs given as tensors)."""
    import tvm

    from partitioner.runtime.comm_local import LocalWorld

    exe, comm = _built(tmp_path), LocalWorld(1).communicator(0)
    rng = np.random.default_rng(1)
    xs = [rng.standard_normal((8, 8)).astype(np.float32) for _ in range(4)]
    z = np.zeros((8, 8), np.float32)
    exe.run({"x": xs[0], "z": tvm.runtime.tensor(z)}, comm)  # x's input buffer exists from here on
    # z's buffer is created on this call, so the outputs are checked with x given as a tensor
    exe.run({"x": tvm.runtime.tensor(xs[1]), "z": z}, comm)
    kept = exe.run({"x": xs[2], "z": z}, comm)["y"]
    exe.run({"x": xs[3], "z": z}, comm)
    np.testing.assert_array_equal(kept, xs[2].reshape(4, 16))
