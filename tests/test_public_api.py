"""The README's Python API example, run as written (with the zoo mlp)."""

from __future__ import annotations

import numpy as np
import onnx

import models_zoo
import partitioner
from passes import run_pipeline


def test_readme_python_api(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    onnx.save(models_zoo.build("mlp", batch=2, hidden=32, layers=2), "mlp.onnx")

    model = run_pipeline(partitioner.load("mlp.onnx", batch=2))
    cluster = partitioner.Cluster.resolve("cpu:2")
    result = partitioner.auto_partition(model, cluster)
    assert result.explanation.startswith("auto chose") and result.alternatives
    assert result.plan.world_size in (1, 2)

    art = partitioner.compile("mlp.onnx", cluster="cpu:2", strategy="pipeline", target="host")
    art.save("art/")
    x = np.random.default_rng(0).standard_normal((2, 128)).astype(np.float32)
    out = partitioner.load_artifact("art/").run({"input": x}, check=True, in_process=True)
    assert out.check is not None and out.check.ok
    assert out.outputs["logits"].shape == (2, 10)


def test_lazy_exports_exist():
    for name in partitioner.__all__:
        assert getattr(partitioner, name) is not None, name
