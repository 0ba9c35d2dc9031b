"""The reference (ONNX Runtime) backend refuses what artifacts cannot carry and names what ORT
itself fails on: a sequence-typed graph input is a BackendError at load, and an ORT failure at
run time is a one-line RunFailed naming the segment (conformance runs found both as raw errors)."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

import backends.onnxruntime as bo
from partitioner.core.errors import BackendError, RunFailed
from partitioner.runtime.comm_local import LocalWorld


def test_sequence_typed_input_is_refused_at_load() -> None:
    seq = helper.make_tensor_sequence_value_info("xs", TensorProto.FLOAT, [2])
    node = helper.make_node("SequenceLength", ["xs"], ["n"])
    g = helper.make_graph([node], "seq", [seq], [helper.make_tensor_value_info("n", TensorProto.INT64, [])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    with pytest.raises(BackendError, match="input 'xs' is sequence-typed"):
        bo.load(m)


def test_onnxruntime_run_failure_is_one_line_run_failed() -> None:
    # Reshape to a shape that does not fit the data: ORT loads the model and fails while running
    node = helper.make_node("Reshape", ["x", "s"], ["y"])
    g = helper.make_graph([node], "bad_reshape",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3]),
                           helper.make_tensor_value_info("s", TensorProto.INT64, [2])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    exe = bo.load(m)
    with pytest.raises(RunFailed) as info:
        exe.run({"x": np.zeros((2, 3), np.float32), "s": np.array([4, 4], np.int64)}, LocalWorld(1).communicator(0))
    msg = str(info.value)
    assert "segment 0 of 'bad_reshape'" in msg and "\n" not in msg
