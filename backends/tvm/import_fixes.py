"""Small rewrites of a per-rank program so TVM's ONNX importer gets ``OneHot`` right.

Rules:

1. ``OneHot`` with constant ``depth`` and ``values`` and the default ``axis`` (-1, the new last
   axis) becomes ``Where(Equal(Unsqueeze(i', -1), arange(depth)), on, off)``, where ``i'`` is the
   indices cast to int64 with negative ones wrapped (``i + depth``), as ONNX defines. TVM 0.27's
   converter fails on a rank-1 ``depth`` (ONNX allows "a scalar or a rank-1 tensor of one
   element"; tf2onnx writes ``[257]`` in magika: it passes a list where an int is wanted) and
   gives a float64 result for float32 ``values`` (it wraps them as Python floats).
2. Other ``OneHot`` nodes are left to TVM's converter.

Invariant: the program computes the same values, names its outputs the same; only initializers
and nodes are added before each rewritten node.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


def _opset(program: onnx.ModelProto) -> int:
    return next((o.version for o in program.opset_import if o.domain in ("", "ai.onnx")), 13)


def rewrite_one_hot(program: onnx.ModelProto) -> onnx.ModelProto:
    """Rule 1. Returns ``program`` itself when no node needs it, else a rewritten copy."""
    g = program.graph
    inits = {t.name: t for t in g.initializer}

    def eligible(n: onnx.NodeProto) -> bool:
        axis = next((a.i for a in n.attribute if a.name == "axis"), -1)
        return (n.op_type == "OneHot" and n.domain in ("", "ai.onnx") and len(n.input) == 3 and axis == -1
                and n.input[1] in inits and n.input[2] in inits
                and int(np.prod(inits[n.input[1]].dims)) == 1 and int(np.prod(inits[n.input[2]].dims)) == 2)

    if not any(eligible(n) for n in g.node):
        return program
    out = onnx.ModelProto()
    out.CopyFrom(program)
    opset = _opset(program)
    nodes: list[onnx.NodeProto] = []
    new_inits: list[onnx.TensorProto] = []
    for k, n in enumerate(g.node):
        if not eligible(n):
            nodes.append(n)
            continue
        depth = int(numpy_helper.to_array(inits[n.input[1]]).reshape(-1)[0])
        values = numpy_helper.to_array(inits[n.input[2]]).reshape(-1)
        p = f"{n.output[0]}__onehot{k}"
        new_inits += [numpy_helper.from_array(np.array(depth, np.int64), f"{p}_depth"),
                      numpy_helper.from_array(np.array(0, np.int64), f"{p}_zero"),
                      numpy_helper.from_array(np.arange(depth, dtype=np.int64), f"{p}_range"),
                      numpy_helper.from_array(values[1:2].reshape(()), f"{p}_on"),
                      numpy_helper.from_array(values[0:1].reshape(()), f"{p}_off")]
        nodes += [helper.make_node("Cast", [n.input[0]], [f"{p}_i"], to=TensorProto.INT64),
                  helper.make_node("Less", [f"{p}_i", f"{p}_zero"], [f"{p}_neg"]),
                  helper.make_node("Add", [f"{p}_i", f"{p}_depth"], [f"{p}_wrapped"]),
                  helper.make_node("Where", [f"{p}_neg", f"{p}_wrapped", f"{p}_i"], [f"{p}_idx"])]
        if opset >= 13:
            new_inits.append(numpy_helper.from_array(np.array([-1], np.int64), f"{p}_axes"))
            nodes.append(helper.make_node("Unsqueeze", [f"{p}_idx", f"{p}_axes"], [f"{p}_u"]))
        else:
            nodes.append(helper.make_node("Unsqueeze", [f"{p}_idx"], [f"{p}_u"], axes=[-1]))
        nodes += [helper.make_node("Equal", [f"{p}_u", f"{p}_range"], [f"{p}_eq"]),
                  helper.make_node("Where", [f"{p}_eq", f"{p}_on", f"{p}_off"], [n.output[0]], name=n.name)]
    del out.graph.node[:]
    out.graph.node.extend(nodes)
    out.graph.initializer.extend(new_inits)
    return out
