"""Hand-built per-rank programs (with comm ops) and their bindings, for runtime tests.

Each builder returns ``(source_model, programs, bindings)`` for a 2-rank split of a tiny MLP
``y = relu(x @ W1) @ W2`` (or ``relu(x @ W + b)`` for data parallelism). Weights are seeded; the
source model is what ``--check`` runs through ONNX Runtime, so a wrong split shows as a mismatch.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from partitioner.core import comm_ops
from partitioner.core.bindings import Bindings, Placement, TensorBinding

F = TensorProto.FLOAT
B, D_IN, D_H, D_OUT = 4, 8, 6, 4


def weights(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"W1": rng.standard_normal((D_IN, D_H)).astype(np.float32),
            "W2": rng.standard_normal((D_H, D_OUT)).astype(np.float32),
            "b": rng.standard_normal((D_H,)).astype(np.float32)}


def inputs(seed: int = 1) -> dict[str, np.ndarray]:
    return {"x": np.random.default_rng(seed).standard_normal((B, D_IN)).astype(np.float32)}


def _vi(name: str, shape: list[int]) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, F, shape)


def _model(nodes, ins, outs, inits, vis, name) -> onnx.ModelProto:
    g = helper.make_graph(nodes, name, ins, outs, initializer=[numpy_helper.from_array(v, k) for k, v in inits.items()],
                          value_info=vis)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), comm_ops.opset_import()])
    m.ir_version = 8
    return m


def mlp_source(w: dict[str, np.ndarray]) -> onnx.ModelProto:
    nodes = [helper.make_node("MatMul", ["x", "W1"], ["h0"]), helper.make_node("Relu", ["h0"], ["h"]),
             helper.make_node("MatMul", ["h", "W2"], ["y"])]
    m = _model(nodes, [_vi("x", [B, D_IN])], [_vi("y", [B, D_OUT])], {"W1": w["W1"], "W2": w["W2"]}, [], "mlp")
    del m.opset_import[1]
    return m


def data_parallel(seed: int = 0):
    w = weights(seed)
    nodes = [helper.make_node("MatMul", ["x", "W1"], ["h0"]), helper.make_node("Add", ["h0", "b"], ["h1"]),
             helper.make_node("Relu", ["h1"], ["y"])]
    src = _model(nodes, [_vi("x", [B, D_IN])], [_vi("y", [B, D_H])], {"W1": w["W1"], "b": w["b"]}, [], "dp")
    del src.opset_import[1]
    half = B // 2
    progs = [_model(nodes, [_vi("x", [half, D_IN])], [_vi("y", [half, D_H])], {"W1": w["W1"], "b": w["b"]},
                    [_vi("h0", [half, D_H]), _vi("h1", [half, D_H])], f"dp_rank{r}") for r in range(2)]
    bind = Bindings(
        inputs=(TensorBinding("x", (B, D_IN), "float32", (Placement(0, "x", 0, 0, half), Placement(1, "x", 0, half, B))),),
        outputs=(TensorBinding("y", (B, D_H), "float32", (Placement(0, "y", 0, 0, half), Placement(1, "y", 0, half, B))),),
        world_size=2)
    return src, progs, bind


def pipeline(microbatches: int = 2, seed: int = 0):
    w = weights(seed)
    mb = B // microbatches
    r0 = _model([helper.make_node("MatMul", ["x", "W1"], ["h0"]), helper.make_node("Relu", ["h0"], ["h"]),
                 comm_ops.make_node("Send", ["h"], [], name="send_h", peer=1, tag=7)],
                [_vi("x", [mb, D_IN])], [], {"W1": w["W1"]}, [_vi("h0", [mb, D_H]), _vi("h", [mb, D_H])], "stage0")
    r1 = _model([comm_ops.make_node("Recv", [], ["h"], name="recv_h", peer=0, tag=7, shape=[mb, D_H], dtype=F),
                 helper.make_node("MatMul", ["h", "W2"], ["y"])],
                [], [_vi("y", [mb, D_OUT])], {"W2": w["W2"]}, [_vi("h", [mb, D_H])], "stage1")
    bind = Bindings(inputs=(TensorBinding("x", (B, D_IN), "float32", (Placement(0, "x"),)),),
                    outputs=(TensorBinding("y", (B, D_OUT), "float32", (Placement(1, "y"),)),),
                    world_size=2, microbatches=microbatches)
    return mlp_source(w), [r0, r1], bind


def tensor_parallel(seed: int = 0):
    """Megatron MLP: W1 split by columns, W2 by rows, AllReduce(sum) of the partial products,
    plus an AllGather of the hidden activations that rank 0 returns as a second check."""
    w = weights(seed)
    k = D_H // 2
    progs = []
    for r in range(2):
        cols = slice(r * k, (r + 1) * k)
        nodes = [helper.make_node("MatMul", ["x", "W1"], ["h0"]), helper.make_node("Relu", ["h0"], ["h"]),
                 helper.make_node("MatMul", ["h", "W2"], ["yp"]),
                 comm_ops.make_node("AllReduce", ["yp"], ["y"], name="ar", group=[0, 1], reduction="sum", tag=1),
                 comm_ops.make_node("AllGather", ["h"], ["hfull"], name="ag", group=[0, 1], axis=1, tag=2)]
        progs.append(_model(nodes, [_vi("x", [B, D_IN])], [_vi("y", [B, D_OUT]), _vi("hfull", [B, D_H])],
                            {"W1": np.ascontiguousarray(w["W1"][:, cols]), "W2": np.ascontiguousarray(w["W2"][cols, :])},
                            [_vi("h0", [B, k]), _vi("h", [B, k]), _vi("yp", [B, D_OUT])], f"tp_rank{r}"))
    src = mlp_source(w)
    src.graph.output.append(_vi("h", [B, D_H]))
    bind = Bindings(inputs=(TensorBinding("x", (B, D_IN), "float32", (Placement(0, "x"), Placement(1, "x"))),),
                    outputs=(TensorBinding("y", (B, D_OUT), "float32", (Placement(0, "y"),)),
                             TensorBinding("h", (B, D_H), "float32", (Placement(1, "hfull"),))),
                    world_size=2)
    return src, progs, bind


def collectives():
    """Every collective on MPI, checked against numpy by the test (not against the runtime).

    x [4, 8] is split by rows: rank r holds x_r = x[2r:2r+2].
    - rs = ReduceScatter(sum, axis 1): rank r keeps columns [4r, 4r+4) of x_0 + x_1; global rs = x_0 + x_1.
    - a2a = AllToAll(split 0, concat 1): rank j gets concat(x_0[j], x_1[j]); global a2a [2, 16].
    - bc = Broadcast from rank 1 of 2 * x_1 (rank 0 passes no input).
    - mx = AllReduce(max) of x_0, x_1, returned by rank 1.
    - ag = AllGather(axis 0) of x_r = x, returned by rank 0.
    """
    g = [0, 1]
    progs = []
    for r in range(2):
        nodes = [comm_ops.make_node("ReduceScatter", ["x"], ["rs"], name="rs", group=g, axis=1, reduction="sum", tag=1),
                 comm_ops.make_node("AllToAll", ["x"], ["a2a"], name="a2a", group=g, split_axis=0, concat_axis=1, tag=2),
                 comm_ops.make_node("AllReduce", ["x"], ["mx"], name="mx", group=g, reduction="max", tag=4),
                 comm_ops.make_node("AllGather", ["x"], ["ag"], name="ag", group=g, axis=0, tag=5)]
        vis = [_vi("rs", [2, 4]), _vi("a2a", [1, 16]), _vi("mx", [2, 8]), _vi("ag", [4, 8]), _vi("bc", [2, 8])]
        if r == 1:
            nodes += [helper.make_node("Add", ["x", "x"], ["x2"]),
                      comm_ops.make_node("Broadcast", ["x2"], ["bc"], name="bc", group=g, root=1, tag=3,
                                         shape=[2, 8], dtype=F)]
            vis.append(_vi("x2", [2, 8]))
        else:
            nodes.append(comm_ops.make_node("Broadcast", [], ["bc"], name="bc", group=g, root=1, tag=3,
                                            shape=[2, 8], dtype=F))
        progs.append(_model(nodes, [_vi("x", [2, 8])], [_vi(n, s) for n, s in
                                                         [("rs", [2, 4]), ("a2a", [1, 16]), ("bc", [2, 8]),
                                                          ("mx", [2, 8]), ("ag", [4, 8])]], {}, vis, f"coll{r}"))
    t = TensorBinding
    bind = Bindings(
        inputs=(t("x", (4, 8), "float32", (Placement(0, "x", 0, 0, 2), Placement(1, "x", 0, 2, 4))),),
        outputs=(t("rs", (2, 8), "float32", (Placement(0, "rs", 1, 0, 4), Placement(1, "rs", 1, 4, 8))),
                 t("a2a", (2, 16), "float32", (Placement(0, "a2a", 0, 0, 1), Placement(1, "a2a", 0, 1, 2))),
                 t("bc", (2, 8), "float32", (Placement(0, "bc"),)),
                 t("mx", (2, 8), "float32", (Placement(1, "mx"),)),
                 t("ag", (4, 8), "float32", (Placement(0, "ag"),))),
        world_size=2)
    src = _model([helper.make_node("Identity", ["x"], ["y"])], [_vi("x", [4, 8])], [_vi("y", [4, 8])], {}, [], "id")
    del src.opset_import[1]
    return src, progs, bind


def collectives_expected(x: np.ndarray) -> dict[str, np.ndarray]:
    x0, x1 = x[:2], x[2:]
    return {"rs": x0 + x1, "a2a": np.stack([np.concatenate([x0[j], x1[j]]) for j in range(2)]),
            "bc": x1 + x1, "mx": np.maximum(x0, x1), "ag": x}


def hanging():
    """Rank 1 waits for a message rank 0 never sends (for the launcher's overall timeout)."""
    src, progs, bind = pipeline(microbatches=1)
    r0 = onnx.ModelProto()
    r0.CopyFrom(progs[0])
    r0.graph.node[2].attribute[1].i = 99  # Send tag 7 -> 99: the Recv (tag 7) never matches
    return src, [r0, progs[1]], bind
