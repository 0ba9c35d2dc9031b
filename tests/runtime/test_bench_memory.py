"""``bench`` reports each rank's peak memory, predicted beside measured (issue 13, section 5).

Measured = the rank's RSS high-water mark minus its RSS just before its program loads. Checks that
can fail: every rank reports it; the measured figure holds at least the rank's own weights (a
baseline taken after loading, or a peak never reset, would not); the predicted figure is the
manifest's simulated per-rank peak; a data-parallel rank's weights are whole, so they count once
per rank, not once per world; and the text and --json both carry it."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest

import models_zoo
from partitioner import cli
from partitioner.compiler import compile as compile_artifact


@pytest.fixture(scope="module")
def artifact(tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("benchmem")
    path = tmp / "mlp.onnx"
    onnx.save(models_zoo.build("mlp", batch=8, hidden=1024, layers=4), path)  # ~12 MiB of weights
    return compile_artifact(str(path), "cpu:2", strategy="data", backend="onnxruntime", out_dir=tmp / "art",
                            progress=False)


def test_bench_reports_peak_memory_per_rank(artifact, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "bench.json"
    assert cli.main(["bench", str(artifact.root), "--repeat", "3", "--warmup", "1", "-o", str(out)]) == 0
    text = capsys.readouterr().out
    doc = json.loads(out.read_text())
    weights = sum(np.prod(t.dims) * 4 for t in onnx.load(str(artifact.root / "rank0.onnx")).graph.initializer)
    assert weights > 10 * 2**20
    sim = {r["rank"]: r["peak_memory_bytes"] for r in artifact.manifest["prediction"]["simulated"]["ranks"]}
    rows = doc["memory"]
    assert [r["rank"] for r in rows] == [0, 1]
    for r in rows:
        assert r["measured_bytes"] >= weights, r
        assert r["predicted_bytes"] == sim[r["rank"]]
        assert r["predicted_over_measured"] == pytest.approx(r["predicted_bytes"] / r["measured_bytes"])
        assert f"rank {r['rank']} peak memory: predicted" in text
    assert doc["prediction"]["measured_peak_memory_bytes"] == max(r["measured_bytes"] for r in rows)
    assert doc["prediction"]["predicted_peak_memory_bytes"] == max(sim.values())
