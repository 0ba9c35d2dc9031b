"""HardSwish / HardSigmoid after a conv as Mul, Add and Clip (``backends/tvm/import_fixes.py``
rule 7, ``HardActivationsAsClip``), so they keep NHWC and fuse into the conv's epilogue.

Every build matches ONNX Runtime (rtol 1e-4, atol 1e-5, seeded random weights and inputs) for
HardSwish, HardSigmoid with non-default ``alpha``/``beta`` (opset 17) and HardSigmoid at opset 9
(Clip's bounds as attributes). The rewritten build has one kernel holding the conv and the
activation and no transpose kernel between them (the input's and the output's layout changes
stay); with the knob off the activation is its own kernel with transposes.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from backends.tvm import import_fixes
from tvm_build_check import build_and_compare


def _model(op: str, opset: int, **attrs: float) -> onnx.ModelProto:
    rng = np.random.default_rng(3)
    w = (rng.standard_normal((24, 8, 3, 3)) * 2.0).astype(np.float32)  # outputs reach both clamps
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]), helper.make_node(op, ["c"], ["y"], **attrs)]
    g = helper.make_graph(nodes, "hard", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8, 9, 9])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], [numpy_helper.from_array(w, "w")])
    return onnx.shape_inference.infer_shapes(helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)]))


def _kernels(m: onnx.ModelProto) -> list[str]:
    """Build and compare with ORT; the names of the build's fused kernels."""
    return [gv.name_hint for gv in build_and_compare(m).get_global_vars() if gv.name_hint.startswith("fused_")]


@pytest.mark.parametrize("op,opset,attrs", [
    ("HardSwish", 17, {}),
    ("HardSigmoid", 17, {"alpha": 0.3, "beta": 0.4}),
    ("HardSigmoid", 9, {}),
], ids=["hardswish", "hardsigmoid-attrs", "hardsigmoid-opset9"])
def test_hard_activation_fuses_into_the_conv(op: str, opset: int, attrs: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    m = _model(op, opset, **attrs)
    fused = _kernels(m)
    assert any("conv2d" in k and "maximum" in k and "minimum" in k for k in fused), fused
    assert not any("transpose" in k for k in fused), fused
    monkeypatch.setattr(import_fixes, "HARD_ACTIVATIONS_AS_CLIP", False)
    assert any("transpose" in k for k in _kernels(m))
