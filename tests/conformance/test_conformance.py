"""ONNX node conformance, fast subset: a fixed sample of common-op cases must pass through the
whole pipeline (load -> passes -> TVM, 1 rank), driven by ``onnx.backend.test.BackendTest``,
which compares every output with the case's expected outputs under the case's own rtol/atol.

The full suite (1,884 cases, 1 and 2 ranks, ORT fallback) is
``.venv/bin/python tests/conformance/run_conformance.py --full``; it writes
``benchmarks/results/conformance.json``.
"""

from __future__ import annotations

import unittest
import warnings

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import tvm  # noqa: E402,F401  (a broken install fails, never skips)

import onnx.backend.test  # noqa: E402

from partitioner.core.errors import BackendError, PartitionerError  # noqa: E402

from .backend import PartitionerBackend, shape_inputs  # noqa: E402
from .cases import FilterRule, read_filter, skip_reason  # noqa: E402
from .run_conformance import SAMPLE  # noqa: E402

# Known failures inside the sample, each with its cause; expectedFailure makes a fix visible
# (an unexpected success fails the run, so the entry is then removed).
KNOWN_FAILURES = {
    "test_layer_normalization_2d_axis1": "refused (backends/tvm/op_support.py): TVM's importer returns only Y, not Mean/InvStdDev",
    "test_layer_normalization_4d_axis_negative_1": "refused (backends/tvm/op_support.py): TVM's importer returns only Y, not Mean/InvStdDev",
}


def _sample_tests() -> type[unittest.TestCase]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        bt = onnx.backend.test.BackendTest(PartitionerBackend, __name__)
    node_tests = bt.test_cases["OnnxBackendNodeModelTest"]
    wanted = {f"{name}_cpu" for name in SAMPLE}
    attrs = {}
    for attr in sorted(wanted):
        func = getattr(node_tests, attr, None)
        if func is None:
            raise AssertionError(f"conformance sample case {attr!r} is not in the installed onnx")
        if attr[: -len("_cpu")] in KNOWN_FAILURES:
            func = unittest.expectedFailure(func)
        attrs[attr] = func
    return type("TestConformanceSample", (unittest.TestCase,), attrs)


TestConformanceSample = _sample_tests()


def test_sample_covers_common_ops() -> None:
    names = " ".join(SAMPLE)
    for op in ("add", "matmul", "conv", "relu", "softmax", "gemm", "reshape", "transpose", "concat",
               "batchnorm", "maxpool", "layer_normalization"):
        assert f"test_{op}" in names, op
    assert 55 <= len(SAMPLE) <= 70


def test_unsupported_op_is_a_clean_refusal() -> None:
    """A Loop is valid ONNX but TVM's importer has no converter: one BackendError listing it. Its
    condition is computed from the data (sum(acc) < 1e9), so ``passes/unroll_loop.py`` (fixed trip
    counts only) leaves it a Loop."""
    body = helper.make_graph(
        [helper.make_node("Add", ["acc_in", "one"], ["acc_out"]),
         helper.make_node("ReduceSum", ["acc_out"], ["total"], keepdims=0),
         helper.make_node("Less", ["total", "limit"], ["cond_out"])],
        "body",
        [helper.make_tensor_value_info("i", TensorProto.INT64, []),
         helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
         helper.make_tensor_value_info("acc_in", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
         helper.make_tensor_value_info("acc_out", TensorProto.FLOAT, [2])],
        initializer=[helper.make_tensor("one", TensorProto.FLOAT, [2], [1.0, 1.0]),
                     helper.make_tensor("limit", TensorProto.FLOAT, [], [1e9])],
    )
    graph = helper.make_graph(
        [helper.make_node("Loop", ["n", "cond", "x"], ["y"], body=body)],
        "loop_model",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])],
        initializer=[helper.make_tensor("n", TensorProto.INT64, [], [3]),
                     helper.make_tensor("cond", TensorProto.BOOL, [], [True])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    with pytest.raises(BackendError, match=r"TVM cannot import 1 node\(s\) of op type\(s\) Loop"):
        PartitionerBackend.prepare(model, "CPU")

    # the product's per-segment fallback runs the Loop under ONNX Runtime inside the TVM rank;
    # hand-computed: x + 3 * 1
    rep = PartitionerBackend.prepare(model, "CPU", fallback="onnxruntime")
    assert rep.engine == "tvm+onnxruntime-segments"
    x = np.array([0.5, -2.0], dtype=np.float32)
    np.testing.assert_allclose(rep.run([x])[0], x + 3.0, rtol=0, atol=1e-6)


def test_invalid_model_is_a_clean_refusal() -> None:
    """An unknown operator is refused by the loader with the op named, before TVM runs."""
    graph = helper.make_graph([helper.make_node("NoSuchOp", ["x"], ["y"])], "bad",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    with pytest.raises(PartitionerError, match="NoSuchOp"):
        PartitionerBackend.prepare(model, "CPU")


def test_two_ranks_split_and_match() -> None:
    """A batch-4 Gemm-free model (Relu then Add of a broadcast bias) splits over 2 ranks (data
    parallel) and matches numpy."""
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["r"]), helper.make_node("Mul", ["r", "w"], ["y"])],
        "two_rank", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 8])],
        initializer=[helper.make_tensor("w", TensorProto.FLOAT, [8], list(np.linspace(-1, 1, 8)))],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    rep = PartitionerBackend.prepare(model, "CPU", ranks=2)
    x = np.random.default_rng(7).standard_normal((4, 8)).astype(np.float32)
    (y,) = rep.run([x])
    assert rep.compiled.bindings is not None and rep.compiled.bindings.world_size == 2
    np.testing.assert_allclose(y, np.maximum(x, 0) * np.linspace(-1, 1, 8).astype(np.float32), rtol=1e-6, atol=1e-6)


def test_shape_inputs_are_found() -> None:
    graph = helper.make_graph([helper.make_node("Reshape", ["x", "s"], ["y"])], "r",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3]),
                               helper.make_tensor_value_info("s", TensorProto.INT64, [2])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 2])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    assert shape_inputs(model) == ("s",)
    rep = PartitionerBackend.prepare(model, "CPU")
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    (y,) = rep.run([x, np.array([3, 2], dtype=np.int64)])
    np.testing.assert_array_equal(y, x.reshape(3, 2))
    assert rep.specialised == ("s",)


def test_filter_file_parses_with_reasons() -> None:
    rules = read_filter()
    assert rules, "filter.txt lists the cases refused by design"
    assert all(r.reason != "no reason given" for r in rules)
    assert skip_reason("test_ai_onnx_ml_binarizer", rules)
    assert skip_reason("test_add", rules) is None
    assert skip_reason("test_x", (FilterRule(r"^test_x$", "why"),)) == "why"


@pytest.mark.slow
def test_runner_survives_a_crashing_case(tmp_path, monkeypatch) -> None:
    """A worker that dies mid-case (abort, as a segfault would) costs that case only: it is
    recorded as ``crash`` and a fresh worker runs the rest."""
    import json

    from .run_conformance import CRASH_ENV, main

    monkeypatch.setenv(CRASH_ENV, "test_abs")
    out = tmp_path / "c.json"
    assert main(["--only", r"^test_(abs|neg|relu)$", "--ranks", "1", "--fallback", "none", "--jobs", "1",
                 "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["totals"]["tvm"] == {"crash": 1, "pass": 2}
    assert report["crashes_and_errors"]["tvm"][0]["name"] == "test_abs"
    assert report["worker_restarts"] == 1
