"""Convolution algorithms of the TVM CPU pipeline (backends/tvm/conv_algorithms.py): im2col+GEMM
and Winograd F(4x4, 3x3) give ONNX Runtime's results (seeded inputs, rtol 1e-4, atol 1e-5), are
used exactly where eligible (build facts count them), and ``auto`` picks by measurement and
caches what it measured."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import tvm  # noqa: E402,F401  (a broken install fails, never skips)

import backends.tvm as bt  # noqa: E402
from partitioner.runtime.comm_local import LocalWorld  # noqa: E402

RTOL, ATOL = 1e-4, 1e-5


def _conv_model(kernel: int, stride: int = 1, dilation: int = 1, pads=(1, 1, 1, 1), c: int = 8, co: int = 16,
                hw: int = 10, batch: int = 2) -> onnx.ModelProto:
    rng = np.random.default_rng(kernel * 100 + stride * 10 + dilation)
    w = (rng.standard_normal((co, c, kernel, kernel)) / np.sqrt(c * kernel * kernel)).astype(np.float32)
    b = rng.standard_normal(co).astype(np.float32)
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], name="conv", pads=list(pads), strides=[stride, stride],
                              dilations=[dilation, dilation]),
             helper.make_node("Relu", ["c"], ["y"], name="relu")]
    g = helper.make_graph(nodes, f"conv{kernel}", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, c, hw, hw])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                          [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")])
    m = onnx.shape_inference.infer_shapes(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]))
    onnx.checker.check_model(m, full_check=True)
    return m


CASES = {  # name -> (model kwargs, algorithm used under im2col, under winograd)
    "3x3": ({"kernel": 3}, "im2col", "winograd"),
    "3x3-odd-size": ({"kernel": 3, "hw": 9, "pads": (1, 0, 2, 1)}, "im2col", "winograd"),
    "3x3-stride2": ({"kernel": 3, "stride": 2}, "im2col", "direct"),
    "5x5-dilated": ({"kernel": 5, "dilation": 2, "pads": (4, 4, 4, 4)}, "im2col", "direct"),
    "1x1": ({"kernel": 1, "pads": (0, 0, 0, 0)}, "direct", "direct"),
}


def _run(m: onnx.ModelProto, tmp_path: Path, options: dict) -> tuple[np.ndarray, dict]:
    facts = bt.build(m, tmp_path / "rank0.so", options=options)
    x = np.random.default_rng(7).standard_normal([d.dim_value for d in m.graph.input[0].type.tensor_type.shape.dim])
    x = x.astype(np.float32)
    got = bt.load(m, tmp_path / "rank0.so").run({"x": x}, LocalWorld(1).communicator(0))["y"]
    want = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(["y"], {"x": x})[0]
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)
    return got, facts


@pytest.mark.parametrize("algorithm", ["im2col", "winograd"])
@pytest.mark.parametrize("case", list(CASES))
def test_algorithm_matches_ort_where_eligible(case: str, algorithm: str, tmp_path: Path) -> None:
    kwargs, under_im2col, under_winograd = CASES[case]
    _, facts = _run(_conv_model(**kwargs), tmp_path, {"conv_algorithm": algorithm})
    expected = under_im2col if algorithm == "im2col" else under_winograd
    assert facts["conv_algorithms"] == {expected: 1}


def test_auto_measures_once_and_caches(tmp_path: Path, monkeypatch) -> None:
    import tvm

    from backends.tvm import conv_algorithms as ca
    from backends.tvm.lower import lower_program
    from backends.tvm.pipeline import pre_legalize
    from backends.tvm.target import detect_host_target

    target = tvm.target.Target(detect_host_target())
    m = _conv_model(kernel=3, c=16, co=16, hw=12)
    cache = tmp_path / "db" / ca.CACHE_FILE
    ca._MEASURED.clear()
    facts: dict = {}
    pre_legalize(lower_program(m).mod, target, "auto", cache, facts)
    (chosen, n), = facts["conv_algorithms"].items()
    assert n == 1 and chosen in ("direct", "im2col", "winograd")
    saved = json.loads(cache.read_text())
    (entry,) = saved.values()
    assert entry["fastest"] == chosen and set(entry["seconds"]) == {"direct", "im2col", "winograd"}
    fastest = min(entry["seconds"], key=entry["seconds"].get)  # kept only with a 5% lead over direct
    assert chosen == (fastest if entry["seconds"][fastest] < 0.95 * entry["seconds"]["direct"] else "direct")
    # a fresh process (empty memory cache) reads the file's times instead of measuring again,
    # and chooses from them with the margin in force
    ca._MEASURED.clear()
    entry["seconds"] = {"direct": 1.0, "im2col": 0.9, "winograd": 1.2}  # im2col 10% ahead
    cache.write_text(json.dumps(saved))
    facts2: dict = {}
    pre_legalize(lower_program(m).mod, target, "auto", cache, facts2)
    assert facts2["conv_algorithms"] == {"im2col": 1}
    monkeypatch.setattr(ca, "AUTO_MARGIN", 0.15)  # the same times under a 15% margin: direct
    facts3: dict = {}
    pre_legalize(lower_program(m).mod, target, "auto", cache, facts3)
    assert facts3["conv_algorithms"] == {"direct": 1}
    # an entry without times (an older file) keeps its choice
    ca._MEASURED.clear()
    cache.write_text(json.dumps({k: {"fastest": "im2col"} for k in saved}))
    facts4: dict = {}
    pre_legalize(lower_program(m).mod, target, "auto", cache, facts4)
    assert facts4["conv_algorithms"] == {"im2col": 1}


def test_unknown_algorithm_is_a_backend_error(tmp_path: Path) -> None:
    from partitioner.core.errors import BackendError

    with pytest.raises(BackendError, match="conv_algorithm"):
        bt.build(_conv_model(kernel=3), tmp_path / "rank0.so", options={"conv_algorithm": "fft"})


def test_cli_refuses_conv_algorithm_for_onnxruntime(tmp_path: Path, capsys) -> None:
    from partitioner.cli import main

    rc = main(["compile", "mlp", "--backend", "onnxruntime", "--conv-algorithm", "im2col", "-o", str(tmp_path / "a")])
    assert rc == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--conv-algorithm" in err[0]
