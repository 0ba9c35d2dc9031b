"""``compile`` through the real partitioner (zoo MLP), then verify and run with ``--check``.

The check compares against ONNX Runtime on the source model (rtol 1e-4, atol 1e-5).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from partitioner import cli

import partitioner.partition  # noqa: E402,F401  (a broken install fails, never skips)


@pytest.fixture(scope="module")
def mlp(tmp_path_factory) -> tuple[Path, Path]:
    from models_zoo import build

    d = tmp_path_factory.mktemp("mlp")
    import onnx

    model = build("mlp", batch=4)
    onnx.save(model, d / "mlp.onnx")
    rng = np.random.default_rng(0)
    feeds = {}
    inits = {i.name for i in model.graph.initializer}
    for i in model.graph.input:
        if i.name not in inits:
            feeds[i.name] = rng.standard_normal([x.dim_value for x in i.type.tensor_type.shape.dim]).astype(np.float32)
    np.savez(d / "in.npz", **feeds)
    return d / "mlp.onnx", d / "in.npz"


def _compile(model: Path, out: Path, *extra: str) -> int:
    return cli.main(["compile", str(model), "-o", str(out), "--devices", "2", "--backend", "onnxruntime", *extra])


def test_compile_is_reproducible(mlp, tmp_path):
    model, _ = mlp
    for d in ("a", "b"):
        assert _compile(model, tmp_path / d, "--strategy", "tensor") == 0
    files = sorted(p.name for p in (tmp_path / "a").iterdir())
    assert {"manifest.json", "plan.json", "source.onnx", "rank0.onnx", "rank1.onnx"} <= set(files)
    for name in files:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
    m = json.loads((tmp_path / "a" / "manifest.json").read_text())
    assert m["plan_summary"]["strategy"] == "tensor" and m["world_size"] == 2
    assert cli.main(["verify", str(tmp_path / "a")]) == 0


def test_compile_pipeline_then_run_check(mlp, tmp_path, capsys):
    model, inputs = mlp
    out = tmp_path / "pp"
    assert _compile(model, out, "--strategy", "pipeline", "--microbatches", "2") == 0
    assert json.loads((out / "manifest.json").read_text())["microbatches"] == 2
    capsys.readouterr()
    rc = cli.main(["run", str(out), "--inputs", str(inputs), "--check", "--json"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    assert json.loads(captured.out)["check"]["ok"]


def test_python_api_compile_and_in_process_run(mlp, tmp_path):
    import partitioner.artifact as pa
    from partitioner.compiler import compile as compile_artifact

    model, inputs = mlp
    art = compile_artifact(str(model), "cpu:2", strategy="tensor", backend="onnxruntime", out_dir=tmp_path / "api")
    with np.load(inputs, allow_pickle=False) as data:
        feeds = {k: data[k] for k in data.files}
    result = art.run(feeds, in_process=True, check=True)
    assert result.check.ok, result.check.to_json()
    saved = art.save(tmp_path / "saved")
    assert pa.verify_artifact(saved.root)["manifest_sha256"] == art.manifest["manifest_sha256"]


@pytest.mark.slow
def test_tvm_tensor_run_check(mlp, tmp_path, capsys):
    model, inputs = mlp
    out = tmp_path / "tvm"
    assert cli.main(["compile", str(model), "-o", str(out), "--devices", "2", "--strategy", "tensor"]) == 0
    assert (out / "rank1.so").exists()
    assert cli.main(["run", str(out), "--inputs", str(inputs), "--check"]) == 0
    data = bytearray((out / "rank1.so").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (out / "rank1.so").write_bytes(bytes(data))
    capsys.readouterr()
    assert cli.main(["run", str(out), "--inputs", str(inputs)]) == 2
    assert "rank1.so" in capsys.readouterr().err
