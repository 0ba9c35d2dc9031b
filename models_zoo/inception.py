"""``inception``: a GoogLeNet-style branchy DAG.

Stem: Conv 7x7/2 + Relu, MaxPool 3x3/2. Then ``blocks`` inception modules; each has four
branches concatenated on channels:

1. Conv 1x1
2. Conv 1x1 (reduce) -> Conv 3x3
3. Conv 1x1 (reduce) -> Conv 5x5 on even modules, two Conv 3x3 on odd ones (v1 vs v2 style)
4. MaxPool 3x3/1 -> Conv 1x1 (pool projection)

Every Conv has a bias and is followed by Relu. After every second module a MaxPool 3x3/2
halves the spatial size while it is at least 8. Head: GlobalAveragePool, Flatten, Gemm.
Input ``input`` [batch, 3, image, image] (image >= 16); output ``logits`` [batch, classes].
"""

from __future__ import annotations

import onnx

from models_zoo.arguments import positive_int, require, seed_int
from models_zoo.conv_layers import classifier, conv_relu
from models_zoo.graph_builder import GraphBuilder


def _module(g: GraphBuilder, x: str, p: str, cin: int, i: int) -> tuple[str, int]:
    c1, c3r, c3, c5r, c5, cp = 16 + 8 * i, 16 + 4 * i, 24 + 8 * i, 8 + 2 * i, 8 + 4 * i, 8 + 4 * i
    b1 = conv_relu(g, x, f"{p}.branch1x1", cin, c1, 1)
    b2 = conv_relu(g, x, f"{p}.branch3x3.reduce", cin, c3r, 1)
    b2 = conv_relu(g, b2, f"{p}.branch3x3.conv", c3r, c3, 3)
    b3 = conv_relu(g, x, f"{p}.branch5x5.reduce", cin, c5r, 1)
    if i % 2 == 0:
        b3 = conv_relu(g, b3, f"{p}.branch5x5.conv", c5r, c5, 5)
    else:
        b3 = conv_relu(g, b3, f"{p}.branch5x5.conv_a", c5r, c5, 3)
        b3 = conv_relu(g, b3, f"{p}.branch5x5.conv_b", c5, c5, 3)
    b4 = g.op("MaxPool", [x], f"{p}.branch_pool.pool", kernel_shape=[3, 3], strides=[1, 1], pads=[1, 1, 1, 1])
    b4 = conv_relu(g, b4, f"{p}.branch_pool.proj", cin, cp, 1)
    return g.op("Concat", [b1, b2, b3, b4], f"{p}.concat", axis=1), c1 + c3 + c5 + cp


def build_inception(batch: int = 1, image: int = 64, blocks: int = 3, classes: int = 10, seed: int = 0,
                    *, name: str = "inception") -> onnx.ModelProto:
    """Build the inception network described in the module docstring."""
    args = {"batch": batch, "image": image, "blocks": blocks, "classes": classes, "seed": seed}
    for key in ("batch", "image", "blocks", "classes"):
        positive_int(name, key, args[key])
    require(image >= 16, f"{name}: image must be at least 16, got {image}")
    g = GraphBuilder(name, seed_int(name, seed))
    x = g.input("input", [batch, 3, image, image])
    x = conv_relu(g, x, "stem.conv", 3, 32, 7, stride=2)
    x = g.op("MaxPool", [x], "stem.maxpool", kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])
    size = ((image + 6 - 7) // 2 + 1 + 2 - 3) // 2 + 1
    channels = 32
    for i in range(blocks):
        x, channels = _module(g, x, f"inception{i}", channels, i)
        if i % 2 == 1 and i + 1 < blocks and size >= 8:
            x = g.op("MaxPool", [x], f"inception{i}.downsample", kernel_shape=[3, 3], strides=[2, 2],
                     pads=[1, 1, 1, 1])
            size = (size + 2 - 3) // 2 + 1
    y = classifier(g, x, "head", channels, classes)
    g.output(y, [batch, classes])
    return g.build(args, doc=f"Inception: {blocks} modules, {image}x{image}, {classes} classes")
