"""A stacked LSTM sequence model: ``layers`` ONNX ``LSTM`` nodes, then a linear head per step.

Not registered in the zoo's name table: it serves the recurrent tests and
``benchmarks/recurrent.py`` (the shape of a speech or OCR encoder). Weights come from
``numpy.random.default_rng(seed)``, scaled by ``1/sqrt(hidden)`` like PyTorch's init, so building
twice gives the same bytes.

Graph (``layout=0``): ``x [seq, batch, input]`` -> LSTM -> Squeeze(axis 1) -> ... -> LSTM ->
Squeeze -> MatMul(head) -> ``y [seq, batch, classes]``. A bidirectional layer's two directions
are concatenated on the feature axis (Transpose + Reshape), as PyTorch's exporter writes it.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from models_zoo.graph_builder import OPSET


def build_lstm(seq: int = 64, batch: int = 1, input_size: int = 64, hidden: int = 128, layers: int = 2,
               classes: int = 32, bidirectional: bool = False, seed: int = 0) -> onnx.ModelProto:
    """The model described in the module docstring."""
    rng = np.random.default_rng(seed)
    dirs = 2 if bidirectional else 1
    scale = 1.0 / np.sqrt(hidden)

    def weight(name: str, shape: tuple[int, ...]) -> onnx.TensorProto:
        return numpy_helper.from_array((rng.uniform(-1, 1, shape) * scale).astype(np.float32), name)

    inits: list[onnx.TensorProto] = []
    nodes: list[onnx.NodeProto] = []
    cur, width = "x", input_size
    for k in range(layers):
        inits += [weight(f"W{k}", (dirs, 4 * hidden, width)), weight(f"R{k}", (dirs, 4 * hidden, hidden)),
                  weight(f"B{k}", (dirs, 8 * hidden))]
        nodes.append(helper.make_node("LSTM", [cur, f"W{k}", f"R{k}", f"B{k}"], [f"Y{k}"], name=f"lstm{k}",
                                      hidden_size=hidden, direction="bidirectional" if bidirectional else "forward"))
        if dirs == 1:
            inits.append(numpy_helper.from_array(np.array([1], dtype=np.int64), f"axis{k}"))
            nodes.append(helper.make_node("Squeeze", [f"Y{k}", f"axis{k}"], [f"h{k}"], name=f"squeeze{k}"))
        else:  # [seq, 2, batch, H] -> [seq, batch, 2H]
            inits.append(numpy_helper.from_array(np.array([seq, batch, 2 * hidden], dtype=np.int64), f"shape{k}"))
            nodes.append(helper.make_node("Transpose", [f"Y{k}"], [f"t{k}"], name=f"transpose{k}", perm=[0, 2, 1, 3]))
            nodes.append(helper.make_node("Reshape", [f"t{k}", f"shape{k}"], [f"h{k}"], name=f"merge{k}"))
        cur, width = f"h{k}", dirs * hidden
    inits.append(weight("head", (width, classes)))
    nodes.append(helper.make_node("MatMul", [cur, "head"], ["y"], name="head"))
    graph = helper.make_graph(nodes, "lstm", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [seq, batch, input_size])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [seq, batch, classes])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="partitioner-zoo")
    onnx.checker.check_model(model, full_check=True)
    return model
