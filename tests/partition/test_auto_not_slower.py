"""``auto`` never picks a plan that measures slower than ``single`` on the same cores, when
``single`` was a candidate (issue 13, section 5).

On 3 zoo models (ResNet-18, a BERT encoder, MobileNetV2; batch 8) and 2 architectures from
outside the zoo (onnx's light SqueezeNet and ShuffleNet, seeded random weights, batch 1), with the
TVM backend and this machine's calibrated figures (a quick calibration into the test's own cache
folder): plan ``auto`` on ``cpu:2``; when it chose a split, compile it and the 1-rank build and
time both with ``partitioner bench`` (the 1-rank build on the same 2 cores: 2 threads) in
ROUNDS interleaved rounds (each round times the split, then the 1-rank build, so a burst of
other load hits both alike). Pass: the median over the rounds of the paired ratio (split's
median step / 1-rank median step of the same round) is at most 1 + NOISE. When ``auto`` chose
``single x1`` the test checks that it was a candidate and that the explanation says why
(nothing to time: it is the 1-rank plan itself).

NOISE = 10%: the spread of round medians measured on the shared 2-core development machine.
The planner's own margin is larger (``strategies/search.py``: a split must be predicted 25%
faster, 50% for tensor/spatial/hybrid), and since the cost model counts the 1-rank plan's threads
(``cost/threads.py``), on a 2-core machine ``auto`` keeps ``single x1`` for all five models (the
best 2-way split is predicted 1.1-1.15x faster at most), which is what the Nov 30 runs measured
(ResNet-18 data x2 1.14x, BERT data x2 1.10x against 1 rank on both cores).
Slow (minutes of TVM builds per model).

A split that must win (:func:`test_auto_splits_where_threads_do_not_help`): a model of
elementwise blocks (Mul, Add, Abs, Neg, Exp, Add on a 64 x 2048 activation, 6 blocks), whose
TVM kernels run on one thread whatever the pool size (measured 2026-12-01: a chain of Adds took
4.3 us per kernel on 1 thread and on 2). The calibration's thread probe (probe 6, forced on here
so that a busy machine still measures it) finds that, so ``single x1`` on 2 cores is predicted no
faster than on one and ``auto`` must pick a 2-way split (data x2: each rank does half the rows on
its own core). The split must then measure no slower than the 1-rank build on the same 2 cores
(median over ROUNDS interleaved rounds of the paired ratio), which is this issue's claim. The
planner predicts about 1.5x; on a quiet machine (2026-12-01, load < 1) the split measured only
1.10x faster (ratios 0.91, 0.98, 0.94, 0.65, 0.90): the large Exp kernels do use the second
thread, which the probe's chain of small Adds does not show. That misprediction is issue 13's
open item (a per-op-class thread figure measured on kernels of the model's size), so the test
asserts "not slower", not the predicted margin. If a backend change makes these kernels use threads (calibrated
elementwise thread efficiency of 0.5 or more), ``auto`` keeps ``single x1`` and the test checks
that instead.

Earlier results (2026-12-01, before the planner counted the 1-rank plan's threads and the
per-kind margins; shared 2-core machine, load average 30–74, so not a verdict): resnet, bert,
mobilenet and light_shufflenet passed once each (resnet failed a second run at load 74: data x2
24.3 ms against 20.6 ms); light_squeezenet failed: auto picked tensor x2 (simulated 9.3 ms
against 13.4 ms for single), which measured 44–97 ms against 13.8 ms (15 AllReduces of row-split
convolutions, 45 ms of comm per step). With both changes, on the machine's calibration, auto
keeps single x1 for all five on this 2-core machine (plans checked with the machine's
calibration, 2026-12-01), and the test passed 5/5 in 78 s (load average 50–76). On a machine
whose calibration makes a split win by its margin, the split is timed against the 1-rank build.
"""

from __future__ import annotations

import os
import statistics
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import models_zoo
from partitioner import calibrate_cache
from partitioner.bench import bench_artifact
from partitioner.compiler import compile as compile_artifact
from partitioner.compiler import prepare
from partitioner.partition import partition

NOISE = 0.10
ROUNDS = 5
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
    ratio = statistics.median(a / b for a, b in zip(split_s, single_s))
    assert ratio <= 1 + NOISE, (
        f"{name}: auto chose {res.plan.strategy} x{res.plan.world_size}: split/1-rank per round "
        f"{[round(a / b, 2) for a, b in zip(split_s, single_s)]} (split ms {[round(x * 1e3, 2) for x in split_s]}, "
        f"1 rank on the same cores {[round(x * 1e3, 2) for x in single_s]}) ({res.explanation})")


def elementwise_blocks(batch: int = 64, width: int = 2048, blocks: int = 6) -> onnx.ModelProto:
    """``blocks`` blocks y = exp(-|x * s + c|) + c on a ``batch`` x ``width`` activation, seeded
    random scales and shifts: only elementwise kernels. Every value is read once: TVM inlines a
    fused elementwise chain, so an op that reads its input several times (a residual Add, Tanh's
    rational form) multiplies the kernel's expression each block (minutes of LLVM)."""
    rng = np.random.default_rng(0)
    nodes, inits, cur = [], [], "x"
    for b in range(blocks):
        inits += [numpy_helper.from_array(rng.standard_normal(width).astype(np.float32), f"s{b}"),
                  numpy_helper.from_array((rng.standard_normal(width) * 0.1).astype(np.float32), f"c{b}")]
        nodes += [helper.make_node("Mul", [cur, f"s{b}"], [f"m{b}"]), helper.make_node("Add", [f"m{b}", f"c{b}"], [f"a{b}"]),
                  helper.make_node("Abs", [f"a{b}"], [f"b{b}"]), helper.make_node("Neg", [f"b{b}"], [f"n{b}"]),
                  helper.make_node("Exp", [f"n{b}"], [f"t{b}"]), helper.make_node("Add", [f"t{b}", f"c{b}"], [f"r{b}"])]
        cur = f"r{b}"
    g = helper.make_graph(nodes, "elementwise_blocks", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, width])],
                          [helper.make_tensor_value_info(cur, TensorProto.FLOAT, [batch, width])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


@pytest.fixture(scope="module")
def calibrated_threads(tmp_path_factory: pytest.TempPathFactory):
    """This machine's quick TVM calibration with the thread probe forced on, in its own cache."""
    from partitioner.calibrate import calibrate_and_cache

    old = os.environ.get(calibrate_cache.CACHE_DIR_ENV)
    os.environ[calibrate_cache.CACHE_DIR_ENV] = str(tmp_path_factory.mktemp("calibration_threads"))
    cal, _ = calibrate_and_cache("tvm", quick=True, thread_probe=True)
    yield cal
    if old is None:
        os.environ.pop(calibrate_cache.CACHE_DIR_ENV, None)
    else:
        os.environ[calibrate_cache.CACHE_DIR_ENV] = old


def test_auto_splits_where_threads_do_not_help(calibrated_threads, tmp_path: Path) -> None:
    path = tmp_path / "elementwise_blocks.onnx"
    onnx.save(elementwise_blocks(), path)
    res = partition(prepare(str(path))[0], "cpu:2", strategy="auto", lower=False)
    eff = calibrated_threads.thread_efficiency_by_class.get("elementwise")
    assert eff is not None, "the forced thread probe measured no elementwise kernels"
    if eff >= 0.5:  # this backend's elementwise kernels use threads: the 1-rank plan is as fast
        assert res.plan.world_size == 1 and res.explanation.startswith("auto chose single x1"), res.explanation
        return
    assert res.plan.world_size == 2, f"elementwise thread efficiency {eff:.2f}: {res.explanation}"
    art = compile_artifact(str(path), "cpu:2", strategy="auto", out_dir=tmp_path / "auto", progress=False)
    single = compile_artifact(str(path), "cpu:1", strategy="single", out_dir=tmp_path / "single", progress=False)
    ratios = []
    for _ in range(ROUNDS):
        doc = bench_artifact(art.root, baseline="single", single_dir=single.root, repeat=20, warmup=3, ort=False)
        ratios.append(doc["results"]["partitioned"]["median_s"] / doc["results"]["single"]["median_s"])
    print(f"elementwise thread efficiency {eff:.2f}; auto: {res.plan.strategy} x{res.plan.world_size}; "
          f"split / 1-rank step per round {[round(r, 3) for r in ratios]}")
    assert statistics.median(ratios) <= 1.0, (
        f"auto chose {res.plan.strategy} x2 (elementwise thread efficiency {eff:.2f}); split / 1-rank step per "
        f"round {[round(r, 2) for r in ratios]} ({res.explanation})")
