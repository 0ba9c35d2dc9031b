"""Per-operator FLOPs/bytes/depth against hand counts, and whole-model checks against published
numbers (COST_MODEL.md: ResNet-50 ≈ 8.2 GFLOPs, VGG-19 ≈ 39 GFLOPs)."""

from __future__ import annotations

import time

import pytest
from cost_testkit import light_model, model_of, single_node, vi
from onnx import helper

from partitioner.cost.ops import op_cost
from partitioner.cost.workdepth import analyze


def test_conv_groups_and_bias():
    # x[2,8,10,10] * w[16,4,3,3] (group 2, pad 1) + b[16] -> y[2,16,10,10]
    node = single_node("Conv", [("x", [2, 8, 10, 10]), ("w", [16, 4, 3, 3]), ("b", [16])],
                       group=2, pads=[1, 1, 1, 1], kernel_shape=[3, 3])
    c = op_cost(node)
    # 2·N·Cout·H'·W'·(Cin/g)·Ky·Kx = 2·2·16·100·4·9 = 230400; bias N·Cout·H'·W' = 3200
    assert c.flops == 230400 + 3200
    # ⌈log2 4⌉ + ⌈log2 3⌉ + ⌈log2 3⌉ = 2 + 2 + 2
    assert c.depth == 6
    # read x 6400 B + w 2304 B + b 64 B; write y 12800 B
    assert c.bytes_read == 6400 + 2304 + 64
    assert c.bytes_written == 12800


def test_conv_no_bias_strided():
    # x[1,3,224,224] * w[64,3,7,7], stride 2, pad 3 -> [1,64,112,112]
    node = single_node("Conv", [("x", [1, 3, 224, 224]), ("w", [64, 3, 7, 7])],
                       strides=[2, 2], pads=[3, 3, 3, 3])
    assert op_cost(node).flops == 2 * 64 * 112 * 112 * 3 * 49  # 118013952


def test_conv_transpose():
    # x[1,4,5,5], w[4,3,3,3] -> y[1,3,7,7]: each input pixel scatters a 3·3·3 kernel
    node = single_node("ConvTranspose", [("x", [1, 4, 5, 5]), ("w", [4, 3, 3, 3])])
    assert op_cost(node).flops == 2 * 1 * 4 * 25 * 3 * 9


def test_gemm_transb_and_bias():
    # A[3,5] · B[7,5]^T + C[7] -> [3,7]: 2·3·5·7 + 3·7
    node = single_node("Gemm", [("a", [3, 5]), ("b", [7, 5]), ("c", [7])], transB=1)
    c = op_cost(node)
    assert c.flops == 210 + 21
    assert c.depth == 3  # ⌈log2 5⌉


def test_gemm_transa():
    node = single_node("Gemm", [("a", [5, 3]), ("b", [5, 7])], transA=1)
    assert op_cost(node).flops == 2 * 3 * 5 * 7


def test_batched_broadcast_matmul():
    # [2,1,4,6] @ [3,6,5] -> [2,3,4,5]: 6 products of 4x6x5
    node = single_node("MatMul", [("a", [2, 1, 4, 6]), ("b", [3, 6, 5])])
    c = op_cost(node)
    assert c.flops == 2 * (2 * 3) * 4 * 6 * 5
    assert c.depth == 3  # ⌈log2 6⌉
    assert c.bytes_written == 2 * 3 * 4 * 5 * 4


def test_matmul_vector():
    node = single_node("MatMul", [("a", [6]), ("b", [6, 5])])
    assert op_cost(node).flops == 2 * 6 * 5


def test_elementwise_broadcast_add():
    node = single_node("Add", [("a", [2, 3, 4]), ("b", [4])])
    c = op_cost(node)
    assert (c.flops, c.depth) == (24, 1)
    assert c.bytes_read == (24 + 4) * 4 and c.bytes_written == 24 * 4


def test_views_are_free_and_copies_count_elements():
    node = single_node("Flatten", [("x", [2, 3, 4])])
    c = op_cost(node)
    assert (c.flops, c.bytes, c.depth) == (0, 0, 0)
    node = single_node("Transpose", [("x", [2, 3, 4])], perm=[2, 0, 1])
    c = op_cost(node)
    assert (c.flops, c.bytes) == (0, 2 * 24 * 4)
    assert c.work == 48  # elements touched: 24 read + 24 written


def test_pool_softmax_layernorm_depth():
    c = op_cost(single_node("MaxPool", [("x", [1, 2, 8, 8])], kernel_shape=[3, 3], strides=[1, 1]))
    assert c.depth == 4 and c.flops == 2 * 6 * 6 * 9
    c = op_cost(single_node("Softmax", [("x", [4, 10])], axis=-1))
    assert c.depth == 4  # ⌈log2 10⌉
    c = op_cost(single_node("GlobalAveragePool", [("x", [1, 2, 7, 7])]))
    assert c.depth == 6 and c.flops == 98  # ⌈log2 7⌉·2, one add per input element


def test_comm_domain_and_fallback():
    send = helper.make_node("Send", ["x"], [], domain="partitioner.comm", peer=1, tag=0)
    relu = helper.make_node("Relu", ["x"], ["y"])
    model = model_of([relu, send], [vi("x", [4, 4])], [vi("y", [4, 4])],
                     extra_opsets={"partitioner.comm": 1})
    nodes = list(model.graph)
    assert op_cost(nodes[1]).flops == 0 and op_cost(nodes[1]).bytes == 0
    custom = helper.make_node("Mystery", ["x"], ["y"], domain="acme")
    model = model_of([custom], [vi("x", [4, 4])], [vi("y", [4, 4], )], extra_opsets={"acme": 1})
    c = op_cost(next(iter(model.graph)))
    assert (c.flops, c.bytes_read, c.bytes_written, c.depth) == (0, 64, 64, 1)


def test_work_depth_two_branches():
    # x -> Relu ------------\
    # x -> MatMul(K=8) -> Add -> y   D = ⌈log2 8⌉ + 1 = 4 (the Relu branch is shorter)
    nodes = [helper.make_node("Relu", ["x"], ["r"]),
             helper.make_node("MatMul", ["x", "w"], ["m"]),
             helper.make_node("Add", ["r", "m"], ["y"])]
    model = model_of(nodes, [vi("x", [8, 8]), vi("w", [8, 8])], [vi("y", [8, 8])])
    s = analyze(model)
    assert s.depth == 4
    assert s.total_flops == 64 + 2 * 8 * 8 * 8 + 64
    assert s.work == s.total_flops
    assert s.parallelism == pytest.approx(s.work / 4)
    # peak: x, w live throughout (256 B each); r, m (256 each) live until Add; y allocated at Add.
    # At Add: x? last used by MatMul (node 2), so at node 3 live = r + m + y = 768; at node 2:
    # x + w + r + m = 1024.
    assert s.peak_activation_bytes == 1024


def test_light_resnet50_flops_and_params():
    s = analyze(light_model("light_resnet50"))
    assert s.total_flops == pytest.approx(8.2e9, rel=0.05)
    assert s.param_count == pytest.approx(25.6e6, rel=0.02)  # published: 25.6 M parameters
    assert s.op_histogram["Conv"] == 53


def test_light_vgg19_flops_and_params():
    s = analyze(light_model("light_vgg19"))
    assert s.total_flops == pytest.approx(39e9, rel=0.05)  # 19.5 G multiply-adds
    assert s.param_count == pytest.approx(143.7e6, rel=0.02)  # published: 143.7 M parameters


def test_analyze_is_fast_on_thousands_of_nodes():
    n = 3000
    nodes = [helper.make_node("Relu" if i % 2 else "Sigmoid", [f"t{i}"], [f"t{i + 1}"]) for i in range(n)]
    model = model_of(nodes, [vi("t0", [16, 64])], [vi(f"t{n}", [16, 64])])
    t0 = time.perf_counter()
    s = analyze(model)
    dt = time.perf_counter() - t0
    assert s.depth == n  # a chain of elementwise ops: depth 1 each
    assert dt < 5.0  # about 0.1 s idle; the bound only catches a quadratic blow-up
