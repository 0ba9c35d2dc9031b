"""Default CPU schedules (backends/tvm/schedules) keep numerics: every case compiles through the
"scheduled" pipeline and is compared with ONNX Runtime on seeded inputs (rtol 1e-4, atol 1e-5).
Each op case also checks that the intended rule really scheduled the kernel, so a rule that
silently stops matching fails here.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import tvm  # noqa: E402,F401  (a broken install fails, never skips)

import models_zoo  # noqa: E402
from backends.tvm.lower import lower_program  # noqa: E402
from backends.tvm.pipeline import run_pipeline  # noqa: E402
from backends.tvm.target import detect_host_target  # noqa: E402

F = TensorProto.FLOAT
RTOL, ATOL = 1e-4, 1e-5


def _model(nodes, inputs, outputs, inits=()) -> onnx.ModelProto:
    g = helper.make_graph(nodes, "case", inputs, outputs, initializer=list(inits))
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    return onnx.shape_inference.infer_shapes(m)


def _feeds(m: onnx.ModelProto, seed: int = 0) -> dict[str, np.ndarray]:
    return models_zoo.sample_inputs(m, seed)


def _compile_and_run(m: onnx.ModelProto, feeds: dict[str, np.ndarray]):
    import tvm
    from tvm import relax

    target = tvm.target.Target(detect_host_target())
    mod = run_pipeline(lower_program(m).mod, "scheduled", target)
    scheduled = sorted(gv.name_hint for gv, f in mod.functions_items()
                       if isinstance(f, tvm.tirx.PrimFunc) and f.attrs is not None and f.attrs.get("tirx.is_scheduled"))
    vm = relax.VirtualMachine(tvm.compile(mod, target), tvm.cpu())
    res = vm["main"](*[tvm.runtime.tensor(feeds[v.name]) for v in m.graph.input if v.name in feeds])
    outs = [r.numpy() for r in res] if not isinstance(res, tvm.runtime.Tensor) else [res.numpy()]
    return outs, scheduled


def _check(m: onnx.ModelProto, expect_scheduled: str | None = None) -> None:
    feeds = _feeds(m)
    sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    ref = sess.run(None, feeds)
    got, scheduled = _compile_and_run(m, feeds)
    assert len(got) == len(ref)
    for g, r in zip(got, ref):
        np.testing.assert_allclose(g, r, rtol=RTOL, atol=ATOL)
    if expect_scheduled is not None:
        assert any(expect_scheduled in name for name in scheduled), f"no scheduled {expect_scheduled!r} kernel in {scheduled}"


def _w(rng, *shape, scale=0.2):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def _conv_case(cin, cout, k, stride, pad, group, hw=9, batch=1, bias=True, relu=True) -> onnx.ModelProto:
    rng = np.random.default_rng(cin * 100 + cout + k)
    inits = [numpy_helper.from_array(_w(rng, cout, cin // group, k, k), "w")]
    ins = ["x", "w"]
    if bias:
        inits.append(numpy_helper.from_array(_w(rng, cout), "b"))
        ins.append("b")
    nodes = [helper.make_node("Conv", ins, ["c"], strides=[stride, stride], pads=[pad] * 4, group=group)]
    nodes.append(helper.make_node("Relu", ["c"], ["y"]) if relu else helper.make_node("Identity", ["c"], ["y"]))
    return _model(nodes, [helper.make_tensor_value_info("x", F, [batch, cin, hw, hw])],
                  [helper.make_tensor_value_info("y", F, None)], inits)


@pytest.mark.parametrize(
    "cin,cout,k,stride,pad,group,batch",
    [
        (16, 32, 3, 1, 1, 1, 1),   # 3x3
        (32, 48, 1, 1, 0, 1, 2),   # 1x1 (a GEMM), batch 2
        (8, 16, 3, 2, 1, 1, 1),    # strided
        (32, 32, 3, 1, 1, 32, 1),  # depthwise
        (16, 32, 3, 1, 1, 4, 1),   # grouped
        (3, 20, 5, 2, 2, 1, 1),    # odd channel counts (no full vector)
    ],
    ids=["3x3", "1x1", "strided", "depthwise", "grouped", "odd-channels"],
)
def test_conv_schedules_match_ort(cin, cout, k, stride, pad, group, batch):
    _check(_conv_case(cin, cout, k, stride, pad, group, batch=batch), "conv2d")


def test_matmul_bias_relu_matches_ort():
    rng = np.random.default_rng(3)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["m"]), helper.make_node("Add", ["m", "b"], ["a"]),
             helper.make_node("Relu", ["a"], ["y"])]
    m = _model(nodes, [helper.make_tensor_value_info("x", F, [24, 40])], [helper.make_tensor_value_info("y", F, None)],
               [numpy_helper.from_array(_w(rng, 40, 64), "w"), numpy_helper.from_array(_w(rng, 64), "b")])
    _check(m, "matmul")


def test_gemm_transposed_weights_matches_ort():
    rng = np.random.default_rng(4)
    nodes = [helper.make_node("Gemm", ["x", "w", "b"], ["y"], transB=1)]
    m = _model(nodes, [helper.make_tensor_value_info("x", F, [3, 37])], [helper.make_tensor_value_info("y", F, None)],
               [numpy_helper.from_array(_w(rng, 50, 37), "w"), numpy_helper.from_array(_w(rng, 50), "b")])
    _check(m)


def test_batch_matmul_matches_ort():
    nodes = [helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]), helper.make_node("MatMul", ["q", "kt"], ["y"])]
    m = _model(nodes, [helper.make_tensor_value_info("q", F, [2, 4, 16, 8]), helper.make_tensor_value_info("k", F, [2, 4, 16, 8])],
               [helper.make_tensor_value_info("y", F, None)])
    _check(m, "matmul")


@pytest.mark.parametrize("op", ["MaxPool", "AveragePool", "GlobalAveragePool"])
def test_pooling_after_conv_matches_ort(op):
    rng = np.random.default_rng(5)
    attrs = {} if op == "GlobalAveragePool" else {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]}
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]), helper.make_node(op, ["c"], ["y"], **attrs)]
    m = _model(nodes, [helper.make_tensor_value_info("x", F, [1, 8, 10, 10])], [helper.make_tensor_value_info("y", F, None)],
               [numpy_helper.from_array(_w(rng, 32, 8, 3, 3), "w")])
    _check(m, "pool" if op != "GlobalAveragePool" else None)


def test_softmax_layernorm_chain_matches_ort():
    rng = np.random.default_rng(6)
    nodes = [helper.make_node("Softmax", ["x"], ["s"], axis=-1),
             helper.make_node("LayerNormalization", ["s", "g", "b"], ["y"], axis=-1, epsilon=1e-5)]
    m = _model(nodes, [helper.make_tensor_value_info("x", F, [4, 8, 32])], [helper.make_tensor_value_info("y", F, None)],
               [numpy_helper.from_array(1 + _w(rng, 32), "g"), numpy_helper.from_array(_w(rng, 32), "b")])
    _check(m)


FAST_ZOO = [
    ("mlp", {}),
    ("bert", {"seq": 16, "hidden": 32, "layers": 1}),
    ("gpt", {"seq": 16, "hidden": 32, "layers": 1}),
]
SLOW_ZOO = [  # each compiles for 30-75 s on a busy 2-core machine
    ("mobilenet", {"image": 32, "width_mult": 0.25}),
    ("resnet", {"image": 32, "width": 8, "classes": 10}),
    ("inception", {"image": 32}),
    ("unet", {"image": 32, "base": 8}),
    ("resnet", {"image": 32, "width": 8, "depth": 50, "classes": 10}),
]


@pytest.mark.parametrize("name,kwargs", FAST_ZOO, ids=[n for n, _ in FAST_ZOO])
def test_zoo_models_match_ort(name, kwargs):
    _check(models_zoo.build(name, **kwargs))


@pytest.mark.slow
@pytest.mark.parametrize("name,kwargs", SLOW_ZOO, ids=[f"{n}-{k.get('depth', '')}" for n, k in SLOW_ZOO])
def test_zoo_models_match_ort_slow(name, kwargs):
    _check(models_zoo.build(name, **kwargs))
