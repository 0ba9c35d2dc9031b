"""``unet``: a U-Net encoder/decoder with skip connections.

Encoder level l (0 <= l < levels): two Conv 3x3 + Relu with ``base * 2**l`` channels, kept as
the skip, then MaxPool 2x2/2. Bottleneck: two Conv 3x3 + Relu with ``base * 2**levels``.
Decoder level l (levels-1 down to 0): upsample by 2 — ConvTranspose 2x2/2 on even levels,
Resize (nearest, scales [1, 1, 2, 2]) followed by a 1x1 Conv on odd levels, so both forms
appear — to ``base * 2**l`` channels, Concat with the skip on channels, two Conv 3x3 + Relu.
Head: Conv 1x1 to ``out_channels``.

Input ``input`` [batch, in_channels, image, image] (image divisible by 2**levels); output
``output`` [batch, out_channels, image, image].
"""

from __future__ import annotations

import numpy as np
import onnx

from models_zoo.arguments import positive_int, require, seed_int
from models_zoo.conv_layers import conv, conv_relu
from models_zoo.graph_builder import GraphBuilder


def _double_conv(g: GraphBuilder, x: str, p: str, cin: int, cout: int) -> str:
    x = conv_relu(g, x, f"{p}.conv1", cin, cout, 3)
    return conv_relu(g, x, f"{p}.conv2", cout, cout, 3)


def build_unet(batch: int = 1, image: int = 64, base: int = 16, levels: int = 3, in_channels: int = 3,
               out_channels: int = 2, seed: int = 0, *, name: str = "unet") -> onnx.ModelProto:
    """Build the U-Net described in the module docstring."""
    args = {"batch": batch, "image": image, "base": base, "levels": levels, "in_channels": in_channels,
            "out_channels": out_channels, "seed": seed}
    for key in ("batch", "image", "base", "levels", "in_channels", "out_channels"):
        positive_int(name, key, args[key])
    require(image % 2**levels == 0, f"{name}: image ({image}) must be divisible by 2**levels ({2**levels})")
    g = GraphBuilder(name, seed_int(name, seed))
    x = g.input("input", [batch, in_channels, image, image])
    skips: list[tuple[str, int]] = []
    cin = in_channels
    for lvl in range(levels):
        c = base * 2**lvl
        x = _double_conv(g, x, f"down{lvl}", cin, c)
        skips.append((x, c))
        x = g.op("MaxPool", [x], f"down{lvl}.pool", kernel_shape=[2, 2], strides=[2, 2])
        cin = c
    c = base * 2**levels
    x = _double_conv(g, x, "bottleneck", cin, c)
    cin = c
    for lvl in reversed(range(levels)):
        skip, c = skips[lvl]
        p = f"up{lvl}"
        if lvl % 2 == 0:
            w = g.he_weight(f"{p}.upconv.weight", (cin, c, 2, 2), cin, gain=1.0)
            x = g.op("ConvTranspose", [x, w, g.bias(f"{p}.upconv.bias", c)], f"{p}.upconv",
                     kernel_shape=[2, 2], strides=[2, 2])
        else:
            scales = g.const("const.upsample_scales", np.array([1, 1, 2, 2], np.float32))
            x = g.op("Resize", [x, "", scales], f"{p}.resize", mode="nearest")
            x = conv(g, x, f"{p}.proj", cin, c, 1, gain=1.0)
        x = g.op("Concat", [x, skip], f"{p}.concat", axis=1)
        x = _double_conv(g, x, p, 2 * c, c)
        cin = c
    y = g.op("Conv", [x, g.he_weight("head.weight", (out_channels, cin, 1, 1), cin, gain=1.0),
                      g.bias("head.bias", out_channels)], "head", out="output", kernel_shape=[1, 1])
    g.output(y, [batch, out_channels, image, image])
    return g.build(args, doc=f"U-Net: {levels} levels, base {base}, {image}x{image}")
