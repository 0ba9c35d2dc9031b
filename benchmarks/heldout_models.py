"""Held-out architectures for the per-device benchmark: models the schedules were NOT tuned on.

The zoo (``models_zoo``) is what the default schedules were written against, so it is no fair
sample of what a user brings. These four generators are written independently of the zoo's
builders (only the :class:`~models_zoo.graph_builder.GraphBuilder` mechanism is shared: seeded
weights, unique names) and use shapes and ops the zoo does not:

1. ``vit``: a small Vision Transformer. Patch embedding Conv k=s=patch, a learned class token
   (Concat) and position embedding, pre-norm blocks with ONNX ``LayerNormalization``,
   multi-head attention as Reshape/Transpose/MatMul/Softmax, an exact-erf GELU MLP (x4),
   head on the class token.
2. ``mbv2``: a MobileNetV2-style net at width 0.75 with 5x5 depthwise convs in its later
   stages (MnasNet-style), each Conv -> BatchNormalization -> ReLU6 (``Clip`` with inputs).
3. ``inception``: an Inception-v3-style DAG: factorised asymmetric 1x7 / 7x1 convs, an
   AveragePool(3x3, count_include_pad=0) branch, a double-3x3 branch, BN + Relu on each
   Conv, four-way Concat, a strided reduction module with a MaxPool branch.
4. ``unet``: a U-Net with BN + Relu double convs, ConvTranspose (2x2, stride 2) on one
   decoder level and bilinear ``Resize`` (linear, half_pixel) + 3x3 Conv on the other,
   skip Concat, Sigmoid output.

Every generator is ``build(batch, seed=0) -> ModelProto`` with seeded random weights (He-scaled,
so activations stay O(1) and rtol 1e-4 against ONNX Runtime means something). Sizes are small
enough for a 2-core benchmark run.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Callable

import numpy as np
import onnx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from models_zoo.graph_builder import GraphBuilder  # noqa: E402


def _conv(g: GraphBuilder, x: str, p: str, cin: int, cout: int, kh: int, kw: int | None = None, *,
          stride: int = 1, group: int = 1, bias: bool = False) -> str:
    kw = kh if kw is None else kw
    fan_in = cin // group * kh * kw
    ins = [x, g.he_weight(f"{p}.weight", (cout, cin // group, kh, kw), fan_in)]
    if bias:
        ins.append(g.bias(f"{p}.bias", cout))
    ph, pw = (kh - 1) // 2, (kw - 1) // 2
    return g.op("Conv", ins, p, kernel_shape=[kh, kw], strides=[stride, stride], pads=[ph, pw, ph, pw], group=group)


def _bn_act(g: GraphBuilder, x: str, p: str, c: int, act: str | None) -> str:
    # inputs to BN have mean square ~2 after He-scaled convs on unit inputs
    y = g.op("BatchNormalization", [x, *g.batchnorm_params(f"{p}.bn", c, input_moment=2.0)], f"{p}.bn", epsilon=1e-5)
    if act == "relu":
        return g.op("Relu", [y], f"{p}.relu")
    if act == "relu6":
        return g.op("Clip", [y, g.const("relu6.min", 0.0), g.const("relu6.max", 6.0)], f"{p}.relu6")
    return y


def _cba(g: GraphBuilder, x: str, p: str, cin: int, cout: int, kh: int, kw: int | None = None, *,
         stride: int = 1, group: int = 1, act: str | None = "relu") -> str:
    """Conv -> BatchNormalization -> activation."""
    return _bn_act(g, _conv(g, x, p, cin, cout, kh, kw, stride=stride, group=group), p, cout, act)


def _linear(g: GraphBuilder, x: str, p: str, din: int, dout: int) -> str:
    y = g.op("MatMul", [x, g.he_weight(f"{p}.weight", (din, dout), din, gain=1.0)], p)
    return g.op("Add", [y, g.bias(f"{p}.bias", dout)], f"{p}.add")


def _layernorm(g: GraphBuilder, x: str, p: str, d: int) -> str:
    scale = g.initializer(f"{p}.scale", (1.0 + 0.1 * g.rng.standard_normal(d)).astype(np.float32))
    return g.op("LayerNormalization", [x, scale, g.bias(f"{p}.bias", d)], p, axis=-1, epsilon=1e-5)


def _gelu(g: GraphBuilder, x: str, p: str) -> str:
    e = g.op("Erf", [g.op("Div", [x, g.const("sqrt2", math.sqrt(2.0))], f"{p}.div")], f"{p}.erf")
    h = g.op("Mul", [g.op("Add", [e, g.const("one", 1.0)], f"{p}.add"), g.const("half", 0.5)], f"{p}.half")
    return g.op("Mul", [x, h], f"{p}.mul")


def build_vit(batch: int = 1, seed: int = 0, image: int = 32, patch: int = 4, dim: int = 96, heads: int = 4,
              layers: int = 2, classes: int = 100) -> onnx.ModelProto:
    """ViT (module docstring, item 1): tokens = (image/patch)^2 + 1."""
    g = GraphBuilder("heldout_vit", seed)
    tokens, hd = (image // patch) ** 2, dim // heads
    x = g.input("input", [batch, 3, image, image])
    x = g.op("Conv", [x, g.he_weight("patch.weight", (dim, 3, patch, patch), 3 * patch * patch, gain=1.0),
                      g.bias("patch.bias", dim)], "patch", kernel_shape=[patch, patch], strides=[patch, patch])
    x = g.op("Reshape", [x, g.const("shape.flat", [0, dim, -1], np.int64)], "patch.flat")
    x = g.op("Transpose", [x], "patch.tokens", perm=[0, 2, 1])
    cls = g.initializer("cls", np.tile(g.rng.standard_normal((1, 1, dim)).astype(np.float32), (batch, 1, 1)))
    x = g.op("Concat", [cls, x], "tokens", axis=1)
    x = g.op("Add", [x, g.normal("pos", (1, tokens + 1, dim), 0.5)], "pos.add")
    n = tokens + 1
    for i in range(layers):
        p = f"block{i}"
        h = _layernorm(g, x, f"{p}.ln1", dim)
        split = g.const("shape.heads", [0, 0, heads, hd], np.int64)
        q, k, v = (g.op("Transpose", [g.op("Reshape", [_linear(g, h, f"{p}.{t}", dim, dim), split], f"{p}.{t}.split")],
                        f"{p}.{t}.t", perm=perm)
                   for t, perm in (("q", [0, 2, 1, 3]), ("k", [0, 2, 3, 1]), ("v", [0, 2, 1, 3])))
        s = g.op("Div", [g.op("MatMul", [q, k], f"{p}.qk"), g.const(f"scale{hd}", math.sqrt(hd))], f"{p}.scale")
        a = g.op("MatMul", [g.op("Softmax", [s], f"{p}.softmax", axis=-1), v], f"{p}.pv")
        a = g.op("Reshape", [g.op("Transpose", [a], f"{p}.merge", perm=[0, 2, 1, 3]),
                             g.const("shape.merged", [0, 0, dim], np.int64)], f"{p}.merged")
        x = g.op("Add", [x, _linear(g, a, f"{p}.proj", dim, dim)], f"{p}.res1")
        h = _gelu(g, _linear(g, _layernorm(g, x, f"{p}.ln2", dim), f"{p}.fc1", dim, 4 * dim), f"{p}.gelu")
        x = g.op("Add", [x, _linear(g, h, f"{p}.fc2", 4 * dim, dim)], f"{p}.res2")
    x = _layernorm(g, x, "ln", dim)
    c = g.op("Gather", [x, g.const("zero", 0, np.int64)], "cls.take", axis=1)
    y = g.op("Gemm", [c, g.he_weight("head.weight", (dim, classes), dim, gain=1.0), g.bias("head.bias", classes)],
             "head", out="logits")
    g.output(y, [batch, classes])
    return g.build({"batch": batch, "seed": seed}, doc="held-out ViT")


#: (expansion, output channels at width 1, repeats, first stride, depthwise kernel)
MBV2_STAGES = ((1, 16, 1, 1, 3), (6, 24, 2, 2, 3), (6, 32, 2, 2, 5), (6, 64, 2, 2, 3), (6, 96, 1, 1, 5),
               (6, 160, 2, 2, 5))


def build_mbv2(batch: int = 1, seed: int = 0, image: int = 96, width: float = 0.75,
               classes: int = 100) -> onnx.ModelProto:
    """MobileNetV2-style (module docstring, item 2)."""
    g = GraphBuilder("heldout_mbv2", seed)
    ch = lambda c: max(8, int(c * width + 4) // 8 * 8)  # noqa: E731
    x = g.input("input", [batch, 3, image, image])
    cin = ch(32)
    x = _cba(g, x, "stem", 3, cin, 3, stride=2, act="relu6")
    for s, (t, c, reps, stride, kd) in enumerate(MBV2_STAGES):
        cout = ch(c)
        for r in range(reps):
            p, hid = f"s{s}.b{r}", cin * t
            y = _cba(g, x, f"{p}.expand", cin, hid, 1, act="relu6") if t > 1 else x
            y = _cba(g, y, f"{p}.dw", hid, hid, kd, stride=stride if r == 0 else 1, group=hid, act="relu6")
            y = _cba(g, y, f"{p}.project", hid, cout, 1, act=None)
            x = g.op("Add", [x, y], f"{p}.res") if (r > 0 or stride == 1) and cin == cout else y
            cin = cout
    x = _cba(g, x, "last", cin, 640, 1, act="relu6")
    x = g.op("Flatten", [g.op("GlobalAveragePool", [x], "pool")], "flat", axis=1)
    y = g.op("Gemm", [x, g.he_weight("fc.weight", (classes, 640), 640, gain=1.0), g.bias("fc.bias", classes)],
             "fc", out="logits", transB=1)
    g.output(y, [batch, classes])
    return g.build({"batch": batch, "seed": seed}, doc="held-out MobileNetV2-style")


def _inception_a(g: GraphBuilder, x: str, p: str, cin: int, w: int) -> tuple[str, int]:
    b1 = _cba(g, x, f"{p}.b1", cin, w, 1)
    b2 = _cba(g, _cba(g, x, f"{p}.b2a", cin, w, 1), f"{p}.b2b", w, w, 1, 7)
    b2 = _cba(g, b2, f"{p}.b2c", w, w, 7, 1)
    b3 = _cba(g, _cba(g, x, f"{p}.b3a", cin, w // 2, 1), f"{p}.b3b", w // 2, w, 3)
    b3 = _cba(g, b3, f"{p}.b3c", w, w, 3)
    b4 = g.op("AveragePool", [x], f"{p}.pool", kernel_shape=[3, 3], pads=[1, 1, 1, 1], count_include_pad=0)
    b4 = _cba(g, b4, f"{p}.b4", cin, w, 1)
    return g.op("Concat", [b1, b2, b3, b4], f"{p}.cat", axis=1), 4 * w


def _reduction(g: GraphBuilder, x: str, p: str, cin: int, w: int) -> tuple[str, int]:
    b1 = _cba(g, x, f"{p}.b1", cin, w, 3, stride=2)
    b2 = _cba(g, _cba(g, x, f"{p}.b2a", cin, w // 2, 1), f"{p}.b2b", w // 2, w, 3, stride=2)
    b3 = g.op("MaxPool", [x], f"{p}.pool", kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])
    return g.op("Concat", [b1, b2, b3], f"{p}.cat", axis=1), 2 * w + cin


def build_inception(batch: int = 1, seed: int = 0, image: int = 64, classes: int = 100) -> onnx.ModelProto:
    """Inception-v3-style DAG (module docstring, item 3)."""
    g = GraphBuilder("heldout_inception", seed)
    x = g.input("input", [batch, 3, image, image])
    x = _cba(g, x, "stem1", 3, 32, 3, stride=2)
    x = _cba(g, x, "stem2", 32, 48, 3)
    c = 48
    x, c = _inception_a(g, x, "mixed0", c, 24)
    x, c = _inception_a(g, x, "mixed1", c, 32)
    x, c = _reduction(g, x, "reduce0", c, 64)
    x, c = _inception_a(g, x, "mixed2", c, 48)
    x, c = _reduction(g, x, "reduce1", c, 96)
    x, c = _inception_a(g, x, "mixed3", c, 64)
    x = g.op("Flatten", [g.op("GlobalAveragePool", [x], "pool")], "flat", axis=1)
    y = g.op("Gemm", [x, g.he_weight("fc.weight", (classes, c), c, gain=1.0), g.bias("fc.bias", classes)],
             "fc", out="logits", transB=1)
    g.output(y, [batch, classes])
    return g.build({"batch": batch, "seed": seed}, doc="held-out Inception-style DAG")


def build_unet(batch: int = 1, seed: int = 0, image: int = 64, base: int = 16, classes: int = 3) -> onnx.ModelProto:
    """U-Net (module docstring, item 4): two levels down, bottleneck, two up."""
    g = GraphBuilder("heldout_unet", seed)
    x = g.input("input", [batch, 3, image, image])
    skips, cin = [], 3
    for lvl in range(2):
        c = base * 2**lvl
        x = _cba(g, _cba(g, x, f"down{lvl}.c1", cin, c, 3), f"down{lvl}.c2", c, c, 3)
        skips.append((x, c))
        x = g.op("MaxPool", [x], f"down{lvl}.pool", kernel_shape=[2, 2], strides=[2, 2])
        cin = c
    c = base * 4
    x = _cba(g, _cba(g, x, "mid.c1", cin, c, 3), "mid.c2", c, c, 3)
    cin = c
    for lvl in reversed(range(2)):
        skip, c = skips[lvl]
        p = f"up{lvl}"
        if lvl == 1:
            w = g.he_weight(f"{p}.up.weight", (cin, c, 2, 2), cin, gain=1.0)
            x = g.op("ConvTranspose", [x, w, g.bias(f"{p}.up.bias", c)], f"{p}.up", kernel_shape=[2, 2],
                     strides=[2, 2])
        else:
            x = g.op("Resize", [x, "", g.const("scales2", [1, 1, 2, 2])], f"{p}.resize", mode="linear",
                     coordinate_transformation_mode="half_pixel")
            x = _conv(g, x, f"{p}.proj", cin, c, 3, bias=True)
        x = g.op("Concat", [x, skip], f"{p}.cat", axis=1)
        x = _cba(g, _cba(g, x, f"{p}.c1", 2 * c, c, 3), f"{p}.c2", c, c, 3)
        cin = c
    y = g.op("Conv", [x, g.he_weight("head.weight", (classes, cin, 1, 1), cin, gain=1.0), g.bias("head.bias", classes)],
             "head", kernel_shape=[1, 1])
    y = g.op("Sigmoid", [y], "head.sigmoid", out="output")
    g.output(y, [batch, classes, image, image])
    return g.build({"batch": batch, "seed": seed}, doc="held-out U-Net")


#: benchmark key -> generator(batch, seed, **size)
HELDOUT: dict[str, Callable[..., onnx.ModelProto]] = {
    "heldout_vit": build_vit, "heldout_mbv2": build_mbv2, "heldout_inception": build_inception,
    "heldout_unet": build_unet,
}
#: small sizes for the fast tests (same code paths, seconds to compile and run)
TINY: dict[str, dict[str, int]] = {
    "heldout_vit": {"image": 16, "dim": 32, "heads": 2, "layers": 1, "classes": 10},
    "heldout_mbv2": {"image": 32, "classes": 10},
    "heldout_inception": {"image": 24, "classes": 10},
    "heldout_unet": {"image": 16, "base": 8},
}


def build(key: str, batch: int = 1, seed: int = 0, **size: int) -> onnx.ModelProto:
    """The held-out model ``key`` (a :data:`HELDOUT` name) at ``batch``, shape-inferred."""
    return onnx.shape_inference.infer_shapes(HELDOUT[key](batch, seed, **size))
