"""``benchmarks/train_step.py --repredict``: the recorded rows predicted again, written as records to
``train_step_repredicted.json`` (the measured files untouched); ``recorded``: with each file's own
recorded calibration figures, so the run's own prediction comes back when no rule changed."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import pytest

from .test_train_step_script import _script


def test_repredict_recorded_gives_back_the_runs_prediction_and_writes_records(tmp_path, monkeypatch) -> None:
    """A run recorded with calibration A (gemm 0.5) while this machine's cache now holds B (gemm
    0.25): ``--repredict recorded`` predicts with A, so its figure is the one the bench computed
    with A here (fails if the cache's B were used: the mlp's step would be slower); the
    plain cache path uses B. The measured file is left as it was."""
    from partitioner.calibrate_cache import save_cached
    from partitioner.cluster import cpu_cluster, resolve_cluster
    from partitioner.training.plan import predict_training

    import models_zoo

    cache = tmp_path / "cache"
    monkeypatch.setenv("PARTITIONER_CACHE_DIR", str(cache))
    one = cpu_cluster(1)
    classes = {"gemm": 0.5, "elementwise": 0.5}
    recorded = dataclasses.replace(one.devices[0], efficiency_by_class=classes, runtime="onnxruntime")
    save_cached(dataclasses.replace(one, devices=[recorded]).to_json(), {"seconds": 1.0}, "onnxruntime")
    config = {"batch": 64, "hidden": 128, "in_features": 64}
    model = models_zoo.build("mlp", **config)
    run_pred = predict_training(model, "single", 1, batch=64, cluster=resolve_cluster("cpu:1", "onnxruntime"))
    now = dataclasses.replace(recorded, efficiency_by_class={**classes, "gemm": 0.25})
    save_cached(dataclasses.replace(one, devices=[now]).to_json(), {"seconds": 2.0}, "onnxruntime")
    results = tmp_path / "results"
    results.mkdir()
    doc = {"model": "mlp", "backend": "onnxruntime", "config": config, "loss": "cross_entropy",
           "calibration": {"efficiency_by_class": classes, "peak_flops": recorded.peak_flops,
                           "memory_bandwidth": recorded.memory_bandwidth},
           "results": {"1 rank, 1 thread": {"median_step_s": 0.1, "median_step_cpu_s": 0.1,
                                            "predicted_step_s": run_pred.step_time_s,
                                            "overheads_us": {"backend": "onnxruntime"}}}}
    measured = results / "train_step_mlp_onnxruntime.json"
    measured.write_text(json.dumps(doc))
    script = _script()
    out = tmp_path / "r.json"
    args = argparse.Namespace(repredict=Path("recorded"), results_dir=results, baseline=[], no_fixed=False, json=out)
    assert script.repredict_main(args) == 0
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 1 and rows[0]["repredicted_step_s"] == pytest.approx(run_pred.step_time_s, rel=1e-9)
    assert rows[0]["repredicted_error"] == pytest.approx(run_pred.step_time_s / 0.1 - 1, rel=1e-9)
    assert json.loads(measured.read_text()) == doc
    args.repredict, args.json = cache, None
    assert script.repredict_main(args) == 0
    slower = json.loads((results / "train_step_repredicted.json").read_text())["rows"][0]["repredicted_step_s"]
    assert slower > run_pred.step_time_s * 1.05
    assert script._table_files(results) == [measured]  # the records are not a run's table
