"""The model zoo: deterministic ONNX model builders and loaders for real architectures.

Public API:

- :func:`list_models` -> every :class:`ZooEntry` (builders first, then the onnx light models).
- :func:`build` ``(name, **kwargs)`` -> ``onnx.ModelProto``.
- :func:`is_zoo_name` ``(name)`` -> whether ``build(name)`` knows the name.

Rules: a builder model is a function of its arguments alone (weights come from
``numpy.random.default_rng(seed)``), so building twice gives byte-identical bytes. Keyword
arguments set to ``None`` are ignored (the CLI passes every option it has). Unknown names and
unknown arguments raise :class:`partitioner.core.errors.UsageError` listing what is accepted. Every
builder model uses opset :data:`OPSET`, its graph is named after the zoo name, and all its
values have static shapes after ONNX shape inference (except ``gpt`` with
``symbolic_batch=True``, whose batch dim is the symbolic ``"batch"``).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import onnx

from models_zoo.bert import build_bert
from models_zoo.gpt import build_gpt
from models_zoo.graph_builder import OPSET, PRODUCER_NAME
from models_zoo.inception import build_inception
from models_zoo.light import describe as _describe_light
from models_zoo.light import light_names, load_light
from models_zoo.llama import build_llama
from models_zoo.sample_inputs import sample_inputs
from models_zoo.mlp import build_mlp
from models_zoo.mobilenet import build_mobilenet
from models_zoo.resnet import build_resnet
from models_zoo.unet import build_unet
from partitioner.core.errors import UsageError

__all__ = [
    "sample_inputs","ZooEntry", "list_models", "build", "is_zoo_name", "OPSET", "PRODUCER_NAME"]


@dataclass(frozen=True)
class ZooEntry:
    """One zoo model: its name, kind ("builder" or "light"), a one-line description and the
    default arguments ``build`` accepts (``params``)."""

    name: str
    kind: Literal["builder", "light"]
    description: str
    params: dict[str, Any] = field(default_factory=dict, hash=False, compare=True)


@dataclass(frozen=True)
class _Builder:
    fn: Callable[..., onnx.ModelProto]
    description: str
    fixed: dict[str, Any] = field(default_factory=dict)  # arguments an alias pins
    alias_of: str | None = None  # the general zoo name an alias pins arguments of

    def params(self) -> dict[str, Any]:
        sig = inspect.signature(self.fn)
        defaults = {k: p.default for k, p in sig.parameters.items()
                    if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD}
        return {**defaults, **self.fixed}


_BUILDERS: dict[str, _Builder] = {
    "mlp": _Builder(build_mlp, "MLP: MatMul+Add and Gemm layers with Relu"),
    "resnet": _Builder(build_resnet, "ResNet-18/34/50/101/152: Conv+BN+Relu, residual blocks, MaxPool, "
                                     "GAP, Gemm"),
    "resnet50": _Builder(build_resnet, "ResNet-50 (bottleneck blocks); alias of resnet depth=50",
                         {"depth": 50}, alias_of="resnet"),
    "bert": _Builder(build_bert, "BERT-style encoder: Gather embeddings, LayerNorm, multi-head attention, "
                                 "erf Gelu MLP"),
    "gpt": _Builder(build_gpt, "GPT-style causal decoder with LM head; optional symbolic batch"),
    "unet": _Builder(build_unet, "U-Net: MaxPool down, ConvTranspose/Resize up, Concat skips"),
    "inception": _Builder(build_inception, "Inception: 1x1/3x3/5x5/pool branches concatenated"),
    "mobilenet": _Builder(build_mobilenet, "MobileNetV2: depthwise+pointwise Conv, BN, ReLU6 (Clip), "
                                           "inverted residuals"),
    "llama": _Builder(build_llama, "Llama-style decoder: RMSNorm, rotary embedding, grouped-query attention, "
                                   "SwiGLU MLP, KV cache outputs; sizes tiny, 7b, 70b (--shapes-only)"),
}


def list_models() -> list[ZooEntry]:
    """Every zoo model, builders first (in a fixed order), then the light models sorted by name."""
    entries = [ZooEntry(name, "builder", b.description, b.params()) for name, b in _BUILDERS.items()]
    entries += [ZooEntry(name, "light", _describe_light(name), {"batch": 1}) for name in light_names()]
    return entries


def is_zoo_name(name: str) -> bool:
    """Whether ``name`` is a zoo model name (a builder or a light model)."""
    return name in _BUILDERS or name in light_names()


def _valid_names() -> str:
    return ", ".join([*_BUILDERS, *light_names()])


def build(name: str, **kwargs: Any) -> onnx.ModelProto:
    """Build (or load) the zoo model ``name`` with ``kwargs`` over its defaults.

    ``None`` values are ignored. Raises UsageError for an unknown name, an unknown argument, a
    bad value, or a ``batch`` other than 1 for a light model.
    """
    given = {k: v for k, v in kwargs.items() if v is not None}
    if name in _BUILDERS:
        builder = _BUILDERS[name]
        accepted = builder.params()
        unknown = sorted(set(given) - set(accepted))
        if unknown:
            raise UsageError(f"zoo model {name!r} does not take {', '.join(unknown)}; "
                             f"it accepts: {', '.join(accepted)}")
        for key, value in builder.fixed.items():
            if key in given and given[key] != value:
                raise UsageError(f"zoo model {name!r} has {key}={value} fixed, got {key}={given[key]}; "
                                 f"use {builder.alias_of!r} with {key}={given[key]} instead")
        return builder.fn(**{**accepted, **given}, name=name)
    if name in light_names():
        unknown = sorted(set(given) - {"batch", "weights", "seed"})
        if unknown:
            raise UsageError(f"zoo model {name!r} is a fixed real model and does not take "
                             f"{', '.join(unknown)}; it accepts: batch (=1 only), "
                             "weights (random|as_shipped), seed")
        return load_light(name, given.get("batch"), given.get("weights", "random"), int(given.get("seed", 0)))
    raise UsageError(f"unknown zoo model {name!r}; valid names: {_valid_names()}")
