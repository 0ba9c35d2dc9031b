"""``llama``: a Llama-style decoder (prefill), in standard ONNX ops at opset 18.

Input ``input_ids`` [batch, seq] int64 -> token embedding (Gather) -> ``layers`` blocks ->
RMSNorm -> LM head MatMul [hidden, vocab] -> ``logits`` [batch, seq, vocab]; each block also
returns its KV cache, ``present.<i>.key`` and ``present.<i>.value`` [batch, kv_heads, seq,
head_dim] (after rotary embedding), so a plan must hold them: they are the cache a generation
step would read. One block, for x [b, s, hidden] (node names under ``layer<i>.``)::

    h = RMSNorm(x)          x * Reciprocal(Sqrt(ReduceMean(x*x, -1) + eps)) * w      attn_norm
    q = MatMul(h, Wq)  [b,s,heads*dh] -> Reshape -> Transpose [b,heads,s,dh]
    k = MatMul(h, Wk)  [b,s,kv*dh]    -> Reshape -> Transpose [b,kv,s,dh]
    v = MatMul(h, Wv)  idem                                                   -> present value
    q, k = q*cos + rotate_half(q)*sin   rotate_half(t) = Concat(-t[..., dh/2:], t[..., :dh/2])
                                                                              k -> present key
    k, v: grouped-query attention repeats each of the kv heads heads/kv times
          (Unsqueeze -> Expand -> Reshape [b,heads,s,dh])
    p = Softmax(MatMul(q, k^T) / sqrt(dh) + causal mask);  a = MatMul(p, v)
    x = x + MatMul(Reshape(Transpose(a)), Wo)
    h = RMSNorm(x)                                                             mlp_norm
    x = x + MatMul(Mul(gate * Sigmoid(gate), MatMul(h, Wu)), Wd),  gate = MatMul(h, Wg)  (SwiGLU)

Sizes (:data:`SIZES`): ``tiny`` (real float32 weights, for numeric tests), ``7b`` (Llama-2-7B:
hidden 4096, 32 layers, 32 heads, MLP 11008, vocab 32000) and ``70b`` (Llama-2-70B: hidden
8192, 80 layers, 64 heads of which 8 kv heads, MLP 28672), both float16; any dimension can be
overridden. With ``shapes_only=True`` no weight is generated: every weight is an external-data
reference into ``data_location`` (offsets 4 KiB-aligned, in graph order), and the file is for
the exporter to create sparse (``partitioner zoo export`` does), so a 70B model exports in the
memory of its graph. Real weights are refused above :data:`MAX_REAL_WEIGHT_BYTES`.

Weights: N(0, 1/fan_in), the two projections back into the residual stream further divided by
sqrt(2 * layers); RMSNorm scales near 1; rotary tables and the causal mask are exact constants.
"""

from __future__ import annotations

import math

import numpy as np
import onnx
from onnx import TensorProto, helper

from models_zoo.arguments import positive_int, require, seed_int
from models_zoo.graph_builder import GraphBuilder

SIZES: dict[str, dict[str, object]] = {
    "tiny": dict(hidden=64, intermediate=176, layers=2, heads=4, kv_heads=2, vocab=256, seq=16, dtype="float32"),
    "7b": dict(hidden=4096, intermediate=11008, layers=32, heads=32, kv_heads=32, vocab=32000, seq=1024,
               dtype="float16"),
    "70b": dict(hidden=8192, intermediate=28672, layers=80, heads=64, kv_heads=8, vocab=32000, seq=1024,
                dtype="float16"),
}
MAX_REAL_WEIGHT_BYTES = 2 * 2**30
RMS_EPS = 1e-5
ROPE_THETA = 10000.0
_ALIGN = 4096


class _LlamaBuilder(GraphBuilder):
    """A GraphBuilder whose weights are arrays, or, shapes-only, external-data references."""

    def __init__(self, name: str, seed: int, dtype: np.dtype, shapes_only: bool, location: str) -> None:
        super().__init__(name, seed)
        self.dtype = dtype
        self.shapes_only = shapes_only
        self.location = location
        self.data_bytes = 0  # size of the external data file the references need

    def weight(self, name: str, shape: tuple[int, ...], std: float, mean: float = 0.0) -> str:
        if not self.shapes_only:
            array = (mean + self.rng.standard_normal(shape) * std).astype(self.dtype)
            return self.initializer(name, array)
        name = self.value_name(name)
        length = int(math.prod(shape)) * self.dtype.itemsize
        offset = -(-self.data_bytes // _ALIGN) * _ALIGN
        t = TensorProto(name=name, data_type=helper.np_dtype_to_tensor_dtype(self.dtype), dims=list(shape),
                        data_location=TensorProto.EXTERNAL)
        for key, value in (("location", self.location), ("offset", str(offset)), ("length", str(length))):
            entry = t.external_data.add()
            entry.key, entry.value = key, value
        self._initializers.append(t)
        self.data_bytes = offset + length
        return name


def weight_bytes(size: str = "tiny", **overrides: object) -> int:
    """Bytes of the weights of a ``size`` model with ``overrides`` (no model is built)."""
    a = {**SIZES[size], **{k: v for k, v in overrides.items() if v is not None}}
    h, i, n, kv, vocab = (int(a[k]) for k in ("hidden", "intermediate", "layers", "kv_heads", "vocab"))  # type: ignore[call-overload]
    dh = h // int(a["heads"])  # type: ignore[call-overload]
    per_layer = h * h * 2 + 2 * h * kv * dh + 3 * h * i + 2 * h
    return (n * per_layer + 2 * vocab * h + h) * np.dtype(str(a["dtype"])).itemsize


def _rms_norm(g: _LlamaBuilder, x: str, prefix: str, hidden: int, axes: str, eps: str) -> str:
    sq = g.op("Mul", [x, x], f"{prefix}.square")
    ms = g.op("ReduceMean", [sq, axes], f"{prefix}.mean", keepdims=1)
    rstd = g.op("Reciprocal", [g.op("Sqrt", [g.op("Add", [ms, eps], f"{prefix}.eps")], f"{prefix}.sqrt")],
                f"{prefix}.rstd")
    y = g.op("Mul", [x, rstd], f"{prefix}.normalize")
    return g.op("Mul", [y, g.weight(f"{prefix}.weight", (hidden,), 0.1, mean=1.0)], prefix)


def _rotary_tables(g: _LlamaBuilder, seq: int, dh: int) -> tuple[str, str]:
    """cos and sin [1, 1, seq, dh] in the half-split (rotate_half) layout."""
    inv = 1.0 / ROPE_THETA ** (np.arange(0, dh, 2, dtype=np.float64) / dh)
    angles = np.outer(np.arange(seq, dtype=np.float64), inv)
    full = np.concatenate([angles, angles], axis=-1).reshape(1, 1, seq, dh)
    return (g.initializer("rope.cos", np.cos(full).astype(g.dtype)),
            g.initializer("rope.sin", np.sin(full).astype(g.dtype)))


def _rotate(g: _LlamaBuilder, t: str, prefix: str, cos: str, sin: str, halves: tuple[str, ...],
            out: str | None = None) -> str:
    lo, mid, hi, axis = halves
    first = g.op("Slice", [t, lo, mid, axis], f"{prefix}.first_half")
    second = g.op("Slice", [t, mid, hi, axis], f"{prefix}.second_half")
    rot = g.op("Concat", [g.op("Neg", [second], f"{prefix}.neg"), first], f"{prefix}.rotate_half", axis=-1)
    return g.op("Add", [g.op("Mul", [t, cos], f"{prefix}.cos"), g.op("Mul", [rot, sin], f"{prefix}.sin")],
                f"{prefix}.rope", out=out)


def _block(g: _LlamaBuilder, x: str, i: int, a: dict[str, int], consts: dict[str, object]) -> str:
    b, s, h, heads, kv, inter, layers = (a[k] for k in ("batch", "seq", "hidden", "heads", "kv_heads",
                                                        "intermediate", "layers"))
    dh, p = h // heads, f"layer{i}"
    c: dict = consts
    hn = _rms_norm(g, x, f"{p}.attn_norm", h, c["axes"], c["eps"])

    def project(tag: str, n_heads: int) -> str:
        w = g.weight(f"{p}.attn.{tag}_proj.weight", (h, n_heads * dh), 1.0 / math.sqrt(h))
        y = g.op("MatMul", [hn, w], f"{p}.attn.{tag}_proj")
        y = g.op("Reshape", [y, g.const(f"const.heads_{n_heads}", [b, s, n_heads, dh], np.int64)],
                 f"{p}.attn.{tag}_reshape")
        return g.op("Transpose", [y], f"{p}.attn.{tag}_transpose", perm=[0, 2, 1, 3],
                    out=f"present.{i}.value" if tag == "v" else None)

    q = _rotate(g, project("q", heads), f"{p}.attn.q", c["cos"], c["sin"], c["halves"])
    k = _rotate(g, project("k", kv), f"{p}.attn.k", c["cos"], c["sin"], c["halves"], out=f"present.{i}.key")
    v = project("v", kv)
    if kv != heads:  # grouped-query attention: each kv head serves heads/kv query heads
        def repeat(t: str, tag: str) -> str:
            y = g.op("Unsqueeze", [t, g.const("const.axis2", [2], np.int64)], f"{p}.attn.{tag}_unsqueeze")
            y = g.op("Expand", [y, g.const("const.gqa_expand", [b, kv, heads // kv, s, dh], np.int64)],
                     f"{p}.attn.{tag}_expand")
            return g.op("Reshape", [y, g.const("const.gqa_merge", [b, heads, s, dh], np.int64)],
                        f"{p}.attn.{tag}_repeat")
        k, v = repeat(k, "k"), repeat(v, "v")
    kt = g.op("Transpose", [k], f"{p}.attn.k_t", perm=[0, 1, 3, 2])
    scores = g.op("MatMul", [q, kt], f"{p}.attn.scores")
    scores = g.op("Mul", [scores, g.const(f"const.scale_{dh}", 1.0 / math.sqrt(dh), g.dtype)], f"{p}.attn.scale")
    scores = g.op("Add", [scores, c["mask"]], f"{p}.attn.mask")
    probs = g.op("Softmax", [scores], f"{p}.attn.softmax", axis=-1)
    ctx = g.op("MatMul", [probs, v], f"{p}.attn.context")
    ctx = g.op("Transpose", [ctx], f"{p}.attn.context_transpose", perm=[0, 2, 1, 3])
    ctx = g.op("Reshape", [ctx, g.const("const.merge_heads", [b, s, h], np.int64)], f"{p}.attn.context_reshape")
    resid_std = 1.0 / math.sqrt(2 * layers)
    o = g.op("MatMul", [ctx, g.weight(f"{p}.attn.o_proj.weight", (h, h), resid_std / math.sqrt(h))],
             f"{p}.attn.o_proj")
    x = g.op("Add", [x, o], f"{p}.attn.residual")
    hn = _rms_norm(g, x, f"{p}.mlp_norm", h, c["axes"], c["eps"])
    gate = g.op("MatMul", [hn, g.weight(f"{p}.mlp.gate_proj.weight", (h, inter), 1.0 / math.sqrt(h))],
                f"{p}.mlp.gate_proj")
    up = g.op("MatMul", [hn, g.weight(f"{p}.mlp.up_proj.weight", (h, inter), 1.0 / math.sqrt(h))],
              f"{p}.mlp.up_proj")
    silu = g.op("Mul", [gate, g.op("Sigmoid", [gate], f"{p}.mlp.sigmoid")], f"{p}.mlp.silu")
    m = g.op("Mul", [silu, up], f"{p}.mlp.swiglu")
    m = g.op("MatMul", [m, g.weight(f"{p}.mlp.down_proj.weight", (inter, h), resid_std / math.sqrt(inter))],
             f"{p}.mlp.down_proj")
    return g.op("Add", [x, m], f"{p}.mlp.residual")


def build_llama(size: str = "tiny", batch: int = 1, seq: int | None = None, hidden: int | None = None,
                intermediate: int | None = None, heads: int | None = None, kv_heads: int | None = None,
                layers: int | None = None, vocab: int | None = None, shapes_only: bool = False,
                data_location: str = "llama.data", seed: int = 0, *, name: str = "llama") -> onnx.ModelProto:
    """Build the decoder of the module docstring at ``size`` with any dimension overridden."""
    require(size in SIZES, f"{name}: size must be one of {', '.join(SIZES)}, got {size!r}")
    base = SIZES[size]
    given = {"seq": seq, "hidden": hidden, "intermediate": intermediate, "heads": heads, "kv_heads": kv_heads,
             "layers": layers, "vocab": vocab}
    a: dict[str, int] = {k: positive_int(name, k, v if v is not None else base[k]) for k, v in given.items()}
    a["batch"] = positive_int(name, "batch", batch)
    seed_int(name, seed)
    require(a["hidden"] % a["heads"] == 0, f"{name}: hidden {a['hidden']} must be divisible by heads {a['heads']}")
    require(a["heads"] % a["kv_heads"] == 0, f"{name}: heads {a['heads']} must be divisible by kv_heads {a['kv_heads']}")
    require((a["hidden"] // a["heads"]) % 2 == 0, f"{name}: the head size must be even for rotary embedding")
    require(bool(data_location) and "/" not in data_location and "\\" not in data_location and data_location != "..",
            f"{name}: data_location must be a plain file name beside the model, got {data_location!r}")
    dtype = np.dtype(str(base["dtype"]))
    need = weight_bytes(size, **given)
    require(shapes_only or need <= MAX_REAL_WEIGHT_BYTES,
            f"{name}: size {size} has {need / 2**30:.1f} GiB of weights; export it with --shapes-only "
            f"(real weights are generated up to {MAX_REAL_WEIGHT_BYTES / 2**30:.0f} GiB)")
    args = {"size": size, **a, "shapes_only": bool(shapes_only), "seed": seed}
    g = _LlamaBuilder(name, seed, dtype, bool(shapes_only), data_location)
    b, s, h = a["batch"], a["seq"], a["hidden"]
    dh = h // a["heads"]
    ids = g.input("input_ids", [b, s], TensorProto.INT64)
    table = g.weight("embed_tokens.weight", (a["vocab"], h), 1.0)
    x = g.op("Gather", [table, ids], "embed_tokens", axis=0)
    cos, sin = _rotary_tables(g, s, dh)
    mask = np.triu(np.full((s, s), -1e4 if dtype == np.float16 else -1e9), k=1).reshape(1, 1, s, s)
    consts = {
        "axes": g.const("const.last_axis", [-1], np.int64), "eps": g.const("const.rms_eps", RMS_EPS, dtype),
        "cos": cos, "sin": sin, "mask": g.initializer("causal_mask", mask.astype(dtype)),
        "halves": (g.const("const.zero", [0], np.int64), g.const("const.half_head", [dh // 2], np.int64),
                   g.const("const.head", [dh], np.int64), g.const("const.axis3", [3], np.int64)),
    }
    for i in range(a["layers"]):
        x = _block(g, x, i, a, consts)
    x = _rms_norm(g, x, "norm", h, consts["axes"], consts["eps"])
    logits = g.op("MatMul", [x, g.weight("lm_head.weight", (h, a["vocab"]), 1.0 / math.sqrt(h))], "lm_head",
                  out="logits")
    elem = helper.np_dtype_to_tensor_dtype(dtype)
    g.output(logits, [b, s, a["vocab"]], elem)
    for i in range(a["layers"]):
        for kind in ("key", "value"):
            g.output(f"present.{i}.{kind}", [b, a["kv_heads"], s, dh], elem)
    model = g.build(args, doc=f"Llama-style decoder ({size}): {a['layers']} layers, hidden {h}, {a['heads']} heads "
                              f"({a['kv_heads']} kv), MLP {a['intermediate']}, seq {s}, vocab {a['vocab']}, {dtype}")
    if shapes_only:
        helper.set_model_props(model, {**{p.key: p.value for p in model.metadata_props},
                                       "partitioner.external_data_bytes": str(g.data_bytes)})
    return model
