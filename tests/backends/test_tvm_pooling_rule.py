"""NHWC pooling under the depthwise rule (backends/tvm/schedules/depthwise.py, ``POOLING``).

Each pooling model (a Conv first, so the pool runs on NHWC data as in a real network) matches
ONNX Runtime (rtol 1e-4, atol 1e-5, seeded random inputs and weights) for the pool shapes the
rule covers: ResNet's 3x3 stride-2 max pool with padding, Inception's stride-2 max pool without
padding and its 3x3 average pool with ``count_include_pad`` 0 and 1, U-Net's 2x2 max pool, batch
> 1. The built pool kernel writes no padded copy of its input (the pad is inlined into its
loads); with the knob off it does (the Contraction schedule). Two cases span 3 column tiles, so
their border tiles run in loops of their own (``SPLIT_BORDER``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
import pytest
import tvm
from onnx import TensorProto, helper, numpy_helper

from backends.tvm.schedules import depthwise as D
from tvm_build_check import build_and_compare


def _pool_model(op: str, c: int, hw: int, k: int, s: int, p: int, batch: int, **attrs: Any) -> onnx.ModelProto:
    rng = np.random.default_rng(c * 13 + hw + k * 3 + s + p + batch)
    w = (rng.standard_normal((c, 8, 1, 1)) * 0.5).astype(np.float32)
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], kernel_shape=[1, 1]),
             helper.make_node(op, ["c"], ["y"], kernel_shape=[k, k], strides=[s, s], pads=[p] * 4, **attrs)]
    g = helper.make_graph(nodes, "pool", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, 8, hw, hw])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                          [numpy_helper.from_array(w, "w")])
    return onnx.shape_inference.infer_shapes(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]))


def _check(m: onnx.ModelProto) -> str:
    """Build, compare with ORT; the pool kernel's TIR."""
    mod = build_and_compare(m)
    return next(f.script() for gv, f in mod.functions_items()
                if isinstance(f, tvm.tirx.PrimFunc) and "pool" in gv.name_hint)


CASES = {
    "max3x3s2p1-b2": ("MaxPool", 64, 14, 3, 2, 1, 2, {}),
    "max3x3s2p0": ("MaxPool", 32, 15, 3, 2, 0, 1, {}),
    "avg3x3s1p1-nopad": ("AveragePool", 32, 9, 3, 1, 1, 1, {"count_include_pad": 0}),
    "avg3x3s1p1-pad": ("AveragePool", 48, 9, 3, 1, 1, 2, {"count_include_pad": 1}),
    "max2x2s2": ("MaxPool", 32, 16, 2, 2, 0, 1, {}),
    # 3 column tiles of 8: the border tiles split from the interior (depthwise.SPLIT_BORDER)
    "max3x3s2p1-48": ("MaxPool", 32, 48, 3, 2, 1, 1, {}),
    "avg3x3s1p1-nopad-24": ("AveragePool", 16, 24, 3, 1, 1, 2, {"count_include_pad": 0}),
}
SPLIT = {"max3x3s2p1-48", "avg3x3s1p1-nopad-24"}


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_pools_match_ort(case: str) -> None:
    op, c, hw, k, s, p, batch, attrs = CASES[case]
    body = _check(_pool_model(op, c, hw, k, s, p, batch, **attrs))
    if case in SPLIT:  # the interior column tiles [1, 2) of 3 run in their own loop
        assert "in range(T.int64(1), T.int64(2)):" in body


def test_padded_pool_writes_no_padded_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    m = _pool_model("MaxPool", 64, 14, 3, 2, 1, 2)
    assert "pad_temp = T.sblock_alloc_buffer" not in _check(m)
    monkeypatch.setattr(D, "POOLING", False)
    assert "pad_temp = T.sblock_alloc_buffer" in _check(m)
