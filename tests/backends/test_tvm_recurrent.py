"""LSTM/GRU/RNN on the TVM backend: TVM 0.27's importer has none of them, so the backend
unrolls them first (``passes.expand_recurrent``, hooked into ``backends.tvm.expand_functions``).

- Hand-built attribute variants (``tests/passes/recurrent_cases.py``) built with the backend's
  own ``build``/``load`` and compared with ONNX Runtime at rtol 1e-5 / atol 1e-5 (TVM's fast
  float32 sigmoid/tanh are within ~4e-7 relative). A representative subset runs in CI, the
  rest is ``slow``.
- A 2-layer LSTM partitioned with ``pipeline`` over 2 ranks (one layer per rank with the default
  passes; unrolled MatMuls cut at the layer boundary with ``--passes optimize``) runs under the
  reference backend and TVM and matches ORT on the unpartitioned model; with ``optimize`` the
  ``tensor`` strategy splits the gate columns of every step's MatMul.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

import tvm  # noqa: F401,E402  (a broken install fails here, it is not skipped)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "passes"))

import backends.tvm as bt  # noqa: E402
from models_zoo.lstm import build_lstm  # noqa: E402
from partitioner.runtime.comm_local import LocalWorld  # noqa: E402
from recurrent_cases import CASES, Case, build, reference  # noqa: E402

RTOL = ATOL = 1e-5
FAST = {"lstm_bidirectional_all", "gru_linear_before_reset"}  # lstm_opset9 (Gather slices) builds in ~30 s: slow


def _cases():
    for case in CASES:
        yield pytest.param(case, id=case.name, marks=() if case.name in FAST else (pytest.mark.slow,))


@pytest.mark.parametrize("case", list(_cases()))
def test_variant_on_tvm_matches_ort(case: Case, tmp_path: Path) -> None:
    model, feeds = build(case)
    bt.build(model, tmp_path / "rank0.so")
    got = bt.load(model, tmp_path / "rank0.so").run(feeds, LocalWorld(1).communicator(0))
    for out, want in zip(model.graph.output, reference(case)):
        np.testing.assert_allclose(got[out.name], want, rtol=RTOL, atol=ATOL, err_msg=f"{case.name}: {out.name}")


def _two_layer() -> tuple[onnx.ModelProto, dict[str, np.ndarray], np.ndarray]:
    model = build_lstm(seq=8, batch=2, input_size=16, hidden=16, layers=2, classes=8)
    x = np.random.default_rng(0).standard_normal((8, 2, 16)).astype(np.float32)
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    return model, {"x": x}, want


@pytest.mark.parametrize(("backend", "passes", "strategy"), [
    ("onnxruntime", None, "pipeline"), ("tvm", None, "pipeline"), ("onnxruntime", ["optimize"], "tensor"),
    pytest.param("onnxruntime", ["optimize"], "pipeline", marks=pytest.mark.slow),
    pytest.param("tvm", ["optimize"], "pipeline", marks=pytest.mark.slow),
    pytest.param("tvm", ["optimize"], "tensor", marks=pytest.mark.slow),
])
def test_two_layer_lstm_on_two_ranks(backend: str, passes: list[str] | None, strategy: str, tmp_path: Path) -> None:
    from partitioner.compiler import compile as compile_artifact
    from partitioner.runtime.launch import run_in_process

    model, feeds, want = _two_layer()
    art = compile_artifact(model, "cpu:2", strategy=strategy, backend=backend, out_dir=tmp_path / "art", jobs=1,
                           progress=False, passes=passes)
    assert art.world_size == 2 and art.manifest["fallback"] is None
    ranks = [[n.op_type for n in onnx.load(str(art.root / f"rank{r}.onnx"), load_external_data=False).graph.node]
             for r in range(2)]
    if passes is None:  # the pipeline cuts between the two LSTM nodes
        assert [ops.count("LSTM") for ops in ranks] == [1, 1]
    else:  # unrolled before partitioning: both ranks hold plain MatMuls, no LSTM
        assert all("LSTM" not in ops and "MatMul" in ops for ops in ranks)
        if strategy == "tensor":
            assert all("AllGather" in ops or "AllReduce" in ops for ops in ranks)
        else:
            assert sum(ops.count("Send") for ops in ranks) == 1  # cut once, at the layer boundary
    got, _ = run_in_process(art, feeds, timeout=600)
    np.testing.assert_allclose(got["y"], want, rtol=RTOL, atol=ATOL)
