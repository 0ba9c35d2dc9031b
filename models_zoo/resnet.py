"""``resnet`` / ``resnet50``: ResNet v1.5 (He et al. 2016) in inference form.

Stem: Conv 7x7/2 + BatchNormalization + Relu, MaxPool 3x3/2. Four stages of residual blocks
with ``width * (1, 2, 4, 8)`` channels, the first block of stages 2-4 striding by 2 (on the 3x3
conv, as in v1.5). Depth 18/34 use basic blocks (two 3x3 convs); 50/101/152 use bottleneck
blocks (1x1, 3x3, 1x1 with expansion 4). A 1x1 Conv+BN projection shortcut is used whenever
the shape changes. Head: GlobalAveragePool, Flatten, Gemm to ``classes``.

BatchNormalization statistics follow the estimated scale of their input, and the last BN of
each residual branch has scale ~0.5, so the residual stream grows slowly with depth
(activations stay O(1) even for depth 152).
Input ``input`` [batch, 3, image, image]; output ``logits`` [batch, classes].
"""

from __future__ import annotations

import onnx

from models_zoo.arguments import positive_int, require, seed_int
from models_zoo.conv_layers import add, classifier, conv_bn, relu
from models_zoo.graph_builder import GraphBuilder

#: depth -> (bottleneck?, blocks per stage)
DEPTHS: dict[int, tuple[bool, tuple[int, int, int, int]]] = {
    18: (False, (2, 2, 2, 2)),
    34: (False, (3, 4, 6, 3)),
    50: (True, (3, 4, 6, 3)),
    101: (True, (3, 4, 23, 3)),
    152: (True, (3, 8, 36, 3)),
}
_RESIDUAL_GAMMA = 0.5


def _add_relu(g: GraphBuilder, branch: str, short: str, p: str, projected: bool) -> str:
    # An identity shortcut is non-negative (a previous Relu), so Relu keeps most of the sum's
    # mean square; a projection shortcut is zero-mean, so Relu halves it.
    y = add(g, branch, short, f"{p}.add")
    r = relu(g, y, f"{p}.relu")
    return r if projected else g.set_moment(r, g.moment(y))


def _basic_block(g: GraphBuilder, x: str, p: str, cin: int, planes: int, stride: int) -> tuple[str, int]:
    y = conv_bn(g, x, f"{p}.conv1", cin, planes, 3, stride=stride)
    y = conv_bn(g, y, f"{p}.conv2", planes, planes, 3, act=None, gamma=_RESIDUAL_GAMMA)
    projected = stride != 1 or cin != planes
    short = conv_bn(g, x, f"{p}.downsample", cin, planes, 1, stride=stride, act=None) if projected else x
    return _add_relu(g, y, short, p, projected), planes


def _bottleneck(g: GraphBuilder, x: str, p: str, cin: int, planes: int, stride: int) -> tuple[str, int]:
    cout = planes * 4
    y = conv_bn(g, x, f"{p}.conv1", cin, planes, 1)
    y = conv_bn(g, y, f"{p}.conv2", planes, planes, 3, stride=stride)
    y = conv_bn(g, y, f"{p}.conv3", planes, cout, 1, act=None, gamma=_RESIDUAL_GAMMA)
    projected = stride != 1 or cin != cout
    short = conv_bn(g, x, f"{p}.downsample", cin, cout, 1, stride=stride, act=None) if projected else x
    return _add_relu(g, y, short, p, projected), cout


def build_resnet(batch: int = 1, depth: int = 18, image: int = 224, width: int = 64, classes: int = 1000,
                 seed: int = 0, *, name: str = "resnet") -> onnx.ModelProto:
    """Build ResNet-``depth`` as described in the module docstring (image >= 32)."""
    args = {"batch": batch, "depth": depth, "image": image, "width": width, "classes": classes, "seed": seed}
    for key in ("batch", "image", "width", "classes"):
        positive_int(name, key, args[key])
    require(depth in DEPTHS, f"{name}: depth must be one of {sorted(DEPTHS)}, got {depth!r}")
    require(image >= 32, f"{name}: image must be at least 32 (five stride-2 steps), got {image}")
    bottleneck, stages = DEPTHS[depth]
    block = _bottleneck if bottleneck else _basic_block
    g = GraphBuilder(name, seed_int(name, seed))
    x = g.input("input", [batch, 3, image, image])
    x = conv_bn(g, x, "stem.conv", 3, width, 7, stride=2)
    x = g.op("MaxPool", [x], "stem.maxpool", kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])
    channels = width
    for s, count in enumerate(stages):
        planes = width * 2**s
        for b in range(count):
            stride = 2 if (s > 0 and b == 0) else 1
            x, channels = block(g, x, f"layer{s + 1}.{b}", channels, planes, stride)
    y = classifier(g, x, "head", channels, classes)
    g.output(y, [batch, classes])
    return g.build(args, doc=f"ResNet-{depth}, width {width}, {image}x{image}, {classes} classes")
