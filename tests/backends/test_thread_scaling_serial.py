"""benchmarks/thread_scaling.py: kernels built without a parallel loop are found from the scheduled
TIR and their share of the 1-thread time is summed apart (the session-10 diagnostic: a kernel
that stays on one thread keeps its 1-thread time on 2).

The serial set comes from a real scheduled build: a 2 MFLOP threshold of 1e15 makes every kernel
serial, 0 makes the conv parallel; the sums are checked on hand-made samples (no timing).
"""

from __future__ import annotations

import importlib

import numpy as np
import onnx
import pytest
import tvm
from onnx import TensorProto, helper, numpy_helper

from backends.tvm.lower import lower_program
from backends.tvm.pipeline import run_pipeline
from backends.tvm.schedules import threads
from backends.tvm.target import detect_host_target



def _thread_scaling():
    return importlib.import_module("benchmarks.thread_scaling")  # a namespace package from the repo root


def _conv_model() -> onnx.ModelProto:
    w = (np.random.default_rng(5).standard_normal((32, 16, 3, 3)) * 0.2).astype(np.float32)
    g = helper.make_graph([helper.make_node("Conv", ["x", "w"], ["y"], kernel_shape=[3, 3], pads=[1, 1, 1, 1])],
                          "conv", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 16, 12, 12])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                          initializer=[numpy_helper.from_array(w, "w")])
    return onnx.shape_inference.infer_shapes(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]))


@pytest.mark.parametrize("threshold,conv_serial", [(1e15, True), (0.0, False)], ids=["serial", "parallel"])
def test_serial_symbols_follow_the_parallel_loops(threshold: float, conv_serial: bool,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(threads.ENV, raising=False)
    monkeypatch.setattr(threads, "_configured", threshold)
    mod = run_pipeline(lower_program(_conv_model()).mod, "scheduled", tvm.target.Target(detect_host_target()))
    convs = [gv.name_hint for gv, f in mod.functions_items()
             if isinstance(f, tvm.tirx.PrimFunc) and "conv2d" in gv.name_hint and not gv.name_hint.endswith("_prepack")]
    assert convs
    serial = _thread_scaling().serial_symbols(mod)
    assert all((name in serial) == conv_serial for name in convs), (convs, sorted(serial))


def test_serial_share_summed_apart() -> None:
    ts = _thread_scaling()
    # two runs per thread count, call sites a (parallel), b (serial), vm.builtin (neither)
    per = {1: [[("a", 4.0), ("b", 2.0), ("vm.builtin.x", 1.0)]] * 2,
           2: [[("a", 2.0), ("b", 2.0), ("vm.builtin.x", 1.0)]] * 2}
    res = ts.summarise(per, {"a": {"class": "conv"}, "b": {"class": "depthwise"}}, 50.0, frozenset({"b"}))
    assert res["t1_s"] == 7.0 and res["t2_s"] == 5.0
    assert res["serial_t1_s"] == 2.0
    assert res["kernels"]["b"]["serial"] and not res["kernels"]["a"]["serial"]
    assert not ts.summarise(per, {}, 50.0)["serial_t1_s"]  # no serial set: nothing counted


def _matmul_model() -> onnx.ModelProto:
    w = (np.random.default_rng(6).standard_normal((64, 48)) * 0.2).astype(np.float32)
    g = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])],
                          "mm", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 64])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                          initializer=[numpy_helper.from_array(w, "w")])
    return onnx.shape_inference.infer_shapes(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]))


@pytest.mark.parametrize("model", [_conv_model, _matmul_model], ids=["conv", "matmul"])
def test_operand_bytes_is_the_weight_tensor(model) -> None:
    """The weight-side operand of the scheduled conv / MatMul kernel is the ONNX initializer's size
    (float32), whatever layout the schedule packed it into; kernels without a reduction give 0."""
    m = model()
    weight_bytes = 4 * int(np.prod(m.graph.initializer[0].dims))
    mod = run_pipeline(lower_program(m).mod, "scheduled", tvm.target.Target(detect_host_target()))
    ts = _thread_scaling()
    sizes = {gv.name_hint: ts.operand_bytes(f) for gv, f in mod.functions_items() if isinstance(f, tvm.tirx.PrimFunc)}
    kernels = {n: b for n, b in sizes.items() if ("conv2d" in n or "matmul" in n) and not n.endswith("_prepack")}
    assert kernels and all(b == weight_bytes for b in kernels.values()), (weight_bytes, sizes)
    assert all(b == 0 for n, b in sizes.items() if "transpose" in n), sizes


def test_weight_rates_per_site_and_total() -> None:
    ts = _thread_scaling()
    per = {1: [[("a", 4.0), ("a", 4.0), ("b", 2.0)]], 2: [[("a", 2.0), ("a", 2.0), ("b", 2.0)]]}
    res = ts.summarise(per, {"a": {"class": "conv", "b_bytes": 8}, "b": {"class": "depthwise"}}, 50.0)
    a = res["kernels"]["a"]
    assert a["calls"] == 2 and a["b_rate1"] == 16 / 8.0 and a["b_rate2"] == 16 / 4.0
    assert res["kernels"]["b"]["b_rate1"] == 0
    assert res["b_bytes"] == 16 and res["b_rate1"] == 16 / 10.0 and res["b_rate2"] == 16 / 6.0
