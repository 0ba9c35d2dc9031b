"""float32 Erf, Tanh, Sigmoid, Exp and Softmax go to TOPI's vectorisable fast versions on the CPU
(backends/tvm/pipeline.py, ``_fast_math_map``); results stay within rtol 1e-5 / atol 1e-6 of
ONNX Runtime on seeded inputs that include saturating magnitudes and fully masked (-inf)
softmax positions, and other dtypes keep TVM's exact legalization (float64 Erf against scipy)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

import tvm  # noqa: E402,F401  (a broken install fails, never skips)

import backends.tvm as bt  # noqa: E402
from partitioner.runtime.comm_local import LocalWorld  # noqa: E402


def _model(op: str, dtype: int, **attrs) -> onnx.ModelProto:
    g = helper.make_graph([helper.make_node(op, ["x"], ["y"], **attrs)], f"fast_{op}",
                          [helper.make_tensor_value_info("x", dtype, [4, 3, 64])],
                          [helper.make_tensor_value_info("y", dtype, [4, 3, 64])])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def _inputs(np_dtype) -> np.ndarray:
    x = np.random.default_rng(0).standard_normal((4, 3, 64)) * 3
    x[0, 0, :8] = [-50, -10, -4.5, -1e-6, 0, 1e-6, 10, 50]  # saturation and tiny values
    x[1, 2, :10] = -np.inf  # masked positions (softmax)
    return x.astype(np_dtype)


@pytest.mark.parametrize(("op", "attrs"), [("Erf", {}), ("Tanh", {}), ("Sigmoid", {}), ("Exp", {}),
                                         ("Softmax", {"axis": -1})])
def test_fast_versions_match_ort(op: str, attrs: dict, tmp_path: Path) -> None:
    import tvm

    from backends.tvm.lower import lower_program
    from backends.tvm.pipeline import run_pipeline
    from backends.tvm.target import detect_host_target

    m = _model(op, TensorProto.FLOAT, **attrs)
    x = _inputs(np.float32)
    if op not in ("Softmax", "Exp"):
        x[1, 2, :10] = 0.5  # Erf/Tanh of -inf is not what this test is about
    mod = run_pipeline(lower_program(m).mod, "scheduled", tvm.target.Target(detect_host_target()))
    assert any("fast_" in gv.name_hint for gv, _ in mod.functions_items()), [gv.name_hint for gv, _ in mod.functions_items()]
    bt.build(m, tmp_path / "rank0.so")
    got = bt.load(m, tmp_path / "rank0.so").run({"x": x}, LocalWorld(1).communicator(0))["y"]
    want = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(["y"], {"x": x})[0]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_float64_keeps_the_exact_legalization(tmp_path: Path) -> None:
    import tvm

    from backends.tvm.lower import lower_program
    from backends.tvm.pipeline import run_pipeline
    from backends.tvm.target import detect_host_target

    m = _model("Erf", TensorProto.DOUBLE)
    mod = run_pipeline(lower_program(m).mod, "scheduled", tvm.target.Target(detect_host_target()))
    assert not any("fast_" in gv.name_hint for gv, _ in mod.functions_items())
    x = _inputs(np.float64)
    x[1, 2, :10] = 0.5
    bt.build(m, tmp_path / "rank0.so")
    got = bt.load(m, tmp_path / "rank0.so").run({"x": x}, LocalWorld(1).communicator(0))["y"]
    from scipy.special import erf  # ONNX Runtime has no float64 Erf kernel

    np.testing.assert_allclose(got, erf(x), rtol=1e-12, atol=1e-14)


def test_fast_exp_keeps_the_float32_range(tmp_path: Path) -> None:
    """TOPI's fast_exp clamps its input at 88.376; exp up to float32's overflow (88.72) stays
    finite (pipeline.EXP_SHIFT_FROM), beyond it inf, NaN stays NaN, as ONNX Runtime gives."""
    m = _model("Exp", TensorProto.FLOAT)
    x = _inputs(np.float32)
    x[2, 0, :9] = [88.0, 88.2, 88.38, 88.5, 88.72, 88.73, 100.0, np.nan, -87.0]
    bt.build(m, tmp_path / "rank0.so")
    got = bt.load(m, tmp_path / "rank0.so").run({"x": x}, LocalWorld(1).communicator(0))["y"]
    sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    want = sess.run(["y"], {"x": x})[0]
    assert np.isfinite(got[2, 0, :5]).all() and np.isinf(got[2, 0, 5:7]).all() and np.isnan(got[2, 0, 7])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
