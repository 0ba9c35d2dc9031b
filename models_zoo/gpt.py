"""``gpt``: a GPT-style causal decoder (pre-LayerNorm).

Input ``input_ids`` [batch, seq] int64 in [0, vocab) -> token embedding (Gather) + position
embedding (Add of a [seq, hidden] initializer) -> ``layers`` transformer blocks with an
additive causal mask (a [1, 1, seq, seq] initializer, -1e9 above the diagonal, added to the
scaled scores before Softmax) -> final LayerNormalization -> LM head MatMul [hidden, vocab] ->
output ``logits`` [batch, seq, vocab].

With ``symbolic_batch=True`` the batch dimension of the input and the output is the symbolic
dim ``"batch"``; every other dimension stays static, so the model is fully static once the
batch is bound. It builds in well under a second per dozen layers at small hidden sizes, so
``layers=48`` (about 2,000 nodes) is cheap.
"""

from __future__ import annotations

import onnx

from models_zoo.bert import check_transformer_args, embed
from models_zoo.graph_builder import GraphBuilder
from models_zoo.transformer import causal_mask, layer_norm, transformer_block

SYMBOLIC_BATCH = "batch"


def build_gpt(batch: int = 1, seq: int = 32, hidden: int = 64, heads: int = 4, layers: int = 2,
              vocab: int = 1000, symbolic_batch: bool = False, seed: int = 0, *,
              name: str = "gpt") -> onnx.ModelProto:
    """Build the decoder described in the module docstring."""
    args = {"batch": batch, "seq": seq, "hidden": hidden, "heads": heads, "layers": layers,
            "vocab": vocab, "symbolic_batch": bool(symbolic_batch), "seed": seed}
    check_transformer_args(name, args)
    b: int | str = SYMBOLIC_BATCH if symbolic_batch else batch
    g = GraphBuilder(name, seed)
    x = embed(g, b, seq, hidden, vocab)
    mask = causal_mask(g, seq)
    for i in range(layers):
        x = transformer_block(g, x, f"layer{i}", hidden, heads, layers, mask)
    x = layer_norm(g, x, "final_ln", hidden)
    y = g.op("MatMul", [x, g.he_weight("lm_head.weight", (hidden, vocab), hidden, gain=1.0)], "lm_head",
             out="logits")
    g.output(y, [b, seq, vocab])
    return g.build(args, doc=f"GPT-style decoder: {layers} layers, hidden {hidden}, {heads} heads, "
                             f"seq {seq}, vocab {vocab}")
