"""``partitioner plan``: the report, ``--json``, ``--export-onnx``, ``--html`` and ``--objective``.

The exported per-rank programs are run (reference backend: ONNX Runtime per segment, LocalWorld
comms) and compared with ONNX Runtime on the unpartitioned model, seeded inputs, rtol 1e-4 and
atol 1e-5, so an export that writes the wrong programs or bindings fails here.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

import models_zoo
from partitioner.runtime.in_process import run_reference
from partitioner import cli
from partitioner.core.bindings import Bindings
from partitioner.core.plan import Plan


@pytest.fixture(scope="module")
def mlp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("plan") / "mlp.onnx"
    onnx.save(models_zoo.build("mlp", batch=4), path)
    return path


def _plan_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    capsys.readouterr()
    assert cli.main(["plan", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_plan_json_reports_the_chosen_plan_and_its_costs(mlp: Path, capsys: pytest.CaptureFixture[str]) -> None:
    report = _plan_json(capsys, str(mlp), "--devices", "2", "--strategy", "tensor")
    assert report["cluster"] == "cpu:2"
    assert report["plan"]["strategy"] == "tensor" and report["plan"]["world_size"] == 2
    pred = report["prediction"]
    assert pred["latency_s"] > 0 and pred["throughput_samples_per_s"] > 0
    assert len(pred["per_device"]) == 2 and len(pred["simulated"]["ranks"]) == 2
    assert pred["fits_memory"] is True


def test_plan_text_report_names_every_rank(mlp: Path, capsys: pytest.CaptureFixture[str]) -> None:
    capsys.readouterr()
    assert cli.main(["plan", str(mlp), "--devices", "2", "--strategy", "pipeline"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("strategy: pipeline  world size 2")
    assert re.search(r"^\s+0 ", out, re.M) and re.search(r"^\s+1 ", out, re.M)
    assert re.search(r"latency [0-9.]+ ms", out)


@pytest.mark.parametrize("strategy", ["tensor", "pipeline", "data"])
def test_export_onnx_programs_match_onnxruntime(mlp: Path, tmp_path: Path, strategy: str,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "export"
    capsys.readouterr()
    assert cli.main(["plan", str(mlp), "--devices", "2", "--strategy", strategy, "--export-onnx", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["bindings.json", "plan.json", "rank0.onnx", "rank1.onnx"]
    plan = Plan.from_json(json.loads((out / "plan.json").read_text()))
    assert plan.strategy == strategy and plan.world_size == 2
    bindings = Bindings.from_json(json.loads((out / "bindings.json").read_text()))
    programs = [onnx.load(out / f"rank{r}.onnx") for r in range(2)]
    model = onnx.load(mlp)
    feeds = models_zoo.sample_inputs(model, 0)
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    got = run_reference(programs, bindings, feeds, timeout_s=60)
    for o, w in zip(model.graph.output, want):
        np.testing.assert_allclose(got[o.name], w, rtol=1e-4, atol=1e-5, err_msg=f"{strategy}: {o.name}")


def test_html_report_is_self_contained_and_names_the_plan(mlp: Path, tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    page = tmp_path / "plan.html"
    assert cli.main(["plan", str(mlp), "--devices", "2", "--strategy", "tensor", "--html", str(page)]) == 0
    html = page.read_text(encoding="utf-8")
    assert "<h1>" in html and "tensor on cpu:2" in html
    assert html.count("<svg") >= 2  # the timeline and the graph at least
    for section in ("Timeline", "Memory per device", "Graph"):
        assert f"<h2>{section}" in html, section
    assert "rank 0" in html and "rank 1" in html
    # no network: the only URLs are SVG namespace names, never a script or stylesheet to fetch
    assert not re.search(r"<(script|link)[^>]+(src|href)=\"https?:", html)


@pytest.mark.parametrize("objective", ["latency", "throughput"])
def test_auto_picks_the_best_candidate_for_the_objective(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                                         objective: str) -> None:
    """Among the candidates that fit, auto's choice is the lowest predicted latency (objective
    latency) or the highest predicted throughput (objective throughput), and says so."""
    path = tmp_path / "gpt.onnx"
    onnx.save(models_zoo.build("gpt", batch=8, seq=16), path)
    report = _plan_json(capsys, str(path), "--devices", "4", "--objective", objective)
    assert f"for objective {objective}" in report["explanation"]
    fitting = [a for a in report["alternatives"] if a.get("fits_memory")]
    assert len(fitting) >= 3
    chosen = f"{report['plan']['strategy']} x{report['plan']['world_size']}"
    metric = "latency_s" if objective == "latency" else "throughput"
    best = (min if objective == "latency" else max)(fitting, key=lambda a: a[metric])
    assert best["candidate"] == chosen or best[metric] == pytest.approx(
        next(a[metric] for a in fitting if a["candidate"] == chosen))


def test_plan_bad_input_is_one_line_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    capsys.readouterr()
    assert cli.main(["plan", str(tmp_path / "missing.onnx"), "--devices", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert "missing.onnx" in err and "\n" not in err and "Traceback" not in err
