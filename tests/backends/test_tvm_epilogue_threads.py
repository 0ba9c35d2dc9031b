"""A contraction's fused epilogue counts as work for the thread pool (threads.COUNT_EPILOGUE_OPS).

``backends/tvm/schedules/threads.py``, "Epilogue work": the packed GEMM rule adds 2 FLOPs per
distinct epilogue operation per output element to the multiply-adds before it compares the
kernel's work with the parallel threshold. The case it is for is heldout_unet's head at batch 1:
a 1x1 conv 16 -> 3 channels on 64x64 with a fused sigmoid (1.05 MFLOP of padded FMAs, under the
2 MFLOP default), which must get a parallel loop with the knob on and none with it off (this
test fails with ``COUNT_EPILOGUE_OPS = False``); the same conv with a ReLU epilogue stays serial
with the knob on, and so does either in a build for one thread. Every build is compared with
ONNX Runtime on seeded inputs and random weights (rtol 1e-4, atol 1e-5).
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
from backends.tvm.schedules import threads
from backends.tvm.target import detect_host_target

RTOL, ATOL = 1e-4, 1e-5


def _head(activation: str) -> onnx.ModelProto:
    """heldout_unet's head: Conv 1x1 16 -> 3 with bias on a 64x64 map, then ``activation``."""
    rng = np.random.default_rng(7)
    inits = [numpy_helper.from_array((rng.standard_normal((3, 16, 1, 1)) * 0.3).astype(np.float32), "w"),
             numpy_helper.from_array(rng.standard_normal(3).astype(np.float32), "b")]
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], kernel_shape=[1, 1]),
             helper.make_node(activation, ["c"], ["y"])]
    g = helper.make_graph(nodes, "head", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 16, 64, 64])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], initializer=inits)
    return onnx.shape_inference.infer_shapes(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]))


@pytest.fixture
def default_threshold(monkeypatch):
    monkeypatch.delenv(threads.ENV, raising=False)
    threads.set_parallel_min_flops(None)
    yield


def _head_parallel(m: onnx.ModelProto, build_threads: int | None) -> bool:
    """Whether the head's conv kernel has a parallel loop; the build checked against ORT."""
    target = tvm.target.Target(detect_host_target())
    x = np.random.default_rng(0).standard_normal((1, 16, 64, 64)).astype(np.float32)
    ref = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    with threads.building_for(build_threads):
        mod = run_pipeline(lower_program(m).mod, "scheduled", target)
    convs = [f.script() for gv, f in mod.functions_items()
             if isinstance(f, tvm.tirx.PrimFunc) and "conv2d" in gv.name_hint
             and not gv.name_hint.endswith("_weight_prepack")]
    assert len(convs) == 1
    vm = relax.VirtualMachine(tvm.compile(mod, target), tvm.cpu())
    res = vm["main"](tvm.runtime.tensor(x))
    got = res.numpy() if isinstance(res, tvm.runtime.Tensor) else res[0].numpy()
    np.testing.assert_allclose(got, ref, rtol=RTOL, atol=ATOL)
    return "T.parallel" in convs[0]


@pytest.mark.parametrize("on", [True, False], ids=["rule_on", "rule_off"])
def test_sigmoid_head_goes_to_the_pool_only_with_the_rule(on: bool, default_threshold, monkeypatch) -> None:
    monkeypatch.setattr(threads, "COUNT_EPILOGUE_OPS", on)
    assert _head_parallel(_head("Sigmoid"), None) is on


def test_relu_head_and_one_thread_builds_stay_serial(default_threshold) -> None:
    assert threads.COUNT_EPILOGUE_OPS
    assert not _head_parallel(_head("Relu"), None)  # bias + ReLU: a few ops per element
    assert not _head_parallel(_head("Sigmoid"), 1)  # a build for one thread has no parallel loop


def test_with_epilogue_adds_two_flops_per_op_and_element(monkeypatch) -> None:
    assert threads.with_epilogue(1e6, 10, 1000) == pytest.approx(1e6 + threads.EPILOGUE_FLOPS_PER_OP * 10 * 1000)
    monkeypatch.setattr(threads, "COUNT_EPILOGUE_OPS", False)
    assert threads.with_epilogue(1e6, 10, 1000) == 1e6
