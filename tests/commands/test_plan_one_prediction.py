"""One prediction, one number (issue 13, section 5): ``plan`` used to print a simulated latency
and, beside it and in the explanation, a different search estimate (demo: 3.61 ms against
2.76 ms). Now the simulation of the lowered programs is the prediction everywhere (text, JSON,
explanation), the search estimate is kept apart under ``search_estimate``, and the two agree
within the tolerance below for every strategy on the demo's model.

Tolerance: 15%. The estimate costs a layout conversion once per tensor; the simulator costs each
comm op the lowering inserted, in program order (spatial halos, tensor-parallel all-reduces), so
they may differ by that share of the step, never by the 30% of the old rule (which divided
weight reads by the batch split)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import onnx
import pytest

import models_zoo
from partitioner import cli


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("demo") / "resnet.onnx"
    onnx.save(models_zoo.build("resnet", batch=2, image=64), path)  # what `make demo` plans
    return path


def _plan(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    capsys.readouterr()
    assert cli.main(["plan", *argv]) == 0
    return capsys.readouterr().out


def test_text_report_prints_one_latency(demo: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = _plan(capsys, str(demo), "--devices", "2", "--strategy", "auto")
    doc = json.loads(_plan(capsys, str(demo), "--devices", "2", "--strategy", "auto", "--json"))
    pred = doc["prediction"]
    step = pred["simulated"]["step_latency_s"]
    assert pred["latency_s"] == step and pred["step_latency_s"] == step
    assert pred["throughput_samples_per_s"] == pred["simulated"]["throughput_samples_per_s"]
    shown = f"{step * 1e3:.3f} ms"
    latency_line = next(line for line in out.splitlines() if line.startswith("latency "))
    assert latency_line.startswith(f"latency {shown}") and "search estimate" not in latency_line
    # the explanation names the shown number; any other number it gives is labelled as the estimate
    est = f"{pred['search_estimate']['latency_s'] * 1e3:.3f} ms"
    if est != shown:
        assert shown in doc["explanation"] and "analytical estimate" in doc["explanation"]


@pytest.mark.parametrize("strategy", ["single", "data", "pipeline", "tensor", "spatial"])
def test_search_estimate_agrees_with_simulation(demo: Path, capsys: pytest.CaptureFixture[str],
                                                strategy: str) -> None:
    doc = json.loads(_plan(capsys, str(demo), "--devices", "2", "--strategy", strategy, "--json",
                           "--simulate"))
    sim = doc["prediction"]["simulated"]["step_latency_s"]
    est = doc["prediction"]["search_estimate"]["latency_s"]
    assert abs(est / sim - 1) < 0.15, (strategy, est, sim)
