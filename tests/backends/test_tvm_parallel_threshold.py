"""Threads that pay (backends/tvm/schedules/threads.py): the fork/join probe and the threshold.

A kernel below the threshold is built without a parallel loop, one above it with one, and both
builds match ONNX Runtime (rtol 1e-4, atol 1e-5); the threshold follows the environment
override and :func:`set_parallel_min_flops`; the probe measures a cost that is positive and
below a millisecond (a pool that never forks would read 0, one that sleeps between calls ms).
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import tvm
from onnx import TensorProto, helper, numpy_helper
from tvm import relax

from backends.tvm.executable import _usable_cores
from backends.tvm.lower import lower_program
from backends.tvm.peak import measure_fork_join
from backends.tvm.pipeline import run_pipeline
from backends.tvm.schedules import threads
from backends.tvm.target import detect_host_target


def _conv_matmul_model() -> onnx.ModelProto:
    rng = np.random.default_rng(3)
    inits = [numpy_helper.from_array((rng.standard_normal((32, 16, 3, 3)) * 0.2).astype(np.float32), "w"),
             numpy_helper.from_array((rng.standard_normal((32, 16, 1, 1)) * 0.2).astype(np.float32), "w1")]
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c"], ["r"]),
             helper.make_node("Conv", ["r", "w1"], ["y"], kernel_shape=[1, 1], group=2)]
    g = helper.make_graph(nodes, "small", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 16, 12, 12])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], initializer=inits)
    return onnx.shape_inference.infer_shapes(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]))


@pytest.fixture
def restore_threshold():
    yield
    threads.set_parallel_min_flops(None)


@pytest.mark.parametrize("threshold,parallel", [(1e12, False), (0.0, True)], ids=["serial", "parallel"])
def test_threshold_decides_parallel_loops(threshold: float, parallel: bool, restore_threshold, monkeypatch) -> None:
    monkeypatch.delenv(threads.ENV, raising=False)
    threads.set_parallel_min_flops(threshold)
    m = _conv_matmul_model()
    target = tvm.target.Target(detect_host_target())
    x = np.random.default_rng(0).standard_normal((1, 16, 12, 12)).astype(np.float32)
    ref = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    mod = run_pipeline(lower_program(m).mod, "scheduled", target)
    # ``*_weight_prepack`` kernels pack constant weights once at build time (folded, never run
    # per call): the threshold is about the kernels a run executes
    convs = [f.script() for gv, f in mod.functions_items()
             if isinstance(f, tvm.tirx.PrimFunc) and "conv2d" in gv.name_hint
             and not gv.name_hint.endswith("_weight_prepack")]
    assert convs and all(("T.parallel" in s) == parallel for s in convs)
    vm = relax.VirtualMachine(tvm.compile(mod, target), tvm.cpu())
    res = vm["main"](tvm.runtime.tensor(x))
    got = res.numpy() if isinstance(res, tvm.runtime.Tensor) else res[0].numpy()
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-5)


def test_threshold_sources(restore_threshold, monkeypatch) -> None:
    monkeypatch.delenv(threads.ENV, raising=False)
    assert threads.parallel_min_flops() == threads.DEFAULT_PARALLEL_MIN_FLOPS
    threads.set_parallel_min_flops(5e5)
    assert threads.worth_parallel(5e5) and not threads.worth_parallel(4e5)
    monkeypatch.setenv(threads.ENV, "7e6")
    assert threads.parallel_min_flops() == 7e6
    # 2 threads pay when W/2 + F < W, i.e. W > 2 F R; the margin doubles it
    assert threads.threshold_from(3e-6, 1e11) == pytest.approx(threads.FORK_JOIN_MARGIN * 2 * 3e-6 * 1e11)


@pytest.fixture
def calibration_cache(tmp_path, monkeypatch):
    """An empty per-machine cache (conftest's is shared by the session); the read is memoised."""
    monkeypatch.setenv("PARTITIONER_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv(threads.ENV, raising=False)
    threads.calibrated_parallel_min_flops.cache_clear()
    yield tmp_path
    threads.calibrated_parallel_min_flops.cache_clear()


def test_calibrated_threshold_is_used_by_builds(calibration_cache, restore_threshold, tmp_path) -> None:
    from backends.tvm.build import build
    from partitioner.calibrate_cache import save_cached

    assert threads.parallel_min_flops_and_source() == (threads.DEFAULT_PARALLEL_MIN_FLOPS, "default")
    threads.calibrated_parallel_min_flops.cache_clear()
    save_cached({"name": "local"}, {"parallel_min_flops": 937000.0}, "tvm")
    assert threads.parallel_min_flops_and_source() == (937000.0, "calibration")
    facts = build(_conv_matmul_model(), tmp_path / "rank0.so", options={"threads": 2})
    assert facts["parallel_min_flops"] == {"value": 937000, "source": "calibration"}
    assert "parallel_min_flops" not in build(_conv_matmul_model(), tmp_path / "r1.so", options={"threads": 1})
    threads.set_parallel_min_flops(5e5)  # configured, then the environment, come first
    assert threads.parallel_min_flops_and_source() == (5e5, "configured")


def test_unreadable_calibration_is_no_threshold(calibration_cache) -> None:
    path = calibration_cache / "calibration"
    path.mkdir()
    from partitioner.calibrate_cache import cache_path

    cache_path("tvm").write_text("{not json")
    assert threads.parallel_min_flops_and_source() == (threads.DEFAULT_PARALLEL_MIN_FLOPS, "default")


@pytest.mark.skipif(_usable_cores() < 2, reason="one usable core: no fork/join to measure")
def test_fork_join_probe_measures_a_real_cost() -> None:
    fj = measure_fork_join(threads=2, batches=5, calls=100)
    # seconds per fork/join: a few microseconds on a quiet machine, 1.76 ms measured at load 15
    # (a worker waiting for a core); 10 ms still catches a unit slip (per batch of 100 calls, or us)
    assert 0.0 < fj < 1e-2
