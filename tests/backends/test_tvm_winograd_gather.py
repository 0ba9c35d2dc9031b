"""Winograd's input transform reads its tiles straight from the padded input
(backends/tvm/conv_algorithms.py rule 5, ``WINOGRAD_DATA_GATHER``).

With the knob on, a Winograd build has no ``winograd_tile`` copy stage (the input transform is
the pad and one reduction block); with it off the copy is back (this test fails with
``WINOGRAD_DATA_GATHER = False``). Both builds, for 1 and 2 threads, on a ResNet-style 7x7 map
and an odd-sized map with asymmetric padding (partial border tiles), give ONNX Runtime's results
on seeded inputs and random weights (rtol 1e-4, atol 1e-5).
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import tvm
from onnx import TensorProto, helper, numpy_helper
from tvm import relax

from backends.tvm import conv_algorithms
from backends.tvm.lower import lower_program
from backends.tvm.pipeline import run_pipeline
from backends.tvm.schedules import threads
from backends.tvm.target import detect_host_target

RTOL, ATOL = 1e-4, 1e-5


def _conv(c: int, hw: int, pads: tuple[int, int, int, int]) -> onnx.ModelProto:
    """Conv 3x3 c -> c (stride 1) + bias + Relu on an hw x hw map at batch 1, random weights."""
    rng = np.random.default_rng(hw * 10 + c)
    w = (rng.standard_normal((c, c, 3, 3)) / np.sqrt(9 * c)).astype(np.float32)
    b = rng.standard_normal(c).astype(np.float32)
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=list(pads)),
             helper.make_node("Relu", ["c"], ["y"])]
    g = helper.make_graph(nodes, "conv", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, c, hw, hw])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                          [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")])
    return onnx.shape_inference.infer_shapes(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]))


def _winograd_stages(m: onnx.ModelProto, build_threads: int | None) -> set[str]:
    """The Winograd stage names (``winograd_*`` blocks) of the build; checked against ORT."""
    target = tvm.target.Target(detect_host_target())
    shape = [d.dim_value for d in m.graph.input[0].type.tensor_type.shape.dim]
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    ref = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    with threads.building_for(build_threads):
        mod = run_pipeline(lower_program(m).mod, "scheduled", target, conv_algorithm="winograd")
    text = "\n".join(f.script() for _, f in mod.functions_items() if isinstance(f, tvm.tirx.PrimFunc))
    vm = relax.VirtualMachine(tvm.compile(mod, target), tvm.cpu())
    res = vm["main"](tvm.runtime.tensor(x))
    got = res.numpy() if isinstance(res, tvm.runtime.Tensor) else res[0].numpy()
    np.testing.assert_allclose(got, ref, rtol=RTOL, atol=ATOL)
    return {s for s in ("winograd_tile", "winograd_data", "winograd_gemm", "winograd_inverse") if f'"{s}' in text}


CASES = {"resnet-7x7": (32, 7, (1, 1, 1, 1)), "odd-9x9-asym": (16, 9, (1, 0, 2, 1))}


@pytest.mark.parametrize("on", [True, False], ids=["gather_on", "gather_off"])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("build_threads", [1, None], ids=["1thread", "pool"])
def test_input_transform_has_no_tile_copy_only_with_the_rule(on: bool, case: str, build_threads, monkeypatch) -> None:
    monkeypatch.setattr(conv_algorithms, "WINOGRAD_DATA_GATHER", on)
    stages = _winograd_stages(_conv(*CASES[case]), build_threads)
    assert {"winograd_data", "winograd_gemm", "winograd_inverse"} <= stages  # Winograd was used
    assert ("winograd_tile" in stages) is (not on)
