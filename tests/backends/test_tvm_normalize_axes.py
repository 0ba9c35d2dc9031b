"""``backends.tvm.normalize_axes``: negative ``Squeeze``/``Unsqueeze`` axes through TVM's build.

TVM 0.27's ConvertLayout died with ``std::bad_alloc`` on ``squeeze(x, axis=[-1])`` (silero-vad's
decoder). Each case is compiled with the TVM backend and compared with ONNX Runtime (exact:
squeeze/unsqueeze only move data; the Relu in front keeps the op inside a real kernel)."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

CASES = [("Squeeze", [-1], [1, 6, 1]), ("Squeeze", [-3, -1], [1, 6, 1]),
         ("Unsqueeze", [-1], [2, 6]), ("Unsqueeze", [0, -1], [2, 6])]


def _out_shape(op: str, axes: list[int], shape: list[int]) -> list[int]:
    if op == "Squeeze":
        return [d for i, d in enumerate(shape) if i not in {a % len(shape) for a in axes}]
    out = list(shape)
    for a in sorted(a % (len(shape) + len(axes)) for a in axes):
        out.insert(a, 1)
    return out


def _model(op: str, axes: list[int], shape: list[int]) -> onnx.ModelProto:
    nodes = [helper.make_node("Relu", ["x"], ["r"]), helper.make_node(op, ["r", "axes"], ["y"]),
             helper.make_node("Add", ["y", "y"], ["z"])]
    g = helper.make_graph(nodes, "axes", [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
                          [helper.make_tensor_value_info("z", TensorProto.FLOAT, _out_shape(op, axes, shape))],
                          [numpy_helper.from_array(np.array(axes, np.int64), "axes")])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 16)])


def test_module_rewrite_wraps_negative_axes():
    from backends.tvm.lower import lower_program
    from backends.tvm.normalize_axes import normalize_axes

    mod = normalize_axes(lower_program(_model("Squeeze", [-3, -1], [1, 6, 1])).mod)
    text = mod.script()
    assert "axis=[0, 2]" in text and "-1" not in text.split("squeeze")[1].split(")")[0]


@pytest.mark.parametrize("op,axes,shape", CASES, ids=[f"{c[0]}{c[1]}" for c in CASES])
def test_negative_axes_build_and_match_ort(tmp_path, op, axes, shape):
    from partitioner.compiler import compile as compile_artifact, load_artifact
    from partitioner.runtime.launch import run_in_process

    m = _model(op, axes, shape)
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    want = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    art = compile_artifact(m, "cpu:1", backend="tvm", out_dir=tmp_path / "art", jobs=1, progress=False)
    got, _ = run_in_process(load_artifact(art.root), {"x": x}, timeout=300)
    assert got["z"].shape == want.shape
    np.testing.assert_array_equal(got["z"], want)
