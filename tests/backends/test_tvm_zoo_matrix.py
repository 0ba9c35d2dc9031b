"""Every zoo builder (small sizes) x {data, pipeline, tensor} on 2 ranks with the TVM backend.

Each case compiles an artifact (partitioner.compiler.compile, backend tvm), runs it through the
in-process runtime (threads, LocalWorld) and compares every output with ONNX Runtime on the
unpartitioned model, run here by the test itself, with seeded inputs:
``|got - want| <= atol + rtol * |want|`` with rtol 1e-4, atol 1e-5.

Which strategy must apply to which model is the table of tests/partition/applicability.py, asserted
both ways: a listed refusal must be raised with its reason, any other refusal or error fails.

TVM compiles take ~1-20 s per program on a contended 2-core machine, so the full matrix is
``@pytest.mark.slow`` (``make test-slow``); the unmarked subset (mlp x all three, bert x tensor)
runs in CI.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

import models_zoo
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "partition"))
from applicability import partition_as_expected  # noqa: E402  (the table of tests/partition)

import tvm  # noqa: E402,F401  (a broken install fails, never skips)

RTOL, ATOL = 1e-4, 1e-5
BATCH = 2  # data parallelism over 2 ranks needs a batch of at least 2
SMALL = {  # the sizes of tests/test_foundation.py
    "mlp": {}, "resnet": {"image": 32, "width": 16}, "resnet50": {"image": 32, "width": 8},
    "bert": {"seq": 8}, "gpt": {"seq": 8}, "unet": {"image": 32, "base": 8},
    "inception": {"image": 32}, "mobilenet": {"image": 32, "width_mult": 0.5},
    "llama": {"seq": 8},
}
STRATEGIES = ("data", "pipeline", "tensor")
FAST = {("mlp", "data"), ("mlp", "pipeline"), ("mlp", "tensor"), ("bert", "tensor")}
# with --passes optimize (Conv+BN folding, NHWC layout, GELU/LayerNorm recognition, bias and
# activation fusion, elementwise groups) before partitioning: 1 rank and the 2-rank strategies
OPTIMIZED_FAST = {("mlp", "single"), ("resnet", "single"), ("resnet", "pipeline"), ("gpt", "tensor")}


def _cases():
    for name in SMALL:
        for strategy in STRATEGIES:
            marks = () if (name, strategy) in FAST else (pytest.mark.slow,)
            yield pytest.param(name, strategy, marks=marks, id=f"{name}-{strategy}")


def _optimized_cases():
    for name in SMALL:
        for strategy in ("single", *STRATEGIES):
            marks = () if (name, strategy) in OPTIMIZED_FAST else (pytest.mark.slow,)
            yield pytest.param(name, strategy, marks=marks, id=f"{name}-{strategy}-optimize")


def _feeds(model: onnx.ModelProto, seed: int = 0) -> dict[str, np.ndarray]:
    return models_zoo.sample_inputs(model, seed)


def _ort(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    sess = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    return dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))


def test_matrix_covers_every_zoo_builder() -> None:
    builders = {e.name for e in models_zoo.list_models() if e.kind == "builder"}
    assert builders <= set(SMALL), f"add {sorted(builders - set(SMALL))} to SMALL"


@pytest.mark.parametrize(("name", "strategy"), list(_cases()))
def test_zoo_model_tvm_two_ranks_matches_ort(name: str, strategy: str, tmp_path) -> None:
    from partitioner.compiler import compile as compile_artifact
    from partitioner.runtime.launch import run_in_process

    model = models_zoo.build(name, batch=BATCH, **SMALL[name])
    feeds = _feeds(model)
    want = _ort(model, feeds)
    art = partition_as_expected(name, strategy, 2, BATCH, lambda: compile_artifact(
        model, "cpu:2", strategy=strategy, backend="tvm", out_dir=tmp_path / "art", jobs=1, progress=False))
    if art is None:
        return
    assert art.backend == "tvm" and art.world_size == 2 and art.manifest["fallback"] is None
    assert all((art.root / f"rank{i}.so").is_file() for i in range(2))
    got, _ = run_in_process(art, feeds, timeout=600)
    assert set(got) == set(want)
    for out_name, ref in want.items():
        assert got[out_name].shape == ref.shape, out_name
        np.testing.assert_allclose(got[out_name], ref, rtol=RTOL, atol=ATOL, err_msg=f"{name} x {strategy}: {out_name}")


@pytest.mark.parametrize(("name", "strategy"), list(_optimized_cases()))
def test_zoo_model_optimized_tvm_matches_ort(name: str, strategy: str, tmp_path) -> None:
    """The optimize pass pipeline, then the TVM default schedules, at 1 rank and at 2 ranks."""
    from partitioner.compiler import compile as compile_artifact
    from partitioner.runtime.launch import run_in_process

    model = models_zoo.build(name, batch=BATCH, **SMALL[name])
    feeds = _feeds(model)
    want = _ort(model, feeds)
    cluster, strat = ("cpu:1", "auto") if strategy == "single" else ("cpu:2", strategy)
    art = partition_as_expected(name, strategy, 2, BATCH, lambda: compile_artifact(
        model, cluster, strategy=strat, backend="tvm", out_dir=tmp_path / "art", passes=["optimize"], jobs=1,
        progress=False))
    if art is None:
        return
    assert art.backend == "tvm" and art.manifest["fallback"] is None
    assert art.world_size == (1 if strategy == "single" else 2)
    got, _ = run_in_process(art, feeds, timeout=600)
    assert set(got) == set(want)
    for out_name, ref in want.items():
        assert got[out_name].shape == ref.shape, out_name
        np.testing.assert_allclose(got[out_name], ref, rtol=RTOL, atol=ATOL,
                                   err_msg=f"{name} x {strategy} (optimize): {out_name}")
