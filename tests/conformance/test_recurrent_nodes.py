"""Every LSTM/GRU/RNN case of the ONNX node suite passes through TVM (1 rank) after
``passes.expand_recurrent`` unrolls it: TVM 0.27's importer has no converter for them, so
before the expansion each of these cases was refused. Driven by ``onnx.backend.test.BackendTest``
(load -> default passes -> TVM build -> run), which compares every output with the case's
expected outputs under the case's own rtol/atol.
"""

from __future__ import annotations

import unittest
import warnings

import onnx.backend.test

from .backend import PartitionerBackend

RECURRENT_CASES = (
    "test_gru_defaults", "test_gru_with_initial_bias", "test_gru_seq_length", "test_gru_batchwise",
    "test_gru_reverse", "test_gru_bidirectional",
    "test_lstm_defaults", "test_lstm_with_initial_bias", "test_lstm_with_peepholes", "test_lstm_batchwise",
    "test_lstm_reverse", "test_lstm_bidirectional",
    "test_simple_rnn_defaults", "test_simple_rnn_with_initial_bias", "test_rnn_seq_length",
    "test_simple_rnn_batchwise", "test_simple_rnn_reverse", "test_simple_rnn_bidirectional",
)


def _recurrent_tests() -> type[unittest.TestCase]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        bt = onnx.backend.test.BackendTest(PartitionerBackend, __name__)
    node_tests = bt.test_cases["OnnxBackendNodeModelTest"]
    present = {a[: -len("_cpu")] for a in dir(node_tests) if a.startswith("test_") and a.endswith("_cpu")}
    recurrent = {n for n in present if any(k in n for k in ("lstm", "gru", "rnn"))}
    # the list above is the whole recurrent part of the installed suite: a new case must be added here
    if recurrent != set(RECURRENT_CASES):
        raise AssertionError(f"node-suite recurrent cases changed: {sorted(recurrent ^ set(RECURRENT_CASES))}")
    return type("TestRecurrentNodeCases", (unittest.TestCase,),
                {f"{n}_cpu": getattr(node_tests, f"{n}_cpu") for n in RECURRENT_CASES})


TestRecurrentNodeCases = _recurrent_tests()
