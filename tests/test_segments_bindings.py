"""Segment cutting (per-rank programs -> ONNX segments + comm steps) and I/O bindings."""

from __future__ import annotations

import threading

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto as T
from onnx import helper

from partitioner.core import comm_ops
from partitioner.core.bindings import Bindings, Placement, TensorBinding, gather_outputs, scatter_inputs
from partitioner.core.errors import InputError, VerifyError
from partitioner.core.segments import CommStep, Segment, split_program
from partitioner.runtime.comm_local import LocalWorld


def _program(rank: int) -> onnx.ModelProto:
    w = helper.make_tensor("w", T.FLOAT, [3], [1.0, 2.0, 3.0])
    nodes = [
        helper.make_node("Mul", ["x", "w"], ["a"], name="mul"),
        comm_ops.make_node("AllReduce", ["a"], ["b"], name="ar", group=[0, 1], reduction="sum", tag=0),
        helper.make_node("Add", ["b", "x"], ["y"], name="add"),
    ]
    if rank == 0:
        nodes.append(comm_ops.make_node("Send", ["y"], [], name="send", peer=1, tag=1))
        out = "y"
    else:
        nodes += [
            comm_ops.make_node("Recv", [], ["z"], name="recv", peer=0, tag=1, shape=[2, 3], dtype=T.FLOAT),
            helper.make_node("Mul", ["z", "y"], ["out"], name="mul2"),
        ]
        out = "out"
    g = helper.make_graph(
        nodes, f"rank{rank}", [helper.make_tensor_value_info("x", T.FLOAT, [2, 3])],
        [helper.make_tensor_value_info(out, T.FLOAT, [2, 3])], initializer=[w],
        value_info=[helper.make_tensor_value_info(n, T.FLOAT, [2, 3]) for n in ("a", "b", "y", "z")],
    )
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18), comm_ops.opset_import()])
    onnx.checker.check_model(m, full_check=True)
    return m


def test_split_program_structure():
    steps = split_program(_program(1))
    kinds = [type(s).__name__ for s in steps]
    assert kinds == ["Segment", "CommStep", "Segment", "CommStep", "Segment"]
    seg0, seg2 = steps[0], steps[2]
    assert isinstance(seg0, Segment) and seg0.inputs == ("x",) and seg0.outputs == ("a",)
    assert [i.name for i in seg0.model.graph.initializer] == ["w"]
    assert isinstance(seg2, Segment) and set(seg2.inputs) == {"b", "x"} and seg2.outputs == ("y",)
    assert isinstance(steps[3], CommStep) and steps[3].outputs == ("z",)
    for s in steps:
        if isinstance(s, Segment):
            onnx.checker.check_model(s.model, full_check=True)


def test_segments_run_two_ranks_against_numpy():
    rng = np.random.default_rng(0)
    xs = [rng.standard_normal((2, 3)).astype(np.float32) for _ in range(2)]
    world, envs = LocalWorld(2), [None, None]

    def run(rank: int) -> None:
        env = {"x": xs[rank]}
        try:
            for st in split_program(_program(rank)):
                if isinstance(st, Segment):
                    sess = ort.InferenceSession(st.model.SerializeToString(), providers=["CPUExecutionProvider"])
                    env.update(zip(st.outputs, sess.run(list(st.outputs), {k: env[k] for k in st.inputs})))
                else:
                    env.update(zip(st.outputs, comm_ops.execute(st.op, [env[i] for i in st.inputs], world.communicator(rank))))
        except Exception as exc:
            world.abort(str(exc))
            raise
        envs[rank] = env

    ts = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    [t.start() for t in ts]
    [t.join(30) for t in ts]
    w = np.array([1, 2, 3], np.float32)
    b = xs[0] * w + xs[1] * w
    np.testing.assert_allclose(envs[1]["out"], (b + xs[0]) * (b + xs[1]), rtol=1e-5, atol=1e-6)


def test_missing_value_info_is_reported():
    m = _program(0)
    del m.graph.value_info[:]
    with pytest.raises(VerifyError, match="no type/shape"):
        split_program(m)


def _dp_bindings(m: int) -> Bindings:
    x = TensorBinding("x", (8, 3), "float32", (Placement(0, "x", 0, 0, 2 if m > 1 else 4), Placement(1, "x", 0, 2 if m > 1 else 4, 4 if m > 1 else 8)))
    y = TensorBinding("y", (8, 5), "float32", (Placement(0, "y", 0, 0, 2 if m > 1 else 4), Placement(1, "y", 0, 2 if m > 1 else 4, 4 if m > 1 else 8)))
    return Bindings((x,), (y,), world_size=2, microbatches=m)


@pytest.mark.parametrize("m", [1, 2])
def test_scatter_gather_round_trip(m):
    b = _dp_bindings(m)
    b.check()
    x = np.arange(24, dtype=np.float32).reshape(8, 3)
    per_rank = scatter_inputs(b, {"x": x})
    assert len(per_rank) == 2 and len(per_rank[0]) == m
    # a fake per-rank computation: y = x @ ones(3, 5), which is row-local
    outs = [[{"y": f["x"] @ np.ones((3, 5), np.float32)} for f in rank] for rank in per_rank]
    y = gather_outputs(b, outs)["y"]
    np.testing.assert_array_equal(y, x @ np.ones((3, 5), np.float32))
    assert Bindings.from_json(b.to_json()) == b


def test_bad_inputs_name_the_input():
    b = _dp_bindings(1)
    with pytest.raises(InputError, match="missing input"):
        scatter_inputs(b, {})
    with pytest.raises(InputError, match="'x': shape"):
        scatter_inputs(b, {"x": np.zeros((7, 3), np.float32)})
    with pytest.raises(InputError, match="'x': dtype"):
        scatter_inputs(b, {"x": np.zeros((8, 3), np.float64)})
    with pytest.raises(InputError, match="unknown input"):
        scatter_inputs(b, {"x": np.zeros((8, 3), np.float32), "q": np.zeros(1)})


def test_uncovered_output_is_refused():
    y = TensorBinding("y", (8, 5), "float32", (Placement(0, "y", 0, 0, 4),))
    with pytest.raises(VerifyError, match="do not cover"):
        Bindings((), (y,), world_size=2).check()


def test_kind_of_separates_segments_by_kind():
    """Nodes of another kind (e.g. ones ONNX Runtime must run) form segments of their own."""
    steps = split_program(_program(1), kind_of=lambda n: "ort" if n.op_type == "Add" else "tvm")
    assert [(type(s).__name__, getattr(s, "kind", None)) for s in steps] == [
        ("Segment", "tvm"), ("CommStep", None), ("Segment", "ort"), ("CommStep", None), ("Segment", "tvm")]
    seg = steps[2]
    assert [n.op_type for n in seg.model.graph.node] == ["Add"] and set(seg.inputs) == {"b", "x"}
