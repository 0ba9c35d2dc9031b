"""Builds for one thread (backends/tvm/schedules/threads.py, "Builds for one thread").

A conv model (3x3 conv + ReLU, depthwise 3x3, the NHWC transposes) and a GEMM model (MatMul +
Softmax), every kernel above the parallel thresholds: built for an unknown thread count or for 2
threads some kernels have a parallel loop; built for 1 thread none has, and the 1-thread build
matches ONNX Runtime (seeded input, rtol 1e-4, atol 1e-5). With ``SERIAL_WHEN_ONE_THREAD`` off a
1-thread build has parallel loops again (the knob is what removes them). The plumbing:
``backends.tvm.build.build`` with ``options["threads"]`` = 1 writes a library without
``TVMBackendParallelLaunch``; ``partitioner.compiler.compile`` passes the plan's threads per rank
(``partitioner.cost.threads.build_threads``: usable cores // ranks on a one-node CPU cluster),
and the 1-thread artifact's run matches ONNX Runtime.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import tvm
from onnx import TensorProto, helper, numpy_helper

from backends.tvm.schedules import threads
from tests.backends.tvm_build_check import build_and_compare


def _model(nodes: list, x_shape: list[int], inits: list) -> onnx.ModelProto:
    g = helper.make_graph(nodes, "serial", [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape)],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], initializer=inits)
    return onnx.shape_inference.infer_shapes(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]))


def conv_model() -> onnx.ModelProto:
    """37.7 MFLOP 3x3 conv (GEMM threshold 2 MFLOP) and a 1.2 MFLOP depthwise conv (0.8 MFLOP)."""
    rng = np.random.default_rng(3)
    inits = [numpy_helper.from_array((rng.standard_normal((64, 32, 3, 3)) * 0.1).astype(np.float32), "w"),
             numpy_helper.from_array((rng.standard_normal((64, 1, 3, 3)) * 0.2).astype(np.float32), "wd")]
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c"], ["r"]),
             helper.make_node("Conv", ["r", "wd"], ["y"], kernel_shape=[3, 3], pads=[1, 1, 1, 1], group=64)]
    return _model(nodes, [1, 32, 32, 32], inits)


def gemm_model() -> onnx.ModelProto:
    """8.4 MFLOP MatMul and a softmax over 16384 elements (the row-wise element threshold)."""
    rng = np.random.default_rng(4)
    inits = [numpy_helper.from_array((rng.standard_normal((256, 256)) * 0.1).astype(np.float32), "w")]
    nodes = [helper.make_node("MatMul", ["x", "w"], ["m"]), helper.make_node("Softmax", ["m"], ["y"], axis=-1)]
    return _model(nodes, [64, 256], inits)


def _parallel_kernels(mod: tvm.IRModule) -> list[str]:
    return [gv.name_hint for gv, f in mod.functions_items()
            if isinstance(f, tvm.tirx.PrimFunc) and "T.parallel" in f.script()]


@pytest.mark.parametrize("make", [conv_model, gemm_model], ids=["conv", "gemm"])
def test_one_thread_build_has_no_parallel_loop(make, monkeypatch) -> None:
    monkeypatch.delenv(threads.ENV, raising=False)
    m = make()
    for n in (None, 2):
        with threads.building_for(n):
            assert _parallel_kernels(build_and_compare(m)), f"built for {n} threads: no parallel kernel"
    with threads.building_for(1):
        assert threads.build_threads() == 1
        assert _parallel_kernels(build_and_compare(m)) == []
    assert threads.build_threads() is None  # the block restores the unknown count


def test_knob_off_keeps_parallel_loops(monkeypatch) -> None:
    monkeypatch.delenv(threads.ENV, raising=False)
    monkeypatch.setattr(threads, "SERIAL_WHEN_ONE_THREAD", False)
    with threads.building_for(1):
        assert _parallel_kernels(build_and_compare(gemm_model()))
        assert threads.worth_parallel(1e9) and threads.parallel_elements(1 << 20)


def test_build_option_threads(tmp_path: Path, monkeypatch) -> None:
    from backends.tvm.build import build

    monkeypatch.delenv(threads.ENV, raising=False)
    m = gemm_model()
    serial = build(m, tmp_path / "t1.so", options={"threads": 1})
    parallel = build(m, tmp_path / "t2.so", options={"threads": 2})
    assert serial["threads"] == 1 and parallel["threads"] == 2
    assert b"TVMBackendParallelLaunch" not in (tmp_path / "t1.so").read_bytes()
    assert b"TVMBackendParallelLaunch" in (tmp_path / "t2.so").read_bytes()


def test_build_threads_rule(monkeypatch) -> None:
    from partitioner.cluster import resolve_cluster
    from partitioner.cost import threads as cost_threads

    monkeypatch.setattr(cost_threads, "_usable_cores", lambda: 2)
    cpu2 = resolve_cluster("cpu:2", "tvm")
    assert cost_threads.build_threads(cpu2, 2) == 1  # data parallel: one core per rank
    assert cost_threads.build_threads(cpu2, 1) == 2
    assert cost_threads.build_threads(resolve_cluster("cpu:1", "tvm"), 1) == 2  # pin_cores counts the host
    assert cost_threads.build_threads(object(), 2) is None  # not one node's CPU cores: unknown


@pytest.mark.parametrize("cores,launches", [(1, False), (2, True)], ids=["1core", "2cores"])
def test_compile_builds_for_the_ranks_threads(cores: int, launches: bool, tmp_path: Path, monkeypatch) -> None:
    from partitioner.compiler import compile as compile_artifact
    from partitioner.cost import threads as cost_threads

    monkeypatch.delenv(threads.ENV, raising=False)
    monkeypatch.setattr(cost_threads, "_usable_cores", lambda: cores)
    m = gemm_model()
    art = compile_artifact(m, "cpu:1", strategy="single", backend="tvm", out_dir=tmp_path / "art", progress=False)
    assert (b"TVMBackendParallelLaunch" in (art.root / "rank0.so").read_bytes()) == launches
    x = np.random.default_rng(0).standard_normal((64, 256)).astype(np.float32)
    ref = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    got = art.run({"x": x}, in_process=True).outputs
    np.testing.assert_allclose(next(iter(got.values())), ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("n,launches", [(1, False), (2, True)], ids=["1thread", "2threads"])
def test_training_rank_builds_for_its_threads(n: int, launches: bool, tmp_path: Path, monkeypatch) -> None:
    """A training rank's library (``pipeline_runner.executable``, what ``StepRunner`` builds for
    the TVM backend) is built for the threads the rank runs on, and matches ONNX Runtime."""
    from partitioner.runtime.comm_local import LocalWorld
    from partitioner.training.pipeline_runner import executable

    monkeypatch.delenv(threads.ENV, raising=False)
    m = gemm_model()
    m.graph.name = f"serial_t{n}"
    exe = executable(m, "tvm", tmp_path, n)
    assert (b"TVMBackendParallelLaunch" in (tmp_path / f"serial_t{n}.so").read_bytes()) == launches
    x = np.random.default_rng(0).standard_normal((64, 256)).astype(np.float32)
    ref = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    got = exe.run({"x": x}, LocalWorld(1).communicator(0))
    np.testing.assert_allclose(got["y"], ref, rtol=1e-4, atol=1e-5)
