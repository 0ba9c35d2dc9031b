"""A conv weight given at run time (a training step's) is transposed to HWIO and packed into
panels in one pass (backends/tvm/fold_weight_packs.py, knob ``FOLD_TRANSPOSED_PACKS``): the
forward conv's weight and the input gradient's flipped twin (``Conv(dY, flip(W^T))``, hoist rule
4). The built module calls no separate transpose of the weight nor TVM's ``*_weight_prepack``
(with the knob off it does, so the structural check fails), and the program still matches ONNX
Runtime's Conv and ConvTranspose (seeded inputs, rtol 1e-4, atol 1e-5)."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from backends.tvm import fold_weight_packs as F

C, N, HW = 64, 2, 6


def _conv_and_input_gradient() -> tuple[onnx.ModelProto, onnx.ModelProto]:
    """(the program TVM builds, ONNX Runtime's reference): y = Conv(x, w), dx = ConvTranspose(dy, w)."""
    from partitioner.training.hoist import conv_transpose_as_conv

    vi = lambda n, s: helper.make_tensor_value_info(n, TensorProto.FLOAT, s)  # noqa: E731
    nodes = [helper.make_node("Conv", ["x", "w"], ["y"], pads=[1, 1, 1, 1], kernel_shape=[3, 3]),
             helper.make_node("ConvTranspose", ["dy", "w"], ["dx"], pads=[1, 1, 1, 1], kernel_shape=[3, 3])]
    g = helper.make_graph(nodes, "conv_step", [vi("x", [N, C, HW, HW]), vi("w", [C, C, 3, 3]), vi("dy", [N, C, HW, HW])],
                          [vi("y", [N, C, HW, HW]), vi("dx", [N, C, HW, HW])])
    ref = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
    program = onnx.ModelProto()
    program.CopyFrom(ref)
    conv_transpose_as_conv(program, {"w"})
    return onnx.shape_inference.infer_shapes(program), ref


def _callees(program: onnx.ModelProto) -> list[str]:
    """Names of the PrimFuncs the built module's Relax functions call, after the build's lift step."""
    import tvm

    from backends.tvm.build import _cpu_module
    from backends.tvm.lift_step_constants import lift
    from backends.tvm.lower import lower_program
    from backends.tvm.schedules.threads import building_for
    from backends.tvm.target import target_dict

    target = tvm.target.Target(target_dict(None))
    with building_for(1):
        mod, _ = _cpu_module(lower_program(program).mod, target, "scheduled", {"threads": 1})
    mod = lift(mod, program, 0)
    text = mod.script()
    return [line.split("R.call_tir(cls.", 1)[1].split(",", 1)[0] for line in text.splitlines() if "R.call_tir(cls." in line]


def test_weight_transposes_fold_into_the_packs() -> None:
    calls = _callees(_conv_and_input_gradient()[0])
    assert sum(c.startswith("fused_transpose_weight_prepack") for c in calls) == 2  # forward and flipped
    assert not [c for c in calls if c.endswith("_weight_prepack") and not c.startswith("fused_transpose")]
    assert not [c for c in calls if "strided_slice" in c]  # the flip's own transpose is gone


def test_knob_off_keeps_transpose_then_pack(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(F, "FOLD_TRANSPOSED_PACKS", False)
    calls = _callees(_conv_and_input_gradient()[0])
    assert not any(c.startswith("fused_transpose_weight_prepack") for c in calls)
    assert sum(c.endswith("_weight_prepack") for c in calls) == 2


@pytest.mark.parametrize("fold", [True, False], ids=["folded", "knob-off"])
def test_folded_build_matches_onnxruntime(tmp_path, monkeypatch: pytest.MonkeyPatch, fold: bool) -> None:
    from backends.tvm.build import build_one
    from backends.tvm.executable import TvmRankExecutable
    from backends.tvm.target import target_dict

    monkeypatch.setattr(F, "FOLD_TRANSPOSED_PACKS", fold)
    program, ref = _conv_and_input_gradient()
    rng = np.random.default_rng(16)
    feeds = {"x": rng.standard_normal((N, C, HW, HW)).astype(np.float32),
             "w": (0.1 * rng.standard_normal((C, C, 3, 3))).astype(np.float32),
             "dy": rng.standard_normal((N, C, HW, HW)).astype(np.float32)}
    path = tmp_path / "conv_step.so"
    build_one(program, path, target_dict(None), {"threads": 1})
    exe = TvmRankExecutable(program, path, threads=1)
    for step in range(2):  # a new weight each call, as in training
        feeds["w"] = feeds["w"] * np.float32(1.5) if step else feeds["w"]
        want = ort.InferenceSession(ref.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
        got = exe.run(feeds, None)
        np.testing.assert_allclose(got["y"], want[0], rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(got["dx"], want[1], rtol=1e-4, atol=1e-5)
