"""Shared helpers for the pass tests: build small models, run them through ONNX Runtime, compare.

A plain module (not conftest) so test files can import it; its name is unique across tests/."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
from onnx import TensorProto, helper

OPSET = 17
RTOL = 1e-5
ATOL = 1e-6
LIGHT_DIR = Path(onnx.__file__).parent / "backend" / "test" / "data" / "light"


def make_model(
    nodes: Sequence[onnx.NodeProto],
    inputs: Sequence[onnx.ValueInfoProto],
    outputs: Sequence[onnx.ValueInfoProto],
    initializers: Sequence[onnx.TensorProto] = (),
    *,
    opset: int = OPSET,
    comm: bool = False,
    value_info: Sequence[onnx.ValueInfoProto] = (),
) -> onnx.ModelProto:
    """A model proto at ``opset`` (plus the partitioner.comm domain when ``comm``)."""
    graph = helper.make_graph(
        list(nodes), "test", list(inputs), list(outputs), list(initializers), value_info=list(value_info)
    )
    opsets = [helper.make_opsetid("", opset)]
    if comm:
        opsets.append(helper.make_opsetid("partitioner.comm", 1))
    return helper.make_model(graph, opset_imports=opsets, ir_version=8)


def tensor_info(name: str, shape: Sequence[int] | None, elem: int = TensorProto.FLOAT) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, elem, None if shape is None else list(shape))


def const(name: str, array: np.ndarray) -> onnx.TensorProto:
    return onnx.numpy_helper.from_array(np.asarray(array), name=name)


def to_ir(proto: onnx.ModelProto) -> ir.Model:
    return ir.serde.deserialize_model(proto)


def to_proto(model: ir.Model) -> onnx.ModelProto:
    return ir.serde.serialize_model(model)


def op_types(model: ir.Model | onnx.ModelProto) -> list[str]:
    if isinstance(model, onnx.ModelProto):
        return [n.op_type for n in model.graph.node]
    return [n.op_type for n in model.graph]


def seeded_feeds(proto: onnx.ModelProto, seed: int = 0) -> dict[str, np.ndarray]:
    """Random inputs (normal floats, small ints) for every graph input that is not an initializer."""
    rng = np.random.default_rng(seed)
    init_names = {i.name for i in proto.graph.initializer}
    feeds = {}
    for inp in proto.graph.input:
        if inp.name in init_names:
            continue
        t = inp.type.tensor_type
        shape = [d.dim_value for d in t.shape.dim]
        dtype = helper.tensor_dtype_to_np_dtype(t.elem_type)
        if np.issubdtype(dtype, np.floating):
            feeds[inp.name] = rng.standard_normal(shape).astype(dtype)
        else:
            feeds[inp.name] = rng.integers(0, 4, size=shape).astype(dtype)
    return feeds


def run_ort(proto: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    options = ort.SessionOptions()
    # Keep ORT from optimising the graphs itself, so the comparison sees our rewrite.
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.log_severity_level = 3  # no warnings about initializers a pass left unused
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    session = ort.InferenceSession(proto.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def assert_same_outputs(
    before: onnx.ModelProto,
    after: ir.Model | onnx.ModelProto,
    *,
    rtol: float = RTOL,
    atol: float = ATOL,
    seed: int = 0,
) -> None:
    """Outputs of ``before`` and ``after`` through ORT agree on the same seeded inputs."""
    after_proto = to_proto(after) if isinstance(after, ir.Model) else after
    feeds = seeded_feeds(before, seed)
    expected = run_ort(before, feeds)
    after_inputs = {i.name for i in after_proto.graph.input}
    actual = run_ort(after_proto, {k: v for k, v in feeds.items() if k in after_inputs})
    assert [o.name for o in before.graph.output] == [o.name for o in after_proto.graph.output]
    for e, a in zip(expected, actual):
        np.testing.assert_allclose(a, e, rtol=rtol, atol=atol)


def check_model(model: ir.Model | onnx.ModelProto) -> None:
    proto = to_proto(model) if isinstance(model, ir.Model) else model
    onnx.checker.check_model(proto, full_check=True)
