"""Hand-built LSTM/GRU/RNN models covering every attribute variant ``passes.expand_recurrent``
handles, with seeded inputs; shared by the pass tests and the TVM tests.

A plain module (not conftest) so test files can import it; its name is unique across tests/."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

GATES = {"LSTM": 4, "GRU": 3, "RNN": 1}


@dataclass(frozen=True)
class Case:
    """One recurrent node: op, attributes, which optional inputs it has, which are initializers."""

    name: str
    op: str
    attrs: dict = field(default_factory=dict)
    seq: int = 5
    batch: int = 3
    inputs: int = 4
    hidden: int = 4
    bias: bool = True
    initial: bool = False
    lens: tuple[int, ...] | None = None  # sequence_lens values (a graph input)
    peepholes: bool = False
    const_weights: bool = True  # W, R, B, P as initializers (else graph inputs)
    outputs: tuple[bool, bool, bool] = (True, True, True)  # Y, Y_h, Y_c (Y_c: LSTM only)
    opset: int = 17


CASES = [
    Case("lstm_defaults", "LSTM", bias=False),
    Case("lstm_reverse_initial", "LSTM", {"direction": "reverse"}, initial=True),
    Case("lstm_bidirectional_all", "LSTM", {"direction": "bidirectional"}, initial=True, lens=(5, 3, 1), peepholes=True),
    Case("lstm_layout1_bidirectional", "LSTM", {"direction": "bidirectional", "layout": 1}, initial=True, lens=(2, 5, 4)),
    Case("lstm_reverse_lens", "LSTM", {"direction": "reverse"}, lens=(4, 5, 2)),
    Case("lstm_clip", "LSTM", {"clip": 0.7}, initial=True, peepholes=True),
    Case("lstm_input_forget", "LSTM", {"input_forget": 1}, initial=True),
    Case("lstm_relu_activations", "LSTM", {"activations": ["Sigmoid", "Relu", "Tanh"]}),
    Case("lstm_alpha_beta_activations", "LSTM", {"activations": ["HardSigmoid", "LeakyRelu", "Softsign"],
                                                 "activation_alpha": [0.3, 0.05], "activation_beta": [0.4]}),
    Case("lstm_more_activations", "LSTM", {"direction": "bidirectional",
                                           "activations": ["Sigmoid", "Elu", "Softplus", "Sigmoid", "ScaledTanh", "Affine"],
                                           "activation_alpha": [0.9, 1.2, 0.5], "activation_beta": [0.7, 0.1]}),
    Case("lstm_only_y_c", "LSTM", {}, outputs=(False, False, True)),
    Case("lstm_only_y", "LSTM", {"direction": "bidirectional"}, outputs=(True, False, False)),
    Case("lstm_dynamic_weights", "LSTM", {"direction": "bidirectional"}, initial=True, lens=(5, 1, 3), peepholes=True,
         const_weights=False),
    Case("lstm_opset9", "LSTM", {"direction": "bidirectional"}, initial=True, lens=(5, 2, 4), peepholes=True, opset=9),
    Case("lstm_opset7", "LSTM", {"direction": "reverse"}, initial=True, lens=(3, 5, 1), opset=7),
    Case("gru_defaults", "GRU", bias=False),
    Case("gru_bidirectional_all", "GRU", {"direction": "bidirectional"}, initial=True, lens=(5, 3, 2)),
    Case("gru_linear_before_reset", "GRU", {"linear_before_reset": 1, "direction": "reverse"}, initial=True, lens=(1, 5, 4)),
    Case("gru_lbr_no_initial", "GRU", {"linear_before_reset": 1}),
    Case("gru_layout1_clip_relu", "GRU", {"layout": 1, "clip": 0.5, "activations": ["Sigmoid", "Relu"]}, initial=True),
    Case("gru_dynamic_weights", "GRU", {"linear_before_reset": 1, "direction": "bidirectional"}, initial=True,
         lens=(3, 5, 2), const_weights=False),
    Case("gru_thresholded", "GRU", {"activations": ["HardSigmoid", "ThresholdedRelu"], "activation_alpha": [0.25, 0.1],
                                    "activation_beta": [0.45]}),
    Case("rnn_defaults", "RNN", bias=False),
    Case("rnn_bidirectional_layout1", "RNN", {"direction": "bidirectional", "layout": 1}, initial=True, lens=(5, 2, 3)),
    Case("rnn_relu_clip", "RNN", {"activations": ["Relu"], "clip": 1.5}, initial=True),
    Case("rnn_dynamic_weights_lens", "RNN", {"direction": "reverse"}, lens=(2, 5, 4), const_weights=False),
    Case("rnn_opset9", "RNN", {"direction": "bidirectional"}, initial=True, lens=(4, 5, 1), opset=9),
]


def build(case: Case, seed: int = 0) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """The one-node model of ``case`` and its seeded feeds."""
    rng = np.random.default_rng(seed)
    d = 2 if case.attrs.get("direction") == "bidirectional" else 1
    g, h, b, t, i = GATES[case.op], case.hidden, case.batch, case.seq, case.inputs
    layout = case.attrs.get("layout", 0)

    def arr(*shape: int, scale: float = 0.6) -> np.ndarray:
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    x_shape = (t, b, i) if layout == 0 else (b, t, i)
    state_shape = (d, b, h) if layout == 0 else (b, d, h)
    values: dict[str, np.ndarray] = {"X": arr(*x_shape, scale=1.0), "W": arr(d, g * h, i), "R": arr(d, g * h, h)}
    names = ["X", "W", "R"]
    if case.bias or case.lens is not None or case.initial or case.peepholes:
        names.append("B" if case.bias else "")
        if case.bias:
            values["B"] = arr(d, 2 * g * h)
    if case.lens is not None or case.initial or case.peepholes:
        names.append("sequence_lens" if case.lens is not None else "")
        if case.lens is not None:
            values["sequence_lens"] = np.array(case.lens, dtype=np.int32)
    if case.initial or case.peepholes:
        names.append("initial_h" if case.initial else "")
        if case.initial:
            values["initial_h"] = arr(*state_shape)
        if case.op == "LSTM":
            names.append("initial_c" if case.initial else "")
            if case.initial:
                values["initial_c"] = arr(*state_shape)
    if case.peepholes:
        names.append("P")
        values["P"] = arr(d, 3 * h)
    weights = {"W", "R", "B", "P"}
    inits = [numpy_helper.from_array(v, k) for k, v in values.items() if case.const_weights and k in weights]
    feeds = {k: v for k, v in values.items() if not (case.const_weights and k in weights)}
    y_shape = [t, d, b, h] if layout == 0 else [b, t, d, h]
    out_names, outs = [], []
    for k, (name, shape) in enumerate((("Y", y_shape), ("Y_h", list(state_shape)), ("Y_c", list(state_shape)))):
        if k == 2 and case.op != "LSTM":
            break
        if case.outputs[k]:
            out_names.append(name)
            outs.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, shape))
        else:
            out_names.append("")
    while out_names and not out_names[-1]:
        out_names.pop()
    node = helper.make_node(case.op, names, out_names, name=case.name, hidden_size=h, **case.attrs)
    graph_inputs = [helper.make_tensor_value_info(k, TensorProto.INT32 if k == "sequence_lens" else TensorProto.FLOAT,
                                                  list(v.shape)) for k, v in feeds.items()]
    graph = helper.make_graph([node], case.name, graph_inputs, outs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", case.opset)])
    onnx.checker.check_model(model, full_check=True)
    return model, feeds


def reference(case: Case, seed: int = 0) -> list[np.ndarray]:
    """ONNX Runtime's outputs for ``case``. ORT refuses ``layout=1`` ("Batchwise recurrent
    operations are not supported"), so a layout-1 case runs as its layout-0 twin, with ``X`` and
    the states transposed in and ``Y``/``Y_h``/``Y_c`` transposed back (the operator's definition
    of the layout)."""
    import onnxruntime as ort

    model, feeds = build(case, seed)
    if case.attrs.get("layout", 0) == 1:
        twin = Case(**{**case.__dict__, "attrs": {k: v for k, v in case.attrs.items() if k != "layout"}})
        model, _ = build(twin, seed)
        feeds = {k: (np.ascontiguousarray(v.transpose(1, 0, 2)) if k in ("X", "initial_h", "initial_c") else v)
                 for k, v in feeds.items()}
    outs = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    if case.attrs.get("layout", 0) == 1:
        names = [o.name for o in model.graph.output]
        outs = [o.transpose(2, 0, 1, 3) if n == "Y" else o.transpose(1, 0, 2) for n, o in zip(names, outs)]
    return outs
