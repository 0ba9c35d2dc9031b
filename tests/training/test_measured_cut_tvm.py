"""Measured-cut rule 8: TVM plans' ORT prices rescaled per stage by the TVM stages' own times.

The rescaling is checked on hand-worked prices; the cut it gives is checked with the TVM stage
timer replaced by fixed times (no timing in the assertion: a stage reported 3x slower than its
ORT prices must lose nodes to the other, one reported 2% slower must not: ``TVM_MIN_GAIN``);
rule 10's neighbour cuts likewise, with the plan timer replaced by fixed times (a neighbour 10%
faster is taken and the plan cuts there, one 1% faster is not); conv nets only
(``TVM_SCALED_OPS``: the mlp is not timed); on by default (session 15); the real
timer runs once on a small conv net (slow), and the plan it cuts trains like one rank.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

import models_zoo
from partitioner.training import SGD
from partitioner.training import measured_cut
from partitioner.training.pipeline import build_pipeline, stage_ends
from partitioner.training.step import _load


def test_rescaled_scales_each_stage_by_its_time() -> None:
    t = np.array([1.0, 1.0, 2.0, 2.0, 4.0])
    # stage 0 = nodes 0-1 (prices 2 s, measured 6 s: x3), stage 1 = nodes 2-4 (8 s, measured 2 s: x1/4)
    np.testing.assert_allclose(measured_cut.rescaled(t, [1, 4], [6.0, 2.0]), [3.0, 3.0, 0.5, 0.5, 1.0])
    assert measured_cut.rescaled(t, [1, 4], [6.0, 0.0]) is None  # no time: nothing to scale by


def _mlp():
    return models_zoo.build("mlp", batch=8, hidden=32, layers=6, in_features=16)


def _model():
    """Two 3x3 convs and a Gemm (test_pipeline_hoist's net, wider): rule 8 times conv nets only."""
    from tests.training.test_pipeline_hoist import _conv_net

    return _conv_net(cin=4, c1=16, c2=16, size=8)


def _stage0_nodes(plan, fwd) -> set[str]:
    """The forward nodes (by output name) stage 0's forward program computes."""
    outs = {n.outputs[0].name for n in fwd.graph}
    return {o for n in plan.stages[0].forward.graph.node for o in n.output if o in outs}


def _fake_times(calls: list, slow: float):
    """A TVM stage timer that reports stage 0 at ``slow`` x its ORT prices, the rest at 1x."""
    def times(fwd, loss, stages, micro_batches):
        t = measured_cut._ort_node_seconds(fwd, loss, "tvm", None, micro_batches)
        ends = stage_ends(fwd.graph, stages, seconds=t)
        starts = [0] + [e + 1 for e in ends[:-1]]
        calls.append(ends)
        return [float(t[a:b + 1].sum()) * (slow if s == 0 else 1.0) for s, (a, b) in enumerate(zip(starts, ends))]
    return times


def test_a_slow_tvm_stage_moves_the_cut(monkeypatch, tmp_path) -> None:
    monkeypatch.setattr(measured_cut, "_cache_file", lambda key: tmp_path / f"{key}.npy")
    monkeypatch.setattr(measured_cut, "TVM_NEIGHBOUR_CUTS", False)  # rule 10: its own tests below
    monkeypatch.setattr(measured_cut, "TVM_MIN_STEP_S", 0.0)
    calls: list = []  # rule 8 is on by default (session 15): this test fails with it off
    monkeypatch.setattr(measured_cut, "tvm_stage_times", _fake_times(calls, 3.0))
    fwd = _load(_model(), 2)
    ort = measured_cut.node_seconds(fwd, "cross_entropy", "onnxruntime", None, 4)
    scaled = measured_cut.node_seconds(fwd, "cross_entropy", "tvm", None, 4, stages=2)
    assert calls and calls[0] == stage_ends(fwd.graph, 2, seconds=ort)  # timed on rule 1's cut
    first, moved = stage_ends(fwd.graph, 2, seconds=ort)[0], stage_ends(fwd.graph, 2, seconds=scaled)[0]
    assert moved < first  # the slow first stage gives nodes away
    # the plan takes it: fewer nodes in stage 0 than with rule 8 off
    kw = {"batch": 8, "stages": 2, "micro_batches": 4, "backend": "tvm"}
    on = build_pipeline(_model(), "cross_entropy", SGD(lr=0.1), **kw)
    monkeypatch.setattr(measured_cut, "TVM_STAGE_SCALED", False)
    off = build_pipeline(_model(), "cross_entropy", SGD(lr=0.1), **kw)
    assert _stage0_nodes(on, fwd) < _stage0_nodes(off, fwd)  # stage 0 computes fewer forward nodes
    assert len(calls) == 1  # rule 6: measured once, then read from the cache


def test_a_noise_sized_imbalance_keeps_the_cut(monkeypatch, tmp_path) -> None:
    monkeypatch.setattr(measured_cut, "_cache_file", lambda key: tmp_path / f"{key}.npy")
    monkeypatch.setattr(measured_cut, "TVM_NEIGHBOUR_CUTS", False)  # rule 10: its own tests below
    monkeypatch.setattr(measured_cut, "TVM_MIN_STEP_S", 0.0)
    calls: list = []
    monkeypatch.setattr(measured_cut, "tvm_stage_times", _fake_times(calls, 1.02))
    fwd = _load(_model(), 2)
    ort = measured_cut.node_seconds(fwd, "cross_entropy", "onnxruntime", None, 4)
    kept = measured_cut.node_seconds(fwd, "cross_entropy", "tvm", None, 4, stages=2)
    assert calls  # timed, and rule 1's prices kept: a 2% slower stage saves less than TVM_MIN_GAIN
    np.testing.assert_array_equal(kept, ort)


def test_neighbour_ends_and_forced_prices() -> None:
    import onnx_ir as ir

    nodes = [ir.Node("", op, []) for op in ("Conv", "Relu", "Conv", "Relu", "Conv", "Relu", "Gemm")]
    # a cut after node 3 (the second Relu): before the Conv at 2 (end 1), after the Conv at 4
    assert measured_cut.neighbour_ends(nodes, 3) == [1, 4]
    assert measured_cut.neighbour_ends(nodes, 0) == [2]  # no Conv of stage 0 can leave it
    # stage 0 = nodes 0-1 (2 s), stage 1 = nodes 2-4 (8 s): each scaled to the mean, 5 s
    t = np.array([1.0, 1.0, 2.0, 2.0, 4.0])
    np.testing.assert_allclose(measured_cut.forced_prices(t, 1), [2.5, 2.5, 1.25, 1.25, 2.5])
    assert measured_cut.forced_prices(np.array([0.0, 1.0]), 0) is None


def _neighbour_case(monkeypatch, tmp_path, gain: float):
    """Rule 10 with fixed times: rule 8 keeps rule 1's prices (stages at 1x), and every neighbour
    plan's stages are reported ``gain`` below rule 8's cut's."""
    monkeypatch.setattr(measured_cut, "_cache_file", lambda key: tmp_path / f"{key}.npy")
    monkeypatch.setattr(measured_cut, "TVM_MIN_STEP_S", 0.0)
    monkeypatch.setattr(measured_cut, "tvm_stage_times", _fake_times([], 1.0))
    cuts: list = []

    def cut_times(fwd, loss, micro_batches, names):
        cuts.append(names)
        return [[1.0, 0.5]] + [[1.0 - gain, 0.5]] * (len(names) - 1)

    monkeypatch.setattr(measured_cut, "tvm_cut_times", cut_times)
    fwd = _load(_model(), 2)
    ort = measured_cut.node_seconds(fwd, "cross_entropy", "onnxruntime", None, 4)
    return fwd, ort, measured_cut.node_seconds(fwd, "cross_entropy", "tvm", None, 4, stages=2), cuts


def test_a_faster_neighbour_cut_is_taken(monkeypatch, tmp_path) -> None:
    fwd, ort, prices, cuts = _neighbour_case(monkeypatch, tmp_path, 0.10)
    names = [n.name for n in fwd.graph]
    first = stage_ends(fwd.graph, 2, seconds=ort)[0]
    assert cuts and len(cuts[0]) >= 2 and cuts[0][0] == names[first]  # rule 8's cut and its neighbours, timed
    moved = stage_ends(fwd.graph, 2, seconds=prices)[0]
    assert names[moved] == cuts[0][1] != names[first]  # the first faster neighbour: the DP cuts there
    report = json.loads(next(tmp_path.glob("*-tvm2x4v*.json")).read_text())  # the timings, kept
    assert report["cuts"] == cuts[0] and report["chosen"] == cuts[0][1]
    kw = {"batch": 8, "stages": 2, "micro_batches": 4, "backend": "tvm"}
    on = build_pipeline(_model(), "cross_entropy", SGD(lr=0.1), **kw)
    monkeypatch.setattr(measured_cut, "TVM_NEIGHBOUR_CUTS", False)
    monkeypatch.setattr(measured_cut, "_cache_file", lambda key: tmp_path / f"off-{key}.npy")
    off = build_pipeline(_model(), "cross_entropy", SGD(lr=0.1), **kw)
    assert _stage0_nodes(on, fwd) != _stage0_nodes(off, fwd)  # the plan takes the neighbour's cut
    assert len(cuts) == 1  # rule 6: timed once, then read from the cache


def test_a_noise_sized_neighbour_gain_keeps_the_cut(monkeypatch, tmp_path) -> None:
    fwd, ort, prices, cuts = _neighbour_case(monkeypatch, tmp_path, 0.01)
    assert cuts and len(cuts[0]) >= 2  # timed, and rule 8's (here rule 1's) prices kept
    np.testing.assert_array_equal(prices, ort)


def test_gemm_models_are_not_timed(monkeypatch, tmp_path) -> None:
    """``TVM_SCALED_OPS``: the mlp (no Conv) keeps rule 1's prices, whatever its step."""
    monkeypatch.setattr(measured_cut, "_cache_file", lambda key: tmp_path / f"{key}.npy")
    monkeypatch.setattr(measured_cut, "TVM_MIN_STEP_S", 0.0)
    calls: list = []
    monkeypatch.setattr(measured_cut, "tvm_stage_times", _fake_times(calls, 3.0))
    fwd = _load(_mlp(), 2)
    ort = measured_cut.node_seconds(fwd, "cross_entropy", "onnxruntime", None, 4)
    np.testing.assert_array_equal(measured_cut.node_seconds(fwd, "cross_entropy", "tvm", None, 4, stages=2), ort)
    assert not calls


def test_small_steps_and_ort_plans_are_not_rescaled(monkeypatch, tmp_path) -> None:
    monkeypatch.setattr(measured_cut, "_cache_file", lambda key: tmp_path / f"{key}.npy")
    calls: list = []
    monkeypatch.setattr(measured_cut, "tvm_stage_times", _fake_times(calls, 3.0))
    fwd = _load(_model(), 2)
    ort = measured_cut.node_seconds(fwd, "cross_entropy", "onnxruntime", None, 4, stages=2)
    assert ort.sum() * 4 < measured_cut.TVM_MIN_STEP_S  # this model's step is below the threshold
    np.testing.assert_array_equal(measured_cut.node_seconds(fwd, "cross_entropy", "tvm", None, 4, stages=2), ort)
    assert not calls


@pytest.mark.slow
def test_tvm_stage_times_run_the_stages(monkeypatch, tmp_path) -> None:
    """The real timer on the conv net of test_pipeline_hoist: its 2-stage TVM plan is cut on
    rule 8's prices (one cache entry, one positive CPU time per stage) and trains like one rank
    (TVM stages against a 1-rank ONNX Runtime step, 4 SGD steps, rtol 1e-4, atol 1e-5)."""
    from tests.training.test_pipeline_hoist import conv_pipeline_case, trains_like_one_rank

    monkeypatch.setattr(measured_cut, "_cache_file", lambda key: tmp_path / f"{key}.npy")
    monkeypatch.setattr(measured_cut, "TVM_MIN_STEP_S", 0.0)
    monkeypatch.setattr(measured_cut, "TVM_MIN_GAIN", 0.0)  # any cut the timer gives (no timing asserted)
    timed: list = []
    real = measured_cut.tvm_stage_times
    monkeypatch.setattr(measured_cut, "tvm_stage_times", lambda *a: timed.append(real(*a)) or timed[-1])
    plan, batches, one, runners = conv_pipeline_case(tmp_path)
    assert len(timed) == 1 and len(timed[0]) == 2 and all(t > 0 for t in timed[0])
    assert len(list(tmp_path.glob("*-tvm2x4v*.npy"))) == 1
    trains_like_one_rank(runners, batches, one)


def test_other_ranks_wait_for_rank_0s_tvm_timing(monkeypatch) -> None:
    """Rule 8 on MPI ranks: a rank waiting for rank 0's prices of a TVM plan waits
    ``TVM_CUT_WAIT_S`` (rank 0 builds and times the stages first: minutes), its deadline restored
    after; an ONNX Runtime plan's wait keeps the communicator's deadline."""
    seen: list[float] = []

    class Comm:
        rank, timeout_s = 1, 30.0

        def recv(self, peer, tag, shape, dtype):
            seen.append(self.timeout_s)
            return np.ones(shape)

    comm, fwd = Comm(), _load(_model(), 2)
    n = len(list(fwd.graph))
    assert measured_cut.shared_node_seconds(fwd, "cross_entropy", "tvm", comm, [0, 1], None, 4, 2).shape == (n,)
    measured_cut.shared_node_seconds(fwd, "cross_entropy", "onnxruntime", comm, [0, 1], None, 4, 0)
    assert seen == [measured_cut.TVM_CUT_WAIT_S, 30.0] and comm.timeout_s == 30.0
