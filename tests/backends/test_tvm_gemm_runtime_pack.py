"""Packing that runs on every call (B an activation) is vectorised, not TVM's scalar copy.

``backends/tvm/schedules/gemm_packed.py`` (:func:`_schedule_runtime_packs`, knob
``SCHEDULE_RUNTIME_PACKS``): when the packed operand of the GEMM kernel is an activation and the
packing is not an identity copy (here N = 65 padded to 72 in three 24-wide panels, the shape of
heldout_vit's attention), the split-out ``*_weight_prepack`` function runs per call. Each case is
compared with ONNX Runtime (seeded input, rtol 1e-4, atol 1e-5; ``tvm_build_check``) on the host
and an AVX2 target, and the packing function must hold a vectorised loop: with the knob off it
is the serial scalar copy and the structural assertion fails.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import tvm
from onnx import TensorProto, helper, numpy_helper

from backends.tvm.schedules import gemm_packed
from tests.backends.tvm_build_check import build_and_compare

F = TensorProto.FLOAT
TARGETS = {"host": None, "avx2": {"kind": "llvm", "mcpu": "haswell"}}


def _batched_product(x_shape: list[int], a_shape: list[int], transpose: bool) -> onnx.ModelProto:
    """y = A @ x (or A @ x^T over the last two axes), A a seeded constant, x the input."""
    rng = np.random.default_rng(1)
    a = numpy_helper.from_array((rng.standard_normal(a_shape) * 0.2).astype(np.float32), "a")
    nodes, b = [], "x"
    if transpose:
        perm = list(range(len(x_shape) - 2)) + [len(x_shape) - 1, len(x_shape) - 2]
        nodes.append(helper.make_node("Transpose", ["x"], ["xt"], perm=perm))
        b = "xt"
    nodes.append(helper.make_node("MatMul", ["a", b], ["y"]))
    g = helper.make_graph(nodes, "runtime_pack", [helper.make_tensor_value_info("x", F, x_shape)],
                          [helper.make_tensor_value_info("y", F, None)], [a])
    return onnx.shape_inference.infer_shapes(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]))


def _packs(mod) -> dict[str, str]:
    return {gv.name_hint: f.script() for gv, f in mod.functions_items()
            if isinstance(f, tvm.tirx.PrimFunc) and gv.name_hint.endswith("_weight_prepack")}


@pytest.mark.parametrize("target_name", list(TARGETS))
def test_padded_activation_pack_is_vectorised_and_matches_ort(target_name: str) -> None:
    spec = TARGETS[target_name]
    mod = build_and_compare(_batched_product([2, 4, 24, 65], [4, 16, 24], transpose=False),
                            None if spec is None else tvm.target.Target(spec))
    packs = _packs(mod)
    assert packs, "no per-call packing function: the case no longer exercises the rule"
    assert all("T.vectorized" in text for text in packs.values()), "packing left as a scalar copy"


def test_transposed_activation_pack_matches_ort() -> None:
    """A transposed B keeps TVM's copy (rule 1); the product must still be right."""
    build_and_compare(_batched_product([2, 4, 65, 24], [4, 16, 24], transpose=True))


def test_knob_off_leaves_the_scalar_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    """The structural check above is what the knob changes: off, no vectorised loop."""
    monkeypatch.setattr(gemm_packed, "SCHEDULE_RUNTIME_PACKS", False)
    mod = build_and_compare(_batched_product([2, 4, 24, 65], [4, 16, 24], transpose=False))
    packs = _packs(mod)
    assert packs and not any("T.vectorized" in text for text in packs.values())
