"""Per-segment ONNX Runtime fallback inside a TVM rank (``--fallback onnxruntime``).

The model puts ``LpNormalization`` (an ONNX op missing from apache-tvm 0.27's ONNX convert map; asserted
below, so the test notices when TVM gains it) between supported ops. Outputs are compared with
ONNX Runtime on the unpartitioned model with seeded inputs (rtol 1e-4, atol 1e-5).
"""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from partitioner import cli
from partitioner.core.errors import BackendError

import tvm  # noqa: E402,F401  (a broken install fails, never skips)

RTOL, ATOL = 1e-4, 1e-5
UNSUPPORTED = "LpNormalization"


def _model(batch: int = 4) -> onnx.ModelProto:
    """x[b,16] -> MatMul(16x32) -> Relu -> LpNormalization -> LpNormalization -> MatMul(32x8) -> Add -> y."""
    rng = np.random.default_rng(0)
    w1 = numpy_helper.from_array(rng.standard_normal((16, 32)).astype(np.float32), "w1")
    w2 = numpy_helper.from_array(rng.standard_normal((32, 8)).astype(np.float32), "w2")
    b2 = numpy_helper.from_array(rng.standard_normal((8,)).astype(np.float32), "b2")
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["h1"], name="mm1"),
        helper.make_node("Relu", ["h1"], ["h2"], name="relu1"),
        helper.make_node(UNSUPPORTED, ["h2"], ["h3"], name="lpnorm1", axis=-1),
        helper.make_node(UNSUPPORTED, ["h3"], ["h4"], name="lpnorm2", axis=-1),
        helper.make_node("MatMul", ["h4", "w2"], ["h5"], name="mm2"),
        helper.make_node("Add", ["h5", "b2"], ["y"], name="add2"),
    ]
    graph = helper.make_graph(nodes, "lpnorm_mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, 16])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, 8])], [w1, w2, b2])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model, full_check=True)
    return model


def _feeds(batch: int = 4) -> dict[str, np.ndarray]:
    return {"x": np.random.default_rng(1).standard_normal((batch, 16)).astype(np.float32)}


def _ort(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> np.ndarray:
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(["y"], feeds)[0]


def test_lpnormalization_is_missing_from_tvms_importer() -> None:
    from tvm.relax.frontend.onnx.onnx_frontend import _get_convert_map

    assert UNSUPPORTED not in _get_convert_map()


@pytest.mark.parametrize("strategy", ["data", "pipeline"])
def test_fallback_runs_only_the_unsupported_segment_under_ort(strategy: str, tmp_path) -> None:
    from partitioner.compiler import compile as compile_artifact, load_artifact
    from partitioner.runtime.launch import run_in_process

    model = _model()
    art = compile_artifact(model, "cpu:2", strategy=strategy, backend="tvm", fallback="onnxruntime",
                           out_dir=tmp_path / "art", jobs=1, progress=False)
    m = art.manifest
    assert m["backend"] == "tvm"
    assert m["fallback"]["scope"] == "segments" and "LpNormalization" in m["fallback"]["reason"]
    segs = m["fallback"]["segments"]
    assert segs, m["fallback"]
    for s in segs:
        # only the two LpNormalization nodes fall back; MatMul/Relu/Add stay in TVM
        assert s["op_types"] == ["LpNormalization"] and set(s["nodes"]) <= {"lpnorm1", "lpnorm2"}
        assert s["file"] == f"rank{s['rank']}.seg{s['segment']}.onnx" and s["file"] in m["files"]
        seg_model = onnx.load(str(art.root / s["file"]))
        assert {n.op_type for n in seg_model.graph.node} == {"LpNormalization"}
    assert {n for s in segs for n in s["nodes"]} == {"lpnorm1", "lpnorm2"}
    for i in range(2):
        assert (art.root / f"rank{i}.so").is_file()
    feeds = _feeds()
    got, _ = run_in_process(load_artifact(art.root), feeds, timeout=120)
    np.testing.assert_allclose(got["y"], _ort(model, feeds), rtol=RTOL, atol=ATOL)


def test_loader_reads_the_segment_files_instead_of_recutting(tmp_path, monkeypatch) -> None:
    """An artifact keeps running when the code that cuts programs into segments changes: the
    loader takes each segment's inputs and outputs from its rank<i>.seg<k>.onnx file."""
    from backends.tvm import fallback
    from partitioner.compiler import compile as compile_artifact, load_artifact
    from partitioner.runtime.launch import run_in_process

    model = _model()
    art = compile_artifact(model, "cpu:2", strategy="pipeline", backend="tvm", fallback="onnxruntime",
                           out_dir=tmp_path / "art", jobs=1, progress=False)

    def recut(*_args, **_kwargs):
        raise AssertionError("the loader re-derived the fallback segments")

    monkeypatch.setattr(fallback, "ort_segments", recut)
    monkeypatch.setattr(fallback, "split_with_fallback", recut)
    feeds = _feeds()
    got, _ = run_in_process(load_artifact(art.root), feeds, timeout=120)
    np.testing.assert_allclose(got["y"], _ort(model, feeds), rtol=RTOL, atol=ATOL)


def test_without_fallback_the_build_fails_listing_the_op(tmp_path) -> None:
    from partitioner.compiler import compile as compile_artifact

    with pytest.raises(BackendError) as info:
        compile_artifact(_model(), "cpu:2", strategy="data", backend="tvm", out_dir=tmp_path / "art", jobs=1,
                         progress=False)
    msg = str(info.value)
    assert "\n" not in msg and "LpNormalization" in msg and "lpnorm1" in msg and "lpnorm2" in msg
    assert not (tmp_path / "art").exists()


def test_fallback_segment_failure_is_a_clean_run_error(tmp_path) -> None:
    """A segment file that ORT cannot run at run time (shape mismatch fed by a tampered input)
    surfaces as one RunFailed line naming the rank, not a TVM traceback."""
    from partitioner.compiler import compile as compile_artifact
    from partitioner.core.errors import InputError, RunFailed

    art = compile_artifact(_model(), "cpu:2", strategy="pipeline", backend="tvm", fallback="onnxruntime",
                           out_dir=tmp_path / "art", jobs=1, progress=False)
    with pytest.raises((InputError, RunFailed)):
        art.run({"x": np.zeros((4, 15), np.float32)}, in_process=True)


def test_cli_compile_prints_the_fallback_segments(tmp_path, capsys) -> None:
    path = tmp_path / "lpnorm.onnx"
    onnx.save(_model(), path)
    out = tmp_path / "art"
    rc = cli.main(["compile", str(path), "-o", str(out), "--devices", "2", "--strategy", "pipeline",
                   "--backend", "tvm", "--fallback", "onnxruntime", "--jobs", "1"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    assert "LpNormalization" in captured.out and "lpnorm1" in captured.out and "segment" in captured.out
    np.savez(tmp_path / "in.npz", **_feeds())
    capsys.readouterr()
    rc = cli.main(["run", str(out), "--inputs", str(tmp_path / "in.npz"), "--check", "--json"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    assert json.loads(captured.out)["check"]["ok"]
