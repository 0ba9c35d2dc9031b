"""Fuzz ``partitioner.load.load`` with byte-level mutations of small valid models.

Property: for any bytes, ``load`` either returns a model or raises a PartitionerError subclass;
any other exception (KeyError, ValueError, DecodeError, RecursionError, MemoryError, ...) is a
bug. Mutations: flip a bit, overwrite a byte, insert bytes, delete a run, truncate; one to four
of them per example. The default run tries 200 examples; the slow variant 5,000.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import onnx
import pytest
from hostile_testkit import make_model, small_model
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

from partitioner.core.errors import PartitionerError
from partitioner.load import load


def _rich_model() -> onnx.ModelProto:
    """Conv, Reshape by a Constant, an If with subgraphs, typed and raw initializers, a symbolic
    dim bound by the batch: many fields for mutations to land in."""
    rng = np.random.default_rng(3)
    w = numpy_helper.from_array(rng.standard_normal((2, 1, 3, 3)).astype(np.float32), "w")
    b = helper.make_tensor("b", TensorProto.FLOAT, [2], [0.5, -0.5])  # typed float_data
    shape = numpy_helper.from_array(np.array([0, -1], np.int64), "shape")

    def branch(tag: str, op: str) -> onnx.GraphProto:
        return helper.make_graph([helper.make_node(op, ["flat"], [f"{tag}_y"], name=f"{tag}_op")], tag, [],
                                 [helper.make_tensor_value_info(f"{tag}_y", TensorProto.FLOAT, None)])

    nodes = [
        helper.make_node("Conv", ["X", "w", "b"], ["c"], name="conv", pads=[1, 1, 1, 1]),
        helper.make_node("Reshape", ["c", "shape"], ["flat"], name="reshape"),
        helper.make_node("Constant", [], ["thr"], name="thr", value=numpy_helper.from_array(np.array(0.0, np.float32))),
        helper.make_node("ReduceSum", ["flat"], ["s"], name="sum", keepdims=0),
        helper.make_node("Greater", ["s", "thr"], ["cond"], name="gt"),
        helper.make_node("If", ["cond"], ["Y"], name="if", then_branch=branch("then", "Relu"),
                         else_branch=branch("else", "Neg")),
    ]
    x = helper.make_tensor_value_info("X", TensorProto.FLOAT, ["N", 1, 4, 4])
    y = helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["N", 32])
    return make_model(nodes, [x], [y], [w, b, shape], opset=17)


SEEDS = [small_model().SerializeToString(), _rich_model().SerializeToString()]


def test_seeds_are_valid() -> None:
    with tempfile.TemporaryDirectory() as d:
        for i, data in enumerate(SEEDS):
            p = Path(d) / f"seed{i}.onnx"
            p.write_bytes(data)
            load(str(p), batch=1)


@st.composite
def mutated(draw: st.DrawFn) -> bytes:
    data = bytearray(draw(st.sampled_from(SEEDS)))
    for _ in range(draw(st.integers(1, 4))):
        # flips and overwrites keep protobuf lengths intact, so they reach the checks behind the parser
        kind = draw(st.sampled_from(["flip", "flip", "flip", "set", "set", "insert", "delete", "truncate"]))
        n = len(data)
        if n == 0:
            break
        i = draw(st.integers(0, n - 1))
        if kind == "flip":
            data[i] ^= 1 << draw(st.integers(0, 7))
        elif kind == "set":
            data[i] = draw(st.sampled_from([0x00, 0x01, 0x7F, 0x80, 0xFF, draw(st.integers(0, 255))]))
        elif kind == "insert":
            data[i:i] = draw(st.binary(min_size=1, max_size=8))
        elif kind == "delete":
            del data[i:i + draw(st.integers(1, 16))]
        else:
            del data[i:]
    return bytes(data)


def _check(data: bytes) -> None:
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "m.onnx"
        p.write_bytes(data)
        try:
            load(str(p), batch=1)
        except PartitionerError as exc:
            assert "\n" not in str(exc), str(exc)


@settings(max_examples=200, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(mutated())
def test_fuzz_load_200(data: bytes) -> None:
    _check(data)


@pytest.mark.slow
@settings(max_examples=5000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutated())
def test_fuzz_load_5000(data: bytes) -> None:
    _check(data)
