"""`partitioner compile` backend options: TVM pipeline choice and tuning flags reach the build."""

from __future__ import annotations

import json

import onnx
import pytest

import models_zoo
from partitioner.cli import main


@pytest.fixture
def mlp(tmp_path):
    path = tmp_path / "mlp.onnx"
    onnx.save(models_zoo.build("mlp", hidden=32, layers=2), path)
    return path


def test_tvm_pipeline_option_reaches_the_build(mlp, tmp_path):
    out = tmp_path / "art"
    assert main(["compile", str(mlp), "-o", str(out), "--tvm-pipeline", "zero"]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert [r["build"]["pipeline"] for r in manifest["ranks"]] == ["zero"]
    assert main(["run", str(out), "--check", "--in-process"]) == 0


@pytest.mark.parametrize("argv,message", [
    (["--tune-trials", "8"], "--tuning-db"),
    (["--tune-trials", "0", "--tuning-db", "db"], "N >= 1"),
    (["--backend", "onnxruntime", "--tuning-db", "db"], "--backend tvm only"),
])
def test_bad_tuning_options_exit_2(mlp, tmp_path, capsys, argv, message):
    assert main(["compile", str(mlp), "-o", str(tmp_path / "art"), *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_target_option_forms(mlp, tmp_path, capsys):
    """--target takes a preset name or TVM's JSON target dict; a bad one is one line, exit 2."""
    assert main(["compile", str(mlp), "-o", str(tmp_path / "a"), "--target", "host"]) == 0
    out = tmp_path / "b"
    assert main(["compile", str(mlp), "-o", str(out), "--target", '{"kind": "llvm", "mcpu": "x86-64"}']) == 0
    assert json.loads((out / "manifest.json").read_text())["target"]["mcpu"] == "x86-64"
    assert main(["run", str(out), "--check", "--in-process"]) == 0
    capsys.readouterr()
    assert main(["compile", str(mlp), "-o", str(tmp_path / "c"), "--target", "{bad"]) == 2
    err = capsys.readouterr().err
    assert "not valid JSON" in err and err.count("\n") == 1
