"""Convolution building blocks shared by the CNN builders (resnet, mobilenet, inception, unet).

Each function adds nodes to a :class:`GraphBuilder` and returns the output value name. Node
names are ``<prefix>`` (the Conv), ``<prefix>.bn``, ``<prefix>.relu``; weights are He-scaled
over the convolution's fan-in (``in_channels / group * k * k``) so ReLU stacks keep unit-order
variance. Each function records the estimated mean square of its output
(:meth:`GraphBuilder.set_moment`); ``conv_bn`` uses the estimate of the Conv output as the
BatchNormalization running variance, so BN renormalises to about ``gamma**2``.
"""

from __future__ import annotations

import numpy as np
import onnx

from models_zoo.graph_builder import GraphBuilder


def conv(g: GraphBuilder, x: str, prefix: str, cin: int, cout: int, k: int, *, stride: int = 1,
         pad: int | None = None, group: int = 1, bias: bool = True, gain: float = 2.0) -> str:
    """Conv (k x k, "same"-style padding (k-1)//2 unless ``pad`` is given)."""
    p = (k - 1) // 2 if pad is None else pad
    fan_in = cin // group * k * k
    inputs = [x, g.he_weight(f"{prefix}.weight", (cout, cin // group, k, k), fan_in, gain)]
    if bias:
        inputs.append(g.bias(f"{prefix}.bias", cout))
    y = g.op("Conv", inputs, prefix, kernel_shape=[k, k], strides=[stride, stride], pads=[p, p, p, p],
             group=group)
    return g.set_moment(y, gain * g.moment(x))


def relu(g: GraphBuilder, x: str, name: str) -> str:
    """Relu; halves the mean square of a zero-mean symmetric input."""
    return g.set_moment(g.op("Relu", [x], name), g.moment(x) / 2)


def relu6(g: GraphBuilder, x: str, name: str) -> str:
    """ReLU6 as Clip(x, 0, 6) with min/max as (shared) initializer inputs (opset >= 11)."""
    y = g.op("Clip", [x, g.const("relu6.min", 0.0), g.const("relu6.max", 6.0)], name)
    return g.set_moment(y, g.moment(x) / 2)


def conv_relu(g: GraphBuilder, x: str, prefix: str, cin: int, cout: int, k: int, *, stride: int = 1,
              pad: int | None = None) -> str:
    """Conv with bias, then Relu."""
    return relu(g, conv(g, x, prefix, cin, cout, k, stride=stride, pad=pad), f"{prefix}.relu")


def conv_bn(g: GraphBuilder, x: str, prefix: str, cin: int, cout: int, k: int, *, stride: int = 1,
            group: int = 1, act: str | None = "relu", gamma: float = 1.0) -> str:
    """Conv (no bias) -> BatchNormalization -> activation ("relu", "relu6" or None)."""
    y = conv(g, x, prefix, cin, cout, k, stride=stride, group=group, bias=False)
    params = g.batchnorm_params(f"{prefix}.bn", cout, gamma, input_moment=g.moment(y))
    y = g.set_moment(g.op("BatchNormalization", [y, *params], f"{prefix}.bn", epsilon=1e-5), gamma**2)
    if act == "relu":
        return relu(g, y, f"{prefix}.relu")
    if act == "relu6":
        return relu6(g, y, f"{prefix}.relu6")
    return y


def add(g: GraphBuilder, a: str, b: str, name: str) -> str:
    """Residual Add; mean squares of independent terms add up."""
    return g.set_moment(g.op("Add", [a, b], name), g.moment(a) + g.moment(b))


def classifier(g: GraphBuilder, x: str, prefix: str, features: int, classes: int, out: str = "logits") -> str:
    """GlobalAveragePool -> Flatten -> Gemm(transB=1); returns the [batch, classes] logits."""
    y = g.op("GlobalAveragePool", [x], f"{prefix}.pool")
    y = g.op("Flatten", [y], f"{prefix}.flatten", axis=1)
    w = g.he_weight(f"{prefix}.fc.weight", (classes, features), features, gain=1.0)
    return g.op("Gemm", [y, w, g.bias(f"{prefix}.fc.bias", classes)], f"{prefix}.fc", out=out, transB=1)


def single_conv_model(ci: int, hw: int, co: int, k: int, s: int, batch: int, seed: int = 0) -> onnx.ModelProto:
    """One ``Conv(k x k, stride s, same padding) + bias -> Relu`` layer on a ``[batch, ci, hw, hw]``
    input, He-initialised seeded weights: the unit the per-layer conv benchmark and the conv
    schedule tests time and check against ONNX Runtime."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((co, ci, k, k)) * np.sqrt(2.0 / (ci * k * k))).astype(np.float32)
    b = (rng.standard_normal(co) * 0.1).astype(np.float32)
    p = (k - 1) // 2
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], kernel_shape=[k, k], strides=[s, s], pads=[p] * 4),
             helper.make_node("Relu", ["c"], ["y"])]
    g = helper.make_graph(nodes, "conv", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, ci, hw, hw])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                          [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")])
    return onnx.shape_inference.infer_shapes(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]))
