"""Hypothesis strategies for the differential fuzzer: random valid ONNX graphs and random plans.

:func:`graphs` draws a single-input float32 graph of 2-12 operators from :data:`op_specs.OP_SPECS`.
Rules:
1. The input is ``[B, ...]`` with the batch ``B`` on axis 0 (rank 2, 3 or 4), so data and pipeline
   splits apply; the op specs keep axis 0 the batch axis throughout.
2. Each operator consumes the newest value most of the time, and otherwise any earlier value
   (binary ops and Concat may also take a second earlier value of a compatible shape): the graph
   is a DAG with branches that fork and join.
3. Every value nobody consumes becomes a graph output (at most :data:`MAX_OUTPUTS`, newest first;
   any others are dead code, which the passes remove).
4. Every drawn model passes ``onnx.checker.check_model(full_check=True)``; the shapes declared on
   the outputs are the ones the generator tracked, so strict shape inference cross-checks them.

:func:`plans` draws a strategy, a device count (2-4) and micro-batches (1 or 2, 2 only for
pipeline when the batch divides).
"""

from __future__ import annotations

from dataclasses import dataclass

import onnx
from hypothesis import strategies as st
from onnx import helper

from .op_specs import OP_SPECS, OPS_BY_NAME, OPSET, GraphBuilder, Value, float_input

MAX_OUTPUTS = 3
STRATEGIES = ("data", "pipeline", "tensor", "spatial", "hybrid", "auto")


@dataclass(frozen=True)
class FuzzGraph:
    model: onnx.ModelProto
    reduction: int  # the longest reduction in the graph (for the tolerance)
    ops: tuple[str, ...]

    @property
    def batch(self) -> int:
        return self.model.graph.input[0].type.tensor_type.shape.dim[0].dim_value


@dataclass(frozen=True)
class FuzzPlan:
    strategy: str
    devices: int
    microbatches: int | None


@st.composite
def input_shapes(draw: st.DrawFn) -> tuple[int, ...]:
    batch = draw(st.sampled_from([4, 2, 8, 3, 1]))
    rank = draw(st.sampled_from([2, 3, 4]))
    if rank == 2:
        return (batch, draw(st.sampled_from([4, 8, 12, 16])))
    if rank == 3:
        return (batch, draw(st.sampled_from([2, 4, 6])), draw(st.sampled_from([4, 8])))
    hw = draw(st.sampled_from([4, 6, 8]))
    return (batch, draw(st.sampled_from([1, 2, 3, 4])), hw, hw)


@st.composite
def graphs(draw: st.DrawFn, min_ops: int = 2, max_ops: int = 12) -> FuzzGraph:
    shape = draw(input_shapes())
    g = GraphBuilder(seed=draw(st.integers(0, 2**31 - 1)))
    x0 = Value("x", shape)
    g.values.append(x0)
    n_ops = draw(st.integers(min_ops, max_ops))
    consumed: set[str] = set()
    ops: list[str] = []
    for i in range(n_ops):
        if i == 0 or draw(st.integers(0, 3)) > 0:
            x = g.values[-1]
        else:
            x = draw(st.sampled_from(g.values))
        specs = [s for s in OP_SPECS if s.accepts(x.shape)]
        if len(x.shape) == 4 and draw(st.integers(0, 2)) == 0:
            spec = OPS_BY_NAME["Conv"]  # images get convolutions often enough for spatial/hybrid plans
        else:
            spec = draw(st.sampled_from(specs))
        before = len(g.nodes)
        spec.emit(draw, g, x)
        for node in g.nodes[before:]:
            consumed.update(node.input)
            ops.append(node.op_type)
    sinks = [v for v in g.values if v.name not in consumed and v.name != "x"]
    outs = list(reversed(sinks))[:MAX_OUTPUTS]
    inner = [v for v in g.values if v.name in consumed and v.name != "x" and v not in outs]
    if inner and len(outs) < MAX_OUTPUTS and draw(st.integers(0, 3)) == 0:
        outs.append(draw(st.sampled_from(inner)))  # an output that other nodes also consume
    graph = helper.make_graph(g.nodes, "fuzz", [float_input("x", shape)],
                              [float_input(v.name, v.shape) for v in outs], g.initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], ir_version=8,
                              producer_name="tests.fuzz")
    onnx.checker.check_model(model, full_check=True)
    return FuzzGraph(model, g.reduction, tuple(ops))


@st.composite
def plans(draw: st.DrawFn, batch: int) -> FuzzPlan:
    strategy = draw(st.sampled_from(STRATEGIES))
    devices = draw(st.integers(2, 4))
    micro = None
    if strategy == "pipeline" and batch % 2 == 0:
        micro = draw(st.sampled_from([1, 2]))
    return FuzzPlan(strategy, devices, micro)
