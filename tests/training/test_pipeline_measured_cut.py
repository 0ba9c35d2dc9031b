"""Pipeline rule 1's measured cut (partitioner/training/measured_cut.py).

Attribution is checked on hand-made profiler events (expected seconds worked out by hand);
the plan and the prediction say which cut they used; and on the zoo resnet, whose
FLOPs-balanced cut leaves the last stage about twice the first on ONNX Runtime, the measured
cut's stages (timed alone, CPU time per step) are closer to equal than the cost model's.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

import models_zoo
from partitioner.training import SGD
from partitioner.training import measured_cut
from partitioner.training.measured_cut import COST_MODEL, MEASURED, charged
from partitioner.training.pipeline import build_pipeline
from partitioner.training.plan import predict_training


def _ev(name: str, us: float) -> dict:
    return {"cat": "Node", "name": f"{name}_kernel_time", "dur": us, "args": {}}


def test_profile_events_are_charged_to_forward_nodes() -> None:
    owner = {"a": "fa", "grad.a.1": "fa", "b": "fb", "grad.b.2": "fb", "lossnode": "loss"}
    one_run = [_ev("a/MatMulAddFusion", 10), _ev("b", 20), _ev("lossnode", 4), _ev("grad.b.2", 30),
               _ev("grad.a.1", 6), _ev("Cast_7", 7)]
    warm = [dict(e, dur=1000) for e in one_run]  # the first run is a warm-up: dropped
    second = [dict(e, dur=e["dur"] * 3) for e in one_run]
    preempted = [dict(e, dur=e["dur"] * 50) for e in one_run]
    t = charged(warm + one_run + second + preempted, owner, ["fa", "fb"])
    # median of runs 2-4 (x1, x3, x50) is run 3: fa (10+6)*3 = 48, fb (20+30+4 loss)*3 = 162 us;
    # the unnamed cast (7*3 = 21 us) spread in proportion: x (1 + 21/210)
    np.testing.assert_allclose(t, np.array([48.0, 162.0]) * 1.1 * 1e-6, rtol=1e-12)


def _mlp():
    return models_zoo.build("mlp", batch=8, hidden=32, in_features=16)


def test_plan_and_prediction_say_which_cut(monkeypatch, tmp_path) -> None:
    monkeypatch.setattr(measured_cut, "_cache_file", lambda key: tmp_path / f"{key}.npy")
    kw = {"batch": 8, "stages": 2, "micro_batches": 4}
    assert build_pipeline(_mlp(), "cross_entropy", SGD(lr=0.1), **kw).cut == MEASURED
    assert build_pipeline(_mlp(), "cross_entropy", SGD(lr=0.1), backend="tvm", **kw).cut == MEASURED
    # rule 6: one profile per plan kind, kept for the planner and the ranks (ORT: rule 7's two
    # rows in one entry; TVM: rule 1's row only)
    assert len(list(tmp_path.glob("*.npy"))) == 2
    pred = predict_training(_mlp(), "pipeline", 2, batch=8, micro_batches=4)
    assert pred.to_json()["cut"] == MEASURED
    assert predict_training(_mlp(), "pipeline", 2, batch=8, micro_batches=4, backend="cuda").cut == COST_MODEL
    monkeypatch.setattr(measured_cut, "MEASURED_CUT", False)
    assert build_pipeline(_mlp(), "cross_entropy", SGD(lr=0.1), **kw).cut == COST_MODEL


def _stage_cpu(plan, x, y) -> list[float]:
    """CPU seconds per step of each stage alone (an instant communicator), median of 3 steps."""
    from partitioner.training.overheads import _Instant
    from partitioner.training.pipeline_runner import PipelineRunner

    out = []
    for s in range(plan.num_stages):
        r = PipelineRunner(plan, s, comm=_Instant(s))
        r.step({"input": x}, y)
        times = []
        for _ in range(3):
            t = time.process_time()
            r.step({"input": x}, y)
            times.append(time.process_time() - t)
        out.append(float(np.median(times)))
    return out


@pytest.mark.slow
def test_measured_cut_balances_the_resnet_stages(monkeypatch, tmp_path) -> None:
    monkeypatch.setattr(measured_cut, "_cache_file", lambda key: tmp_path / f"{key}.npy")
    model = models_zoo.build("resnet", batch=16, image=64, classes=10)
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((16, 3, 64, 64)).astype(np.float32), rng.integers(0, 10, 16)
    kw = {"batch": 16, "stages": 2, "micro_batches": 8}
    on = build_pipeline(model, "cross_entropy", SGD(lr=0.01), **kw)
    monkeypatch.setattr(measured_cut, "MEASURED_CUT", False)
    off = build_pipeline(model, "cross_entropy", SGD(lr=0.01), **kw)
    assert (on.cut, off.cut) == (MEASURED, COST_MODEL)
    t_on, t_off = _stage_cpu(on, x, y), _stage_cpu(off, x, y)
    ratio_on, ratio_off = max(t_on) / min(t_on), max(t_off) / min(t_off)
    assert ratio_on < 1.5 and ratio_on < ratio_off, (t_on, t_off)
    assert max(t_on) < max(t_off), (t_on, t_off)


def test_tvm_stage_timing_is_not_reused_across_kernel_changes(monkeypatch, tmp_path) -> None:
    """Rule 9: rule 8's cached row is keyed by the TVM backend's sources: the same model and
    settings reuse it, a changed source re-times the stages."""
    import backends.tvm
    import onnx_ir as ir
    from onnx import TensorProto, helper

    src = tmp_path / "tvm_src"
    src.mkdir()
    (src / "__init__.py").write_text("")
    (src / "schedule.py").write_text("TILE = 16\n")
    monkeypatch.setattr(backends.tvm, "__file__", str(src / "__init__.py"))
    before = measured_cut.tvm_sources_hash()
    assert measured_cut.tvm_sources_hash() == before
    (src / "schedule.py").write_text("TILE = 32\n")
    assert measured_cut.tvm_sources_hash() != before

    w = helper.make_tensor("w", TensorProto.FLOAT, [4, 3, 3, 3], [0.1] * 108)
    g = helper.make_graph([helper.make_node("Conv", ["x", "w"], ["y"], name="conv", pads=[1, 1, 1, 1]),
                           helper.make_node("Relu", ["y"], ["z"], name="relu")], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 8, 8])],
                          [helper.make_tensor_value_info("z", TensorProto.FLOAT, [2, 4, 8, 8])], [w])
    fwd = ir.serde.deserialize_model(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]))
    monkeypatch.setattr(measured_cut, "_cache_file", lambda key: tmp_path / f"{key}.npy")
    monkeypatch.setattr(measured_cut, "_ort_node_seconds", lambda *a: np.array([0.04, 0.02]))
    timed = []
    monkeypatch.setattr(measured_cut, "tvm_scaled", lambda *a: timed.append(1) or np.array([0.05, 0.01]))
    for _ in range(2):
        assert list(measured_cut.node_seconds(fwd, "mse", "tvm", micro_batches=2, stages=2)) == [0.05, 0.01]
    assert len(timed) == 1  # the second plan reused the cached row
    (src / "schedule.py").write_text("TILE = 64\n")
    measured_cut.node_seconds(fwd, "mse", "tvm", micro_batches=2, stages=2)
    assert len(timed) == 2  # a kernel change: timed again
