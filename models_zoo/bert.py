"""``bert``: a BERT-style (pre-LayerNorm) encoder.

Input ``input_ids`` [batch, seq] int64 in [0, vocab) -> Gather from a token embedding
[vocab, hidden] + Add a position embedding [seq, hidden] -> ``layers`` transformer blocks
(:mod:`models_zoo.transformer`, no mask) -> final LayerNormalization -> output
``last_hidden_state`` [batch, seq, hidden].
"""

from __future__ import annotations

import onnx
from onnx import TensorProto

from models_zoo.arguments import positive_int, require, seed_int
from models_zoo.graph_builder import GraphBuilder
from models_zoo.transformer import layer_norm, transformer_block


def embed(g: GraphBuilder, batch: int | str, seq: int, hidden: int, vocab: int) -> str:
    """Token ids input -> token embedding (Gather) + position embedding (Add)."""
    ids = g.input("input_ids", [batch, seq], TensorProto.INT64)
    table = g.normal("embeddings.token.weight", (vocab, hidden), 1.0)
    x = g.op("Gather", [table, ids], "embeddings.token", axis=0)
    return g.op("Add", [x, g.normal("embeddings.position.weight", (seq, hidden), 0.5)], "embeddings.position")


def check_transformer_args(name: str, args: dict[str, object]) -> None:
    """Shared checks for bert and gpt arguments."""
    for key in ("batch", "seq", "hidden", "heads", "layers", "vocab"):
        positive_int(name, key, args[key])
    seed_int(name, args["seed"])
    require(args["hidden"] % args["heads"] == 0,  # type: ignore[operator]
            f"{name}: hidden ({args['hidden']}) must be divisible by heads ({args['heads']})")


def build_bert(batch: int = 1, seq: int = 32, hidden: int = 64, heads: int = 4, layers: int = 2,
               vocab: int = 1000, seed: int = 0, *, name: str = "bert") -> onnx.ModelProto:
    """Build the encoder described in the module docstring."""
    args = {"batch": batch, "seq": seq, "hidden": hidden, "heads": heads, "layers": layers,
            "vocab": vocab, "seed": seed}
    check_transformer_args(name, args)
    g = GraphBuilder(name, seed)
    x = embed(g, batch, seq, hidden, vocab)
    for i in range(layers):
        x = transformer_block(g, x, f"layer{i}", hidden, heads, layers)
    y = layer_norm(g, x, "final_ln", hidden, out="last_hidden_state")
    g.output(y, [batch, seq, hidden])
    return g.build(args, doc=f"BERT-style encoder: {layers} layers, hidden {hidden}, {heads} heads, "
                             f"seq {seq}")

