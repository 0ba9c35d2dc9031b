"""BatchNormalization in training mode, written as standard ops before the backward pass.

Rule: ``y = (x - mean_b) / sqrt(var_b + eps) * scale + B`` with the batch statistics over every
axis but the channel (population variance, as ONNX's BatchNormalization training mode defines
it); the running statistics become state (``mean`` in, ``mean.next`` out) updated as
``running = running * momentum + batch * (1 - momentum)``. Writing it from ReduceMean, Sub,
Mul, Sqrt and Div lets their rules differentiate it, and both TVM and ONNX Runtime run it (TVM
imports BatchNormalization's training outputs only partly). Every emitted node carries the BN's
name in ``metadata_props["training.rewrite_of"]`` (they are forward nodes: no
``training.forward_node`` tag), so a report can still group them as one BN.

Rule 2 (:data:`BN_SCALE_FIRST`, session 18): the normalised value is scaled as
``xc * (rstd * scale)``, the two per-channel factors multiplied first, not ``(xc * rstd) * scale``.
The same value up to rounding (one float product in another order), but its gradient needs one
full-size activation, ``xc``, where the other order needs ``xc`` and ``xc * rstd`` (the scale's
gradient reads the normalised value, the rstd's reads ``xc``): the backward pass makes one
full-size product and one reduction (``sum(dy * xc)``, from which both per-channel gradients
follow) instead of two each, and a pipeline stage stashes one activation less per BN.
Measured with :data:`~partitioner.training.rules.activations.RELU_MASK_FROM_OUTPUT` (both on
against both off, ``benchmarks/stage_kernels_ab.py``, the zoo resnet's stage 0 at 2 images, Intel
AVX-512, load 3.7-6.1): kernels 240.9 -> 202.5 ms a step (``F`` 61.2 -> 47.6, ``B`` 129.6 -> 113.8,
VM builtins 45.3 -> 36.1).
"""

from __future__ import annotations

import os
from collections.abc import Callable

import onnx_ir as ir

from partitioner.training.autodiff import FORWARD_NODE_KEY, Emitter, shape_of

REWRITE_KEY = "training.rewrite_of"
#: rule 2 (session 18): ``y = xc * (rstd * scale) + B``; ``PARTITIONER_TRAIN_BN_SCALE_FIRST=0`` turns
#: it off (``(xc * rstd) * scale + B``)
BN_SCALE_FIRST = os.environ.get("PARTITIONER_TRAIN_BN_SCALE_FIRST", "1") != "0"


def expand_batchnorm(graph: ir.Graph, em: Emitter,
                     promote: Callable[[ir.Value], None]) -> list[tuple[ir.Value, ir.Value]]:
    """Rewrite every BatchNormalization of ``graph`` in place; returns (state in, state out) pairs
    for the running statistics that were initializers (``promote`` makes them graph inputs)."""
    state: list[tuple[ir.Value, ir.Value]] = []
    for node in [n for n in graph if n.op_type == "BatchNormalization" and n.domain in ("", "ai.onnx")]:
        x, scale, bias, mean, var = node.inputs[:5]
        eps = node.attributes["epsilon"].value if "epsilon" in node.attributes else 1e-5
        momentum = node.attributes["momentum"].value if "momentum" in node.attributes else 0.9
        sx = shape_of(x)
        em.tag = node.name or "BatchNormalization"
        new_nodes_start = len(graph)
        axes = em.ints([0, *range(2, len(sx))])
        bshape = em.ints([1, sx[1]] + [1] * (len(sx) - 2))
        bmean = em.op("ReduceMean", x, axes, keepdims=1)
        xc = em.op("Sub", x, bmean)
        bvar = em.op("ReduceMean", em.op("Mul", xc, xc), axes, keepdims=1)
        rstd = em.op("Reciprocal", em.op("Sqrt", em.op("Add", bvar, em.scalar(float(eps)))))
        if BN_SCALE_FIRST:  # rule 2: the per-channel factor first, then one full-size product
            y = em.op("Add", em.op("Mul", xc, em.op("Mul", rstd, em.op("Reshape", scale, bshape))),
                      em.op("Reshape", bias, bshape))
        else:
            y = em.op("Add", em.op("Mul", em.op("Mul", xc, rstd), em.op("Reshape", scale, bshape)),
                      em.op("Reshape", bias, bshape))
        for running, batch in ((mean, bmean), (var, bvar)):
            if running.is_initializer():
                promote(running)
                upd = em.op("Add", em.op("Mul", running, em.scalar(float(momentum))),
                            em.op("Mul", em.op("Reshape", batch, em.ints([sx[1]])), em.scalar(1.0 - float(momentum))),
                            _name=f"{running.name}.next")
                state.append((running, upd))
        new_nodes = list(graph)[new_nodes_start:]
        # move the expansion to where the BN was, so the graph stays topologically ordered
        for n in new_nodes:
            graph.remove(n)
        graph.insert_before(node, new_nodes)
        old = node.outputs[0]
        if old.is_graph_output():
            idx = [o is old for o in graph.outputs].index(True)
            graph.outputs[idx] = y
        old.replace_all_uses_with(y)
        name = old.name
        y.shape, y.type = old.shape, old.type
        old.name = f"{name}.inference"
        y.name = name  # the model's value keeps its name (it may be the loss's output)
        graph.remove(node, safe=True)
        for n in new_nodes:  # forward nodes: no backward tag, but the BN they came from
            n.metadata_props.pop(FORWARD_NODE_KEY, None)
            n.metadata_props[REWRITE_KEY] = node.name or "BatchNormalization"
    em.tag = "loss"
    return state
