"""The pre-LayerNorm transformer block shared by ``bert`` and ``gpt``.

One block, for x [b, s, hidden] (node names under ``layer<i>.``)::

    h = LayerNormalization(x)                                   ln1
    q, k, v = MatMul(h, Wq|Wk|Wv) + b                           attn.{q,k,v}_proj(.add)
    q, v -> Reshape [b, s, heads, dh] -> Transpose [b, heads, s, dh]
    k    -> Reshape [b, s, heads, dh] -> Transpose [b, heads, dh, s]   (K^T directly)
    p = Softmax(MatMul(q, k^T) * 1/sqrt(dh) [+ causal mask], axis=-1)
    a = Transpose(MatMul(p, v)) -> Reshape [b, s, hidden] -> MatMul Wo + bo
    x = x + a                                                   attn.residual
    h = LayerNormalization(x)                                   ln2
    m = MatMul(Gelu(MatMul(h, W1) + b1), W2) + b2               mlp.fc1, mlp.gelu.*, mlp.fc2
    x = x + m                                                   mlp.residual

Gelu is written out exactly as x * 0.5 * (1 + Erf(x / sqrt(2))) because the Gelu operator
only exists from opset 20. Reshape targets use 0 ("copy this dim") for batch and sequence, so
the block also works when the batch dimension is symbolic.

Weights: projections into attention/MLP are N(0, 1/fan_in); the two projections back into
the residual stream are further divided by sqrt(2 * layers) so deep stacks stay O(1).
"""

from __future__ import annotations

import math

import numpy as np

from models_zoo.graph_builder import GraphBuilder


def layer_norm(g: GraphBuilder, x: str, prefix: str, hidden: int, *, out: str | None = None) -> str:
    """LayerNormalization over the last axis with random-but-near-identity scale and bias."""
    scale = (1.0 + 0.1 * g.rng.standard_normal(hidden)).astype(np.float32)
    bias = (0.02 * g.rng.standard_normal(hidden)).astype(np.float32)
    return g.op("LayerNormalization",
                [x, g.initializer(f"{prefix}.weight", scale), g.initializer(f"{prefix}.bias", bias)],
                prefix, out=out, axis=-1, epsilon=1e-5)


def linear(g: GraphBuilder, x: str, prefix: str, fin: int, fout: int, *, gain: float = 1.0,
           out: str | None = None) -> str:
    """MatMul (weight [fin, fout]) + Add bias; nodes ``<prefix>`` and ``<prefix>.add``."""
    y = g.op("MatMul", [x, g.he_weight(f"{prefix}.weight", (fin, fout), fin, gain)], prefix)
    return g.op("Add", [y, g.bias(f"{prefix}.bias", fout)], f"{prefix}.add", out=out)


def gelu(g: GraphBuilder, x: str, prefix: str) -> str:
    """Exact Gelu, x * 0.5 * (1 + Erf(x / sqrt(2))), as five nodes."""
    y = g.op("Div", [x, g.const("const.sqrt2", math.sqrt(2.0))], f"{prefix}.div")
    y = g.op("Erf", [y], f"{prefix}.erf")
    y = g.op("Add", [y, g.const("const.one", 1.0)], f"{prefix}.add")
    y = g.op("Mul", [x, y], f"{prefix}.mul")
    return g.op("Mul", [y, g.const("const.half", 0.5)], f"{prefix}.mul_half")


def causal_mask(g: GraphBuilder, seq: int) -> str:
    """A [1, 1, seq, seq] additive mask: 0 on and below the diagonal, -1e9 above it."""
    mask = np.triu(np.full((seq, seq), -1e9, dtype=np.float32), k=1).reshape(1, 1, seq, seq)
    return g.initializer("causal_mask", mask)


def attention(g: GraphBuilder, x: str, p: str, hidden: int, heads: int, layers: int,
              mask: str | None) -> str:
    """Multi-head self-attention of ``x`` (already normalised); returns the projected output."""
    dh = hidden // heads
    split = g.const("const.split_heads_shape", [0, 0, heads, dh], np.int64)
    merge = g.const("const.merge_heads_shape", [0, 0, hidden], np.int64)

    def heads_of(name: str, perm: list[int]) -> str:
        y = linear(g, x, f"{p}.{name}_proj", hidden, hidden)
        y = g.op("Reshape", [y, split], f"{p}.{name}_reshape")
        return g.op("Transpose", [y], f"{p}.{name}_transpose", perm=perm)

    q = heads_of("q", [0, 2, 1, 3])
    kt = heads_of("k", [0, 2, 3, 1])
    v = heads_of("v", [0, 2, 1, 3])
    s = g.op("MatMul", [q, kt], f"{p}.scores")
    s = g.op("Mul", [s, g.const(f"const.attn_scale_{dh}", 1.0 / math.sqrt(dh))], f"{p}.scale")
    if mask is not None:
        s = g.op("Add", [s, mask], f"{p}.mask")
    a = g.op("Softmax", [s], f"{p}.softmax", axis=-1)
    y = g.op("MatMul", [a, v], f"{p}.context")
    y = g.op("Transpose", [y], f"{p}.context_transpose", perm=[0, 2, 1, 3])
    y = g.op("Reshape", [y, merge], f"{p}.context_reshape")
    return linear(g, y, f"{p}.out_proj", hidden, hidden, gain=1.0 / (2 * layers))


def transformer_block(g: GraphBuilder, x: str, p: str, hidden: int, heads: int, layers: int,
                      mask: str | None = None) -> str:
    """One pre-LN block (see the module docstring); ``mask`` is an additive attention mask."""
    h = layer_norm(g, x, f"{p}.ln1", hidden)
    a = attention(g, h, f"{p}.attn", hidden, heads, layers, mask)
    x = g.op("Add", [x, a], f"{p}.attn.residual")
    h = layer_norm(g, x, f"{p}.ln2", hidden)
    m = linear(g, h, f"{p}.mlp.fc1", hidden, 4 * hidden)
    m = gelu(g, m, f"{p}.mlp.gelu")
    m = linear(g, m, f"{p}.mlp.fc2", 4 * hidden, hidden, gain=1.0 / (2 * layers))
    return g.op("Add", [x, m], f"{p}.mlp.residual")
