"""``benchmarks/train_step.py``'s calibration step: the predictions of the table must use a
calibration that holds the training probes' classes (cost rule 1), so the script recalibrates a
cache that predates them, and leaves one that has them alone."""

from __future__ import annotations

import dataclasses

import pytest
from tests.bench_scripts import load as load_script


def _script():
    return load_script("train_step", "train_step_script")


def test_a_cache_without_the_training_probes_is_recalibrated(tmp_path, monkeypatch) -> None:
    import partitioner.calibrate as calibrate
    from partitioner.calibrate_cache import save_cached
    from partitioner.cluster import cpu_cluster

    monkeypatch.setenv("PARTITIONER_CACHE_DIR", str(tmp_path))
    one = cpu_cluster(1)
    old = dataclasses.replace(one.devices[0], efficiency_by_class={"gemm": 0.9, "conv": 0.8})
    save_cached(dataclasses.replace(one, devices=[old]).to_json(), {"seconds": 1.0}, "onnxruntime")
    calls = []

    def fake(backend: str, quick: bool = True, thread_probe=None):
        calls.append((backend, quick))
        new = dataclasses.replace(old, efficiency_by_class={"gemm": 0.9, "conv": 0.8, "gemm_backward": 0.7,
                                                            "conv_backward": 0.3})
        save_cached(dataclasses.replace(one, devices=[new]).to_json(),
                    {"seconds": 2.0, "co_run_cached_rounds": [0.9],
                     "kernels": [{"kernel": k.name} for k in calibrate.micro_kernels(quick=False)]}, backend)

    monkeypatch.setattr(calibrate, "calibrate_and_cache", fake)
    script = _script()
    got = script.calibration("onnxruntime")
    assert calls == [("onnxruntime", False)]  # a full calibration, once
    assert got["efficiency_by_class"]["conv_backward"] == pytest.approx(0.3)
    again = script.calibration("onnxruntime")
    assert calls == [("onnxruntime", False)] and again["seconds"] == 2.0  # up to date: not redone
    # a cache that lacks one of the forward probes (the out-of-cache GEMM, say) is made again
    # (fails when only the training probes are checked)
    from partitioner.calibrate_cache import load_cached

    doc = load_cached("onnxruntime")
    kernels = [k for k in doc["calibration"]["kernels"] if k["kernel"] != "gemm_256x1024x1024"]
    save_cached(doc["cluster"], {**doc["calibration"], "kernels": kernels}, "onnxruntime")
    script.calibration("onnxruntime")
    assert len(calls) == 2
    # one made before probe 7's in-cache copy (session 27) too
    doc = load_cached("onnxruntime")
    save_cached(doc["cluster"], {k: v for k, v in doc["calibration"].items() if k != "co_run_cached_rounds"},
                "onnxruntime")
    script.calibration("onnxruntime")
    assert len(calls) == 3


def test_a_failed_calibration_is_said_and_the_run_goes_on(tmp_path, monkeypatch) -> None:
    import partitioner.calibrate as calibrate

    monkeypatch.setenv("PARTITIONER_CACHE_DIR", str(tmp_path))

    def broken(backend: str, quick: bool = True, thread_probe=None):
        raise calibrate.CalibrationError("probe 4 failed: no compiler")

    monkeypatch.setattr(calibrate, "calibrate_and_cache", broken)
    got = _script().calibration("tvm")
    assert "probe 4 failed" in got["error"]


def test_a_cache_without_todays_training_probes_is_recalibrated(tmp_path, monkeypatch) -> None:
    """A cache with the backward classes but measured with other probes (the conv weight
    gradient's Conv form, before the GEMM form replaced it) is made again."""
    import partitioner.calibrate as calibrate
    from partitioner.calibrate_cache import save_cached
    from partitioner.cluster import cpu_cluster

    monkeypatch.setenv("PARTITIONER_CACHE_DIR", str(tmp_path))
    one = cpu_cluster(1)
    dev = dataclasses.replace(one.devices[0], efficiency_by_class={"gemm": 0.9, "conv": 0.8, "gemm_backward": 0.7,
                                                                   "conv_backward": 0.3})
    old_probes = [{"kernel": "conv_wgrad3x3_64c_28_b4"}, {"kernel": "gemm_wgrad_128x256x256"}]
    save_cached(dataclasses.replace(one, devices=[dev]).to_json(), {"seconds": 1.0, "kernels": old_probes}, "onnxruntime")
    calls = []

    def fake(backend: str, quick: bool = True, thread_probe=None):
        calls.append(backend)
        save_cached(dataclasses.replace(one, devices=[dev]).to_json(),
                    {"seconds": 2.0, "co_run_cached_rounds": [0.9],
                     "kernels": [{"kernel": k.name} for k in calibrate.micro_kernels(quick=False)]}, backend)

    monkeypatch.setattr(calibrate, "calibrate_and_cache", fake)
    assert _script().calibration("onnxruntime")["seconds"] == 2.0 and calls == ["onnxruntime"]


def test_each_configuration_runs_in_a_fresh_process(monkeypatch) -> None:
    """A 1-rank configuration trains in the process that runs it and its memory is that
    process's RSS growth, so each configuration runs in a spawned process of its own
    (``FRESH_PROCESS``): in one process the 2-thread TVM row after the 1-thread row measured
    48 MiB for the zoo mlp against 119 MiB in a fresh process (the 1-thread row: 119 MiB).
    Fails with ``FRESH_PROCESS`` off (the configurations then run in this process)."""
    import os

    script = _script()
    calls = []
    monkeypatch.setattr(script, "_in_fresh_process", lambda fn, args: calls.append(args[2]) or {"ok": True})
    monkeypatch.setattr(script, "_measure", lambda *a: pytest.fail("measured in this process"))
    results = script.run_case("mlp", "onnxruntime", 2, quick=True)
    assert calls == [label for label, *_ in script.CONFIGS]
    # each row also records the other processes' share of the cores while it ran (session 16)
    assert all({k: v for k, v in r.items() if k != "foreign_cpu_share"} == {"ok": True} for r in results.values())
    assert all("foreign_cpu_share" in r for r in results.values())
    assert _script()._in_fresh_process(os.getpid, ()) != os.getpid()


def test_baseline_settings_apply_only_inside_the_baseline_prediction() -> None:
    """``--baseline MODULE.ATTR=VALUE`` (bench rule 7): parsed as Python literals, set only while
    the baseline is predicted, restored after (even when the prediction raises)."""
    from partitioner.cost import roofline
    from partitioner.training.bench import _with_settings

    script = _script()
    got = script._settings(["partitioner.cost.roofline.MEMORY_WORKING_SET=False"])
    assert got == {"partitioner.cost.roofline.MEMORY_WORKING_SET": False}
    assert script._settings([]) is None
    with pytest.raises(SystemExit):
        script._settings(["MEMORY_WORKING_SET"])
    assert _with_settings(got, lambda: roofline.MEMORY_WORKING_SET) is False
    assert roofline.MEMORY_WORKING_SET is True
    with pytest.raises(ZeroDivisionError):
        _with_settings(got, lambda: 1 / 0)
    assert roofline.MEMORY_WORKING_SET is True
