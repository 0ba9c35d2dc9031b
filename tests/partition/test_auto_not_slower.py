"""``auto`` never picks a plan that measures slower than ``single`` on the same cores, when
``single`` was a candidate (issue 13, section 5).

On 3 zoo models (ResNet-18, a BERT encoder, MobileNetV2; batch 8) and 2 architectures from
outside the zoo (onnx's light SqueezeNet and ShuffleNet, seeded random weights, batch 1), with the
TVM backend and this machine's calibrated figures (a quick calibration into the test's own cache
folder): plan ``auto`` on ``cpu:2``; when it chose a split, compile it and the 1-rank build and
time both with ``partitioner bench`` (the 1-rank build on the same 2 cores: 2 threads) in 3
interleaved rounds. Pass: the split's median step over the rounds is at most (1 + NOISE) times
the 1-rank median. When ``auto`` chose ``single x1`` the test checks that it was a candidate and
that the explanation says why (nothing to time: it is the 1-rank plan itself).

NOISE = 10%: the spread of round medians measured on the shared 2-core development machine.
Slow (minutes of TVM builds per model).

Last results (2026-12-01, shared 2-core machine, load average 30–74, so not a verdict): resnet,
bert, mobilenet and light_shufflenet passed once each (resnet failed a second run at load 74:
data x2 24.3 ms against 20.6 ms). light_squeezenet fails: auto picks tensor x2 (simulated 9.3 ms
against 13.4 ms for single), which measured 44–97 ms against 13.8 ms: 15 AllReduces of
row-split convolutions, 45 ms of comm per step and 50 ms of kernels per rank. Rerun on a quiet
machine; if it still fails, the model misses the cost of the split convolutions' kernels and
collectives (see docs/calibration.md).
"""

from __future__ import annotations

import os
import statistics
from pathlib import Path

import onnx
import pytest

import models_zoo
from partitioner import calibrate_cache
from partitioner.bench import bench_artifact
from partitioner.compiler import compile as compile_artifact
from partitioner.compiler import prepare
from partitioner.partition import partition

NOISE = 0.10
ROUNDS = 3
CASES = {
    "resnet": {"batch": 8, "image": 64},
    "bert": {"batch": 8},
    "mobilenet": {"batch": 8},
    "light_squeezenet": {},
    "light_shufflenet": {},
}

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory: pytest.TempPathFactory):
    """This machine's quick TVM calibration, in a cache folder of the test's own."""
    from partitioner.calibrate import calibrate_and_cache

    old = os.environ.get(calibrate_cache.CACHE_DIR_ENV)
    os.environ[calibrate_cache.CACHE_DIR_ENV] = str(tmp_path_factory.mktemp("calibration"))
    calibrate_and_cache("tvm", quick=True)
    yield
    if old is None:
        os.environ.pop(calibrate_cache.CACHE_DIR_ENV, None)
    else:
        os.environ[calibrate_cache.CACHE_DIR_ENV] = old


@pytest.mark.parametrize("name", list(CASES))
def test_auto_not_slower_than_single(name: str, calibrated: None, tmp_path: Path) -> None:
    path = tmp_path / f"{name}.onnx"
    onnx.save(models_zoo.build(name, **CASES[name]), path)
    res = partition(prepare(str(path))[0], "cpu:2", strategy="auto", lower=False)  # what compile plans
    names = [a["candidate"] for a in res.alternatives if "not_applicable" not in a]
    assert "single x1" in names
    if res.plan.world_size == 1:
        assert res.explanation.startswith("auto chose single x1")
        return
    art = compile_artifact(str(path), "cpu:2", strategy="auto", out_dir=tmp_path / "auto", progress=False)
    single = compile_artifact(str(path), "cpu:1", strategy="single", out_dir=tmp_path / "single", progress=False)
    split_s, single_s = [], []
    for _ in range(ROUNDS):
        doc = bench_artifact(art.root, baseline="single", single_dir=single.root, repeat=5, warmup=2, ort=False,
                             single_threads=None)
        split_s.append(doc["results"]["partitioned"]["median_s"])
        single_s.append(doc["results"]["single"]["median_s"])
    split, one = statistics.median(split_s), statistics.median(single_s)
    assert split <= one * (1 + NOISE), (
        f"{name}: auto chose {res.plan.strategy} x{res.plan.world_size} at {split * 1e3:.2f} ms per step, "
        f"1 rank on the same cores {one * 1e3:.2f} ms ({res.explanation})")
