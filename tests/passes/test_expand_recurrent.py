"""passes.expand_recurrent: LSTM/GRU/RNN become one input GEMM per direction plus an unrolled
recurrence of standard ops, computing what ONNX Runtime's recurrent kernels compute.

Every attribute variant of :mod:`recurrent_cases` (directions, layouts, sequence_lens, initial
states, peepholes, clip, input_forget, linear_before_reset, activations with alpha/beta, optional
outputs, weights as graph inputs, opsets 7/9/17) is expanded and run through ONNX Runtime,
compared with ORT's own recurrent kernel at rtol 1e-5 / atol 1e-5, and checked with
``onnx.checker.check_model(full_check=True)``.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper
from passes_testkit import to_ir, to_proto
from recurrent_cases import CASES, Case, build, reference

from passes import OPTIMIZE_PIPELINE, run_pipeline
from passes.expand_recurrent import RECURRENT_OPS, ExpandRecurrent, can_expand

RTOL = ATOL = 1e-5


def _run(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_expansion_matches_ort(case: Case) -> None:
    model, feeds = build(case)
    irm = to_ir(model)
    assert ExpandRecurrent()(irm).modified
    out = to_proto(irm)
    ops = {n.op_type for n in out.graph.node}
    assert not ops & RECURRENT_OPS and "MatMul" in ops
    onnx.checker.check_model(onnx.shape_inference.infer_shapes(out), full_check=True)
    assert [o.name for o in out.graph.output] == [o.name for o in model.graph.output]
    got, want = _run(out, feeds), reference(case)
    assert len(got) == len(want)
    for name, g, w in zip([o.name for o in model.graph.output], got, want):
        np.testing.assert_allclose(g, w, rtol=RTOL, atol=ATOL, err_msg=f"{case.name}: {name}")


def test_one_input_gemm_per_direction() -> None:
    """Rule 2/3: each direction has one GEMM over all T*B rows, then one [B,H]x[H,4H] per step."""
    case = next(c for c in CASES if c.name == "lstm_bidirectional_all")
    irm = to_ir(build(case)[0])
    ExpandRecurrent()(irm)
    out = onnx.shape_inference.infer_shapes(to_proto(irm))
    shapes = {v.name: [d.dim_value for d in v.type.tensor_type.shape.dim]
              for v in [*out.graph.value_info, *out.graph.input]}
    shapes.update({t.name: list(t.dims) for t in out.graph.initializer})
    lhs = [shapes[n.input[0]] for n in out.graph.node if n.op_type == "MatMul"]
    assert lhs.count([case.seq * case.batch, case.inputs]) == 2
    assert lhs.count([case.batch, case.hidden]) == 2 * case.seq  # initial_h given: every step multiplies


def test_no_initial_state_skips_the_first_recurrent_product() -> None:
    case = next(c for c in CASES if c.name == "lstm_defaults")
    irm = to_ir(build(case)[0])
    ExpandRecurrent()(irm)
    assert [n.op_type for n in irm.graph].count("MatMul") == 1 + (case.seq - 1)


def test_symbolic_sequence_is_left_alone() -> None:
    """Rule 1: no static X shape, nothing to unroll; the node stays and the pass says why."""
    node = helper.make_node("LSTM", ["X", "W", "R"], ["Y"], hidden_size=2)
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["T", 1, 3])],
                          [helper.make_tensor_value_info("Y", TensorProto.FLOAT, None)],
                          [onnx.numpy_helper.from_array(np.zeros((1, 8, 3), np.float32), "W"),
                           onnx.numpy_helper.from_array(np.zeros((1, 8, 2), np.float32), "R")])
    irm = to_ir(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]))
    assert can_expand(next(iter(irm.graph))) == "X has no static 3-D shape"
    assert not ExpandRecurrent()(irm).modified
    assert [n.op_type for n in irm.graph] == ["LSTM"]


def test_unknown_activation_is_left_alone() -> None:
    model, _ = build(Case("x", "RNN", {"activations": ["Tanh"]}))
    acts = next(a for a in model.graph.node[0].attribute if a.name == "activations")
    acts.strings[0] = b"Swish"  # not an RNN activation
    irm = to_ir(model)
    assert not ExpandRecurrent()(irm).modified


def test_optimize_pipeline_expands_before_partitioning() -> None:
    """The optimize pipeline runs the pass (strategies then see MatMuls); the result verifies
    and matches ORT on the original stacked LSTM."""
    from models_zoo.lstm import build_lstm
    from partitioner.load import load

    assert "expand_recurrent" in OPTIMIZE_PIPELINE
    model = build_lstm(seq=6, batch=2, input_size=8, hidden=8, layers=2, classes=4, bidirectional=True)
    x = np.random.default_rng(0).standard_normal((6, 2, 8)).astype(np.float32)
    out = run_pipeline(load(model), ["optimize"])
    assert not {n.op_type for n in out.graph} & RECURRENT_OPS
    proto = ir.serde.serialize_model(out)
    np.testing.assert_allclose(_run(proto, {"x": x})[0], _run(model, {"x": x})[0], rtol=RTOL, atol=ATOL)


def test_lstm_steps_gather_and_tree_concat() -> None:
    """Rules 7-8: an LSTM reads each step's projection with a Gather (no Split of T pieces), and a
    long Y is concatenated as a tree of at most CONCAT_FANIN inputs per Concat; output as ORT's."""
    from models_zoo.lstm import build_lstm

    from passes.expand_recurrent import CONCAT_FANIN

    model = build_lstm(seq=40, batch=2, input_size=8, hidden=16, layers=1, classes=4)
    irm = to_ir(model)
    assert ExpandRecurrent()(irm).modified
    out = to_proto(irm)
    ops = [n.op_type for n in out.graph.node]
    assert "Split" not in ops and "LSTM" not in ops and ops.count("Gather") == 40
    assert max(len(n.input) for n in out.graph.node if n.op_type == "Concat") <= CONCAT_FANIN
    x = np.random.default_rng(0).standard_normal((40, 2, 8)).astype(np.float32)
    np.testing.assert_allclose(_run(out, {"x": x})[0], _run(model, {"x": x})[0], rtol=RTOL, atol=ATOL)
