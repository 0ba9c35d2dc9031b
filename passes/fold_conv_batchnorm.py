"""Fold an inference-mode BatchNormalization into the Conv that feeds it.

Rules:

1. Pattern: ``y = BatchNormalization(Conv(x, W[, b]), gamma, beta, mean, var)`` where the Conv's
   output is read by the BatchNormalization only and is not a graph output, the
   BatchNormalization is in inference mode (``training_mode`` absent or 0, one output), and
   ``W``, ``b`` (when present), ``gamma``, ``beta``, ``mean``, ``var`` are constants
   (initializers or ``Constant`` outputs) of a floating dtype. ``W`` has rank >= 3 and as many
   output channels as the BatchNormalization has channels.
2. Rewrite, with ``s = gamma / sqrt(var + epsilon)`` per output channel ``c``::

       W'[c] = W[c] * s[c]            b'[c] = (b[c] - mean[c]) * s[c] + beta[c]   (b = 0 if absent)

   computed in float64 and stored in ``W``'s dtype as new initializers (``W`` itself may be
   shared with another Conv, so it is never modified). The Conv reads ``W'`` and ``b'``; the
   BatchNormalization is removed and its readers read the Conv. When the BatchNormalization's
   output is a graph output, the Conv's output takes its name.

Before/After::

    x -> Conv(W) -> c -> BatchNormalization(gamma, beta, mean, var, eps) -> y
    x -> Conv(W', b') -> y

Invariant: the values the graph computes are unchanged up to float rounding; graph inputs and
output names are unchanged. The old ``W``/``b``/BN constants, now unused, are left for
dead-code elimination.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from passes.registry import register
from passes.values import const_array


def _const(value: ir.Value | None) -> np.ndarray | None:
    """A floating constant's array (:func:`passes.values.const_array`), else None."""
    array = const_array(value)
    return array if array is not None and np.issubdtype(array.dtype, np.floating) else None


def _fresh_name(graph: ir.Graph, base: str, taken: set[str]) -> str:
    name, n = base, 0
    while name in graph.initializers or name in taken:
        n += 1
        name = f"{base}_{n}"
    taken.add(name)
    return name


def _value_names(graph: ir.Graph) -> set[str]:
    names = {v.name for v in graph.inputs if v.name}
    names.update(graph.initializers)
    for node in graph:
        names.update(o.name for o in node.outputs if o.name)
    return names


def _add_initializer(graph: ir.Graph, name: str, array: np.ndarray) -> ir.Value:
    tensor = ir.tensor(array, name=name)
    value = ir.Value(
        name=name, shape=ir.Shape(array.shape), type=ir.TensorType(tensor.dtype), const_value=tensor
    )
    graph.register_initializer(value)
    return value


def _fold_one(graph: ir.Graph, bn: ir.Node, taken: set[str]) -> bool:
    if bn.op_type != "BatchNormalization" or bn.domain != "" or len(bn.inputs) != 5:
        return False
    if bn.attributes.get_int("training_mode", 0) != 0 or len([o for o in bn.outputs if o.name]) != 1:
        return False
    conv_out = bn.inputs[0]
    conv = conv_out.producer() if conv_out is not None else None
    if conv is None or conv.op_type != "Conv" or conv.domain != "" or conv.graph is not graph:
        return False
    if conv_out.is_graph_output() or len(conv_out.uses()) != 1:
        return False
    weight = _const(conv.inputs[1])
    bias_value = conv.inputs[2] if len(conv.inputs) > 2 else None
    bias = _const(bias_value) if bias_value is not None else None
    if weight is None or (bias_value is not None and bias is None) or weight.ndim < 3:
        return False
    params = [_const(v) for v in bn.inputs[1:]]
    if any(p is None for p in params):
        return False
    gamma, beta, mean, var = (
        np.asarray(p, dtype=np.float64).reshape(-1) for p in params  # type: ignore[arg-type]
    )
    channels = weight.shape[0]
    if any(p.size != channels for p in (gamma, beta, mean, var)):
        return False
    if bias is not None and bias.size != channels:
        return False
    eps = bn.attributes.get_float("epsilon", 1e-5)
    scale = gamma / np.sqrt(var + eps)
    w64 = weight.astype(np.float64) * scale.reshape((channels,) + (1,) * (weight.ndim - 1))
    b64 = (np.zeros(channels) if bias is None else bias.astype(np.float64).reshape(-1)) - mean
    b64 = b64 * scale + beta
    base = conv.name or conv_out.name or "conv"
    new_w = _add_initializer(graph, _fresh_name(graph, f"{base}.W_bnfold", taken), w64.astype(weight.dtype))
    new_b = _add_initializer(graph, _fresh_name(graph, f"{base}.b_bnfold", taken), b64.astype(weight.dtype))
    conv.replace_input_with(1, new_w)
    if len(conv.inputs) < 3:
        conv.resize_inputs(3)
    conv.replace_input_with(2, new_b)

    bn_out = bn.outputs[0]
    bn_name = bn_out.name
    is_output = bn_out.is_graph_output()
    ir.convenience.replace_all_uses_with(bn_out, conv_out, replace_graph_outputs=True)
    graph.remove(bn, safe=True)
    if is_output:
        conv_out.name = bn_name  # the graph keeps its output name
    # The Conv output now stands for the BN output: same shape and dtype, maybe better known.
    conv_out.type = conv_out.type or bn_out.type
    conv_out.shape = conv_out.shape or bn_out.shape
    return True


@register("fold_conv_batchnorm")
class FoldConvBatchNorm(ir.passes.InPlacePass):
    """Fold inference-mode BatchNormalization into the preceding Conv's weights and bias."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        taken = _value_names(graph)
        folded = 0
        for node in list(graph):
            if node.graph is graph and _fold_one(graph, node, taken):
                folded += 1
        return ir.passes.PassResult(model, modified=bool(folded))
