"""Conformance accounting (tests/conformance/cases.py rule 4, run_conformance.py):

- ``refused`` only when an op or dtype is listed as unsupported before anything is built; a TVM
  build failure, a pass or shape-inference failure, a library that fails to load or a failed run
  is an ``error`` with its kind;
- the fallback row uses the product's per-segment ONNX Runtime fallback;
- the table counts passes that compiled with shape inputs baked in as constants.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from partitioner.core.errors import (BackendError, ModelLoadError, PassError, PlanError, RunFailed,
                                StrategyNotApplicable, UnsupportedByBackendError, UnsupportedOpError)

from .cases import classify_failure, reason_is_refusal, run_case
from .run_conformance import markdown_table


@dataclass
class _Case:  # the fields of onnx's TestCase that run_case reads
    name: str
    model: onnx.ModelProto
    data_sets: list[tuple[list[np.ndarray], list[np.ndarray]]]
    rtol: float = 1e-3
    atol: float = 1e-7


def _lp_norm_case() -> _Case:
    """LpNormalization (p=1, axis=-1): TVM's importer has no converter for it."""
    x = np.array([[1.0, -3.0, 4.0], [0.5, 0.5, -1.0]], dtype=np.float32)
    y = x / np.sum(np.abs(x), axis=-1, keepdims=True)
    g = helper.make_graph([helper.make_node("LpNormalization", ["x"], ["y"], p=1, axis=-1)], "lp",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])])
    return _Case("test_lp_case", helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), [([x], [y])])


@pytest.mark.parametrize(("exc", "status", "kind"), [
    (UnsupportedByBackendError("graph 'g': TVM cannot import 1 node(s) of op type(s) Loop"), "refused", "unsupported"),
    (UnsupportedOpError("m: 1 unsupported operator(s): NoSuchOp"), "refused", "unsupported"),
    (StrategyNotApplicable("no strategy splits this model"), "refused", "strategy"),
    (BackendError("graph 'g': TVM build failed for target {...} (Check failed)"), "error", "tvm-build"),
    (BackendError("graph 'g': TVM's ONNX importer failed on segment 0 (TypeError)"), "error", "tvm-import"),
    (BackendError("/tmp/x/rank0.so: TVM cannot load this library"), "error", "library-load"),
    (PassError("pass 'shape_inference' failed (after: ...)"), "error", "shape-inference"),
    (PassError("pass 'fold_conv_batchnorm' failed"), "error", "pass"),
    (ModelLoadError("m: shape inference failed: [ShapeInferenceError]"), "error", "shape-inference"),
    (RunFailed("rank 0: rank0.so failed: Unsupported input dtype: uint64"), "error", "run"),
    (PlanError("value 'x' has no layout"), "error", "plan"),
    (ValueError("a bug"), "error", "bug"),
])
def test_classify_failure(exc: BaseException, status: str, kind: str) -> None:
    assert classify_failure(exc) == (status, kind)


def test_unsupported_op_is_refused_and_fallback_runs_only_that_segment() -> None:
    case = _lp_norm_case()
    tvm, _ = run_case(case, ranks=1)
    assert (tvm.status, tvm.kind) == ("refused", "unsupported") and "LpNormalization" in tvm.reason
    fb, exc = run_case(case, ranks=1, fallback="onnxruntime")
    assert fb.status == "pass", fb.reason
    assert fb.engine == "tvm+onnxruntime-segments"  # the product's per-segment fallback, not a whole ORT run


def test_a_failure_inside_the_pipeline_is_an_error_not_a_refusal() -> None:
    """A Reshape of 6 elements to 5: nothing lists it as unsupported up front, the pipeline fails
    on it (TVM's importer, today), so it is an error with its kind, never a clean refusal."""
    g = helper.make_graph([helper.make_node("Reshape", ["x", "s"], ["y"])], "bad_reshape",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [5])],
                          [helper.make_tensor("s", TensorProto.INT64, [1], [5])])
    case = _Case("test_bad_reshape", helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]),
                 [([np.zeros((2, 3), np.float32)], [np.zeros(5, np.float32)])])
    result, _ = run_case(case, ranks=1)
    assert result.status == "error" and result.kind in ("tvm-import", "shape-inference", "load"), result


def _report(fmt: str, **extra: Any) -> dict[str, Any]:
    return {"format": fmt, "selection": "sample", "versions": {"onnx": "1", "tvm": "0"}, "cases_skipped_by_filter": 0,
            "cases_selected": 10, "op_count": 5, "supported_op_count": {"tvm": 2, "fallback": 3},
            "pass_with_specialised_shape_inputs": {"tvm": 1, "fallback": 2}, **extra}


def test_markdown_counts_errors_apart_and_baked_shape_inputs() -> None:
    report = _report("partitioner.conformance/2",
                     totals={"tvm": {"pass": 4, "refused": 3, "error": 2, "mismatch": 1},
                             "fallback": {"pass": 6, "error": 3, "mismatch": 1}},
                     errors_by_kind={"tvm": {"tvm-build": 1, "shape-inference": 1}, "fallback": {"run": 3}},
                     pass_by_engine={"fallback": {"tvm": 4, "tvm+onnxruntime-segments": 2}})
    table = markdown_table(report)
    assert "| 1 rank, TVM only | 4 / 10 | 1 | 2 / 5 | 0 | 2 | 3 | 1 |" in table
    assert "| 1 rank, TVM + ONNX Runtime fallback (per segment) | 6 / 10 | 2 | 3 / 5 | 0 | 3 | 0 | 1 |" in table
    assert "tvm-build 1" in table and "tvm+onnxruntime-segments 2" in table


def test_markdown_rederives_the_split_for_format_1_runs() -> None:
    """Format 1 counted every PartitionerError as refused; the table re-derives the split from the
    recorded reasons and labels the old whole-program fallback row."""
    refusals = [{"reason": "BackendError: graph 'a': TVM cannot import 1 node(s) of op type(s) X"},
                {"reason": "BackendError: graph 'b': TVM build failed for target {}"},
                {"reason": "PassError: pass 'shape_inference' failed"}]
    report = _report("partitioner.conformance/1", totals={"tvm": {"pass": 6, "refused": 3, "mismatch": 1}},
                     refusals={"tvm": refusals})
    table = markdown_table(report)
    assert "| 1 rank, TVM only | 6 / 10 | 1 | 2 / 5 | 0 | 2 | 1 | 1 |" in table
    assert "predates the split" in table
    assert [reason_is_refusal(r["reason"]) for r in refusals] == [True, False, False]
