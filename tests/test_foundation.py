"""Issue 2's promises end to end: zoo models survive load -> default passes -> save, and
`partitioner inspect --json` works on every zoo and light model."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest

import models_zoo
from partitioner.cli import main
from partitioner.load import load
from passes import run_pipeline

SMALL = {
    "mlp": {}, "resnet": {"image": 32, "width": 16}, "resnet50": {"image": 32, "width": 8},
    "bert": {"seq": 8}, "gpt": {"seq": 8}, "unet": {"image": 32, "base": 8},
    "inception": {"image": 32}, "mobilenet": {"image": 32, "width_mult": 0.5},
    "llama": {"seq": 8},
}
BUILDERS = [e.name for e in models_zoo.list_models() if e.kind == "builder"]
LIGHT = [e.name for e in models_zoo.list_models() if e.kind == "light"]


def _feeds(proto: onnx.ModelProto, seed: int = 0) -> dict[str, np.ndarray]:
    return models_zoo.sample_inputs(proto, seed)


def _ort(proto: onnx.ModelProto, feeds) -> list[np.ndarray]:
    sess = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


def test_all_builders_are_covered():
    assert set(BUILDERS) <= set(SMALL), "add new zoo builders to SMALL"


@pytest.mark.parametrize("name", BUILDERS)
def test_zoo_model_survives_load_passes_save(name, tmp_path):
    proto = models_zoo.build(name, **SMALL[name])
    onnx.checker.check_model(proto, full_check=True)
    path = tmp_path / f"{name}.onnx"
    onnx.save(proto, path)
    feeds = _feeds(proto)
    before = _ort(proto, feeds)

    optimized = run_pipeline(load(path))
    out_path = tmp_path / f"{name}.opt.onnx"
    onnx.save(ir.serde.serialize_model(optimized), out_path)
    reloaded = onnx.load(out_path)
    onnx.checker.check_model(reloaded, full_check=True)
    after = _ort(reloaded, feeds)
    assert len(before) == len(after)
    for a, b in zip(before, after):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5)


def test_light_model_weights_are_materialised_and_match():
    proto = models_zoo.build("light_squeezenet")
    feeds = _feeds(proto)
    before = _ort(proto, feeds)
    optimized = ir.serde.serialize_model(run_pipeline(load("light_squeezenet")))
    assert not any(n.op_type == "ConstantOfShape" for n in optimized.graph.node)
    np.testing.assert_allclose(_ort(optimized, feeds)[0], before[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", BUILDERS + LIGHT)
def test_inspect_json_on_every_zoo_and_light_model(name, capsys, tmp_path):
    if name in SMALL:
        path = tmp_path / f"{name}.onnx"
        onnx.save(models_zoo.build(name, **SMALL[name]), path)
        target = str(path)
    else:  # inspect reads structure only: the shipped file, not the seeded random weights
        path = tmp_path / f"{name}.onnx"
        onnx.save(models_zoo.build(name, weights="as_shipped"), path)
        target = str(path)
    assert main(["inspect", target, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    for key in ("op_histogram", "param_count", "param_bytes", "total_flops", "total_bytes", "work", "depth",
                "parallelism", "peak_activation_bytes", "ops", "inputs", "outputs"):
        assert key in report, key
    assert report["total_flops"] > 0 and report["depth"] >= 1
    assert report["parallelism"] == pytest.approx(report["work"] / report["depth"])
    assert sum(report["op_histogram"].values()) == report["num_nodes"] == len(report["ops"])


def test_light_resnet50_flops_match_the_paper():
    """ResNet-50 at 224x224: 4.09 G multiply-adds in conv+gemm, about 8.2 GFLOPs in all."""
    from partitioner.commands.inspect import inspect_model

    report = inspect_model(run_pipeline(load("light_resnet50")))
    macs = sum(o["flops"] for o in report["ops"] if o["op_type"] in ("Conv", "Gemm")) / 2
    assert macs == pytest.approx(4.09e9, rel=0.02)
    assert report["total_flops"] == pytest.approx(8.2e9, rel=0.03)
    assert report["param_count"] == pytest.approx(25.5e6, rel=0.02)


def test_cli_bad_input_is_one_line_exit_2(tmp_path):
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"not a model")
    proc = subprocess.run([sys.executable, "-m", "partitioner.cli", "inspect", str(bad)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    assert "not an ONNX model" in proc.stderr


def test_cli_version_names_the_package_version(capsys):
    import partitioner
    from partitioner.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == f"partitioner {partitioner.__version__}"


def test_symbolic_batch_is_bound_by_option(tmp_path, capsys):
    path = tmp_path / "gpt.onnx"
    onnx.save(models_zoo.build("gpt", seq=8, symbolic_batch=True), path)
    assert main(["inspect", str(path), "--json"]) == 2
    assert "--batch" in capsys.readouterr().err
    assert main(["inspect", str(path), "--json", "--batch", "3"]) == 0
    assert json.loads(capsys.readouterr().out)["inputs"][0]["shape"] == [3, 8]
    assert main(["inspect", str(path), "--json", "--shape", "input_ids=2,8"]) == 0
    assert json.loads(capsys.readouterr().out)["inputs"][0]["shape"] == [2, 8]


def test_sample_inputs_keep_token_ids_inside_the_embedding_table():
    proto = models_zoo.build("gpt", seq=8, vocab=7, batch=3)
    feeds = models_zoo.sample_inputs(proto, seed=1)
    ids = feeds["input_ids"]
    assert ids.shape == (3, 8) and ids.dtype == np.int64
    assert ids.min() >= 0 and ids.max() < 7 and len(np.unique(ids)) > 2
    again = models_zoo.sample_inputs(proto, seed=1)
    assert all(np.array_equal(feeds[k], again[k]) for k in feeds)
