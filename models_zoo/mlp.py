"""``mlp``: a stack of fully connected layers with ReLU.

Input ``input`` [batch, in_features] -> ``layers`` hidden layers of ``hidden`` units with ReLU
-> a classifier Gemm to ``out_features`` -> output ``logits`` [batch, out_features].

Even hidden layers are MatMul+Add (weights [in, out]); odd hidden layers and the classifier are
Gemm with transB=1 (weights [out, in]), so both linear forms appear in one model.
"""

from __future__ import annotations

import onnx

from models_zoo.arguments import positive_int, seed_int
from models_zoo.graph_builder import GraphBuilder


def build_mlp(batch: int = 1, layers: int = 3, hidden: int = 256, in_features: int = 128,
              out_features: int = 10, seed: int = 0, *, name: str = "mlp") -> onnx.ModelProto:
    """Build the MLP described in the module docstring."""
    args = {"batch": batch, "layers": layers, "hidden": hidden, "in_features": in_features,
            "out_features": out_features, "seed": seed}
    for key in ("batch", "layers", "hidden", "in_features", "out_features"):
        positive_int(name, key, args[key])
    g = GraphBuilder(name, seed_int(name, seed))
    x = g.input("input", [batch, in_features])
    width = in_features
    for i in range(layers):
        p = f"fc{i}"
        if i % 2 == 0:
            w = g.he_weight(f"{p}.weight", (width, hidden), width)
            y = g.op("MatMul", [x, w], f"{p}.matmul")
            y = g.op("Add", [y, g.bias(f"{p}.bias", hidden)], f"{p}.add")
        else:
            w = g.he_weight(f"{p}.weight", (hidden, width), width)
            y = g.op("Gemm", [x, w, g.bias(f"{p}.bias", hidden)], f"{p}.gemm", transB=1)
        x = g.op("Relu", [y], f"{p}.relu")
        width = hidden
    w = g.he_weight("head.weight", (out_features, width), width, gain=1.0)
    y = g.op("Gemm", [x, w, g.bias("head.bias", out_features)], "head.gemm", out="logits", transB=1)
    g.output(y, [batch, out_features])
    return g.build(args, doc=f"MLP: {layers} hidden layers of {hidden}, {in_features} -> {out_features}")
