"""``mobilenet``: MobileNetV2 (Sandler et al. 2018) in inference form.

Stem: Conv 3x3/2 + BatchNormalization + ReLU6 (Clip 0..6, min/max as inputs). Then the
inverted residual blocks of the paper's table 2, (expansion t, channels c, repeats n,
stride s): pointwise Conv expand (t > 1) + BN + ReLU6 -> depthwise Conv 3x3 (group =
channels) + BN + ReLU6 -> pointwise Conv project + BN (linear bottleneck), with a residual Add
when stride is 1 and channels are unchanged. Then a 1x1 Conv to the last channels + BN + ReLU6,
GlobalAveragePool, Flatten, Gemm. Channels are ``round8(c * width_mult)``.

Input ``input`` [batch, 3, image, image] (image >= 32); output ``logits`` [batch, classes].
"""

from __future__ import annotations

import onnx

from models_zoo.arguments import positive_float, positive_int, require, seed_int
from models_zoo.conv_layers import add, classifier, conv_bn
from models_zoo.graph_builder import GraphBuilder

#: (expansion t, output channels c, repeats n, first stride s)
SETTINGS: tuple[tuple[int, int, int, int], ...] = (
    (1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1), (6, 160, 3, 2), (6, 320, 1, 1),
)


def make_divisible(v: float, divisor: int = 8) -> int:
    """Round to the nearest multiple of ``divisor``, never more than 10% below ``v`` (as in the paper)."""
    new = max(divisor, int(v + divisor / 2) // divisor * divisor)
    return new + divisor if new < 0.9 * v else new


def _inverted_residual(g: GraphBuilder, x: str, p: str, cin: int, cout: int, stride: int, t: int) -> str:
    hidden = cin * t
    y = x
    if t != 1:
        y = conv_bn(g, y, f"{p}.expand", cin, hidden, 1, act="relu6")
    y = conv_bn(g, y, f"{p}.depthwise", hidden, hidden, 3, stride=stride, group=hidden, act="relu6")
    residual = stride == 1 and cin == cout
    y = conv_bn(g, y, f"{p}.project", hidden, cout, 1, act=None, gamma=0.5 if residual else 1.0)
    if residual:
        y = add(g, x, y, f"{p}.add")
    return y


def build_mobilenet(batch: int = 1, image: int = 64, width_mult: float = 1.0, classes: int = 10,
                    seed: int = 0, *, name: str = "mobilenet") -> onnx.ModelProto:
    """Build MobileNetV2 as described in the module docstring."""
    args = {"batch": batch, "image": image, "width_mult": width_mult, "classes": classes, "seed": seed}
    for key in ("batch", "image", "classes"):
        positive_int(name, key, args[key])
    wm = positive_float(name, "width_mult", width_mult)
    require(image >= 32, f"{name}: image must be at least 32 (five stride-2 steps), got {image}")
    g = GraphBuilder(name, seed_int(name, seed))
    x = g.input("input", [batch, 3, image, image])
    cin = make_divisible(32 * wm)
    x = conv_bn(g, x, "stem.conv", 3, cin, 3, stride=2, act="relu6")
    block = 0
    for t, c, n, s in SETTINGS:
        cout = make_divisible(c * wm)
        for r in range(n):
            x = _inverted_residual(g, x, f"block{block}", cin, cout, s if r == 0 else 1, t)
            cin = cout
            block += 1
    last = make_divisible(1280 * max(1.0, wm))
    x = conv_bn(g, x, "last.conv", cin, last, 1, act="relu6")
    y = classifier(g, x, "head", last, classes)
    g.output(y, [batch, classes])
    return g.build(args, doc=f"MobileNetV2: width {wm}, {image}x{image}, {classes} classes")
