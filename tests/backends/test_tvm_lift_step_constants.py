"""backends/tvm/lift_step_constants.py and executable rule 8: a program's step-constant inputs
(a pipeline stage's weights) have their weight-only kernels (the conv schedule's weight packing,
the layout transposes) lifted into ``main_transform_params``, which runs again only when one of
them is copied in anew. Numbers against ONNX Runtime (seeded inputs, rtol 1e-4, atol 1e-4 on
sums of 576 products of unit normals)."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from backends.tvm.build import build_one
from backends.tvm.executable import TvmRankExecutable
from backends.tvm.lift_step_constants import (STEP_CONSTANTS_KEY, keep_step_constants_last, mark_step_constants,
                                              marked_step_constants, step_constant_inputs)
from backends.tvm.target import target_dict
from partitioner.runtime.comm_local import LocalWorld


def _program(mark: bool) -> onnx.ModelProto:
    """Relu(Conv3x3(x, w) + b) with ``w`` and ``b`` inputs, ``w`` first (``mark_step_constants``
    must move the step constants last)."""
    vi = helper.make_tensor_value_info
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c"], ["y"])]
    g = helper.make_graph(nodes, "lifted", [vi("w", TensorProto.FLOAT, [64, 64, 3, 3]),
                                            vi("x", TensorProto.FLOAT, [2, 64, 8, 8]),
                                            vi("b", TensorProto.FLOAT, [64])],
                          [vi("y", TensorProto.FLOAT, [2, 64, 8, 8])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    if mark:
        mark_step_constants(m, ["w", "b"])
    return m


def _frozen(a: np.ndarray) -> np.ndarray:
    a.flags.writeable = False
    return a


def _ort(program: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> np.ndarray:
    return ort.InferenceSession(program.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]


def test_marking_moves_step_constants_last() -> None:
    m = _program(True)
    assert [v.name for v in m.graph.input] == ["x", "w", "b"]
    assert step_constant_inputs(m) == ("w", "b")
    assert next(p.value for p in m.metadata_props if p.key == STEP_CONSTANTS_KEY) == "w,b"
    assert step_constant_inputs(_program(False)) == ()


def test_an_appended_input_goes_back_before_the_step_constants() -> None:
    """Rule 1 after a rewrite appends an input (``moved_wgrad``'s seed): the marked names are no
    longer trailing, so nothing would be lifted, until ``keep_step_constants_last`` restores the
    order (the other inputs keep theirs)."""
    m = _program(True)
    m.graph.input.append(helper.make_tensor_value_info("seed", TensorProto.FLOAT, [2]))
    assert step_constant_inputs(m) == () and marked_step_constants(m) == ["w", "b"]
    keep_step_constants_last(m)
    assert [v.name for v in m.graph.input] == ["x", "seed", "w", "b"]
    assert step_constant_inputs(m) == ("w", "b")
    unmarked = _program(False)
    before = [v.name for v in unmarked.graph.input]
    keep_step_constants_last(unmarked)
    assert [v.name for v in unmarked.graph.input] == before


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> tuple[onnx.ModelProto, TvmRankExecutable]:
    program = _program(True)
    path = tmp_path_factory.mktemp("lift") / "lifted.so"
    build_one(program, path, target_dict(None))
    return program, TvmRankExecutable(program, path)


def test_transform_runs_once_per_weight_change_and_matches_onnxruntime(built) -> None:
    program, exe = built
    assert exe._transform is not None, "the build lifted nothing"
    calls = {"n": 0}
    transform = exe._transform

    def counted(args, transform=transform):
        calls["n"] += 1
        return transform(args)

    exe._transform = counted
    exe.reuse_readonly_inputs = True
    rng = np.random.default_rng(0)
    comm = LocalWorld(1).communicator(0)
    for step in range(3):  # a new weight each step, three micro-batches with it
        w = _frozen(rng.standard_normal((64, 64, 3, 3)).astype(np.float32))
        b = _frozen(rng.standard_normal(64).astype(np.float32))
        for _ in range(3):
            x = rng.standard_normal((2, 64, 8, 8)).astype(np.float32)
            got = exe.run({"x": x, "w": w, "b": b}, comm)["y"]
            np.testing.assert_allclose(got, _ort(program, {"x": x, "w": w, "b": b}), rtol=1e-4, atol=1e-4)
        assert calls["n"] == step + 1
    w2 = w.copy()  # writeable: the caller may change it in place, so every call copies and transforms it
    for _ in range(2):
        w2 *= 0.5
        got = exe.run({"x": x, "w": w2, "b": b}, comm)["y"]
        np.testing.assert_allclose(got, _ort(program, {"x": x, "w": w2, "b": b}), rtol=1e-4, atol=1e-4)
    assert calls["n"] == 5


def test_unmarked_program_lifts_nothing(tmp_path) -> None:
    program = _program(False)
    build_one(program, tmp_path / "plain.so", target_dict(None))
    assert TvmRankExecutable(program, tmp_path / "plain.so")._transform is None


def test_returned_reshape_stays_a_view(tmp_path) -> None:
    """A returned Reshape of a computed value, beside another output (a stage's weight gradients
    reshaped back to the weights' shapes) stays a view after the lift, as it is without it: no
    ``reshape`` kernel runs."""
    vi = helper.make_tensor_value_info
    shape = helper.make_tensor("shape", TensorProto.INT64, [4], [8, 64, 3, 3])
    nodes = [helper.make_node("MatMul", ["x", "w"], ["m"]), helper.make_node("Reshape", ["m", "shape"], ["y"]),
             helper.make_node("Relu", ["m"], ["r"])]
    g = helper.make_graph(nodes, "reshaped", [vi("x", TensorProto.FLOAT, [8, 64]), vi("w", TensorProto.FLOAT, [64, 576])],
                          [vi("y", TensorProto.FLOAT, [8, 64, 3, 3]), vi("r", TensorProto.FLOAT, [8, 576])], [shape])
    program = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    mark_step_constants(program, ["w"])
    build_one(program, tmp_path / "r.so", target_dict(None))
    exe = TvmRankExecutable(program, tmp_path / "r.so")
    assert exe._transform is not None
    called: list[str] = []

    def instrument(func, symbol, before, ret, *args):
        if before:
            called.append(str(symbol))
        return 0

    exe._vm.set_instrument(instrument)
    rng = np.random.default_rng(1)
    feeds = {"x": rng.standard_normal((8, 64)).astype(np.float32),
             "w": rng.standard_normal((64, 576)).astype(np.float32)}
    got = exe.run(dict(feeds), LocalWorld(1).communicator(0))["y"]
    np.testing.assert_allclose(got, _ort(program, feeds), rtol=1e-4, atol=1e-4)
    assert called and not [s for s in called if s.startswith("reshape")], called
