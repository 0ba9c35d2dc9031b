"""Give ``Range`` scalar bounds: a one-element ``[1]`` start, limit or delta is reshaped to ``[]``.

Why: ONNX requires Range's inputs to be scalars, but ONNX's own function bodies (AffineGrid's,
opset 20) feed it ``[1]`` tensors cut by ``Split``; ONNX Runtime and the reference evaluator accept
them, and ONNX's shape inference accepts them too while they come out of an ``If``. Once
``fold_constant_if`` inlines that ``If``, strict inference rejects the Range ("Input to 'Range'
op should be scalars") and the model cannot be compiled.

Rule: every main-graph ``Range`` input whose shape is static ``[1]`` is replaced by
``Reshape(x, [])`` (a scalar holding the same element). Invariant: Range computes the same
values, since a one-element tensor and the scalar hold the same number.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from passes.registry import register


@register("scalar_range_inputs")
class ScalarRangeInputs(ir.passes.InPlacePass):
    """Reshape one-element ``[1]`` Range inputs to scalars (see the module docstring)."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        modified = False
        for node in list(graph):
            if node.op_type != "Range" or node.domain not in ("", "ai.onnx"):
                continue
            for i, value in enumerate(node.inputs):
                if value is None or value.shape is None or list(value.shape) != [1]:
                    continue
                shape = ir.Value(name=f"{node.name or 'Range'}__scalar_shape{i}",
                                 const_value=ir.tensor(np.zeros([0], dtype=np.int64)))
                graph.initializers[shape.name] = shape
                reshape = ir.node("Reshape", [value, shape], name=f"{node.name or 'Range'}__scalar{i}")
                out = reshape.outputs[0]
                out.name = f"{value.name}__scalar{i}"
                out.shape, out.type = ir.Shape([]), value.type
                graph.insert_before(node, reshape)
                node.replace_input_with(i, out)
                modified = True
        return ir.passes.PassResult(model, modified)
