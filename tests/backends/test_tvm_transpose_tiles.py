"""An axis permutation whose output-innermost axis is strided in its source (a training step's
conv weight OIHW -> HWIO transpose, also with its taps reversed) runs tiled: the
outer part of the output-innermost axis outermost, the other axes in source order, one row tile
and the vector innermost (backends/tvm/schedules/transpose_tiles.py, knob
``TILE_STRIDED_TRANSPOSE``). Every build matches ONNX Runtime (rtol 1e-4, atol 1e-5, seeded
input); with the knob off the loops keep the output's order (so the structural check fails)."""

from __future__ import annotations

import onnx
import pytest
import tvm
from onnx import TensorProto, helper

from backends.tvm.schedules import transpose_tiles as TT
from backends.tvm.schedules.vector import vector_lanes
from backends.tvm.target import detect_host_target
from tvm_build_check import build_and_compare


def _transpose(shape: list[int], perm: list[int], flip: bool = False) -> onnx.ModelProto:
    """Transpose ``perm`` of x, optionally followed by a Slice reversing the first two output axes."""
    out = [shape[p] for p in perm]
    nodes = [helper.make_node("Transpose", ["x"], ["t" if flip else "y"], perm=perm)]
    inits = []
    if flip:
        nodes.append(helper.make_node("Slice", ["t", "st", "en", "ax", "sp"], ["y"]))
        inits = [helper.make_tensor(n, TensorProto.INT64, [2], v)
                 for n, v in (("st", [-1, -1]), ("en", [-2**62, -2**62]), ("ax", [0, 1]), ("sp", [-1, -1]))]
    g = helper.make_graph(nodes, "t", [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, out)], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def _loop_extents(mod: tvm.IRModule) -> list[int]:
    """Extents of the loops around the (only) scheduled copy block, outermost first."""
    from tvm import s_tir

    funcs = [f for f in mod.functions.values() if isinstance(f, tvm.tirx.PrimFunc)]
    assert len(funcs) == 1
    sch = s_tir.Schedule(funcs[0])
    blocks = sch.get_child_blocks(sch.get_sblock("root"))
    assert len(blocks) == 1
    return [int(sch.get(lp).extent) for lp in sch.get_loops(blocks[0])]


LANES = vector_lanes(tvm.target.Target(detect_host_target()))


@pytest.mark.parametrize("flip", [False, True], ids=["oihw-to-hwio", "flipped"])
def test_weight_transpose_walks_source_rows(flip: bool) -> None:
    ext = _loop_extents(build_and_compare(_transpose([64, 32, 3, 3], [2, 3, 1, 0], flip)))
    # output (3, 3, 32, 64): 64 // lanes vector columns outermost, 32 // 16 row tiles, 3, 3, 16 rows, lanes
    assert ext == [64 // LANES, 32 // TT.ROW_TILE, 3, 3, TT.ROW_TILE, LANES]


def test_knob_off_keeps_the_output_order(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(TT, "TILE_STRIDED_TRANSPOSE", False)
    ext = _loop_extents(build_and_compare(_transpose([64, 32, 3, 3], [2, 3, 1, 0])))
    assert ext[0] != 64 // LANES and ext[-1] == LANES  # the default: output order, vector innermost


def test_contiguous_innermost_is_left_alone() -> None:
    """The source's innermost axis stays innermost: the default order already reads rows."""
    ext = _loop_extents(build_and_compare(_transpose([32, 64, 3, 64], [1, 0, 2, 3])))
    assert ext[-1] == LANES and ext[0] != 64 // LANES


def test_short_source_stride_is_left_alone() -> None:
    """(I, O, 3, 3) -> (3, 3, I, O) with the taps reversed: the output-innermost axis is 9 floats
    apart in the source, under a cache line (MIN_SOURCE_STRIDE), where the default order was faster."""
    ext = _loop_extents(build_and_compare(_transpose([32, 64, 3, 3], [2, 3, 0, 1], flip=True)))
    assert ext[-1] == LANES and ext[0] != 64 // LANES


def _reshape_transpose(shape: list[int], merged: list[int], perm: list[int]) -> onnx.ModelProto:
    """Reshape x to ``merged``, then Transpose ``perm``: the two fuse into one copy whose source
    indices are ``v // n`` and ``v % n`` (not a plain permutation)."""
    out = [merged[p] for p in perm]
    nodes = [helper.make_node("Reshape", ["x", "shape"], ["r"]),
             helper.make_node("Transpose", ["r"], ["y"], perm=perm)]
    inits = [helper.make_tensor("shape", TensorProto.INT64, [len(merged)], merged)]
    g = helper.make_graph(nodes, "rt", [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, out)], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def test_fused_reshape_transpose_walks_source_rows() -> None:
    """bert's weight-gradient operand, shrunk: [4, 8, 64] -> [32, 64] -> [64, 32]. The fused copy
    reads ``x[v1 // 8, v1 % 8, v0]``, offset ``64 v1 + v0`` (linear_source_strides): tiled."""
    ext = _loop_extents(build_and_compare(_reshape_transpose([4, 8, 64], [32, 64], [1, 0])))
    assert ext == [32 // LANES, 64 // TT.ROW_TILE, TT.ROW_TILE, LANES]


def test_linear_knob_off_keeps_the_output_order(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(TT, "TILE_LINEAR_TRANSPOSE", False)
    ext = _loop_extents(build_and_compare(_reshape_transpose([4, 8, 64], [32, 64], [1, 0])))
    assert ext[-1] == LANES and ext[0] != 32 // LANES


def test_linear_source_strides_of_a_split_index() -> None:
    """The strides come from the simplified flat offset; a copy that is not linear (a broadcast
    reads one element for many outputs: stride 0) gets None."""
    from tvm import s_tir, te, topi

    x = te.placeholder((4, 8, 64), name="x")
    sch = s_tir.Schedule(te.create_prim_func([x, topi.transpose(topi.reshape(x, (32, 64)), (1, 0))]))
    blocks = sch.get_child_blocks(sch.get_sblock("root"))
    sch.compute_inline(blocks[0])
    assert TT.linear_source_strides(sch.get(sch.get_child_blocks(sch.get_sblock("root"))[0])) == [1, 64]
    b = te.placeholder((1, 64), name="b")
    sch = s_tir.Schedule(te.create_prim_func([b, topi.broadcast_to(b, (32, 64))]))
    assert TT.linear_source_strides(sch.get(sch.get_child_blocks(sch.get_sblock("root"))[0])) is None


def test_row_tile_is_the_source_innermost_axis(monkeypatch: pytest.MonkeyPatch) -> None:
    """NHWC -> NCHW, (2, 32, 32, 64) -> (2, 64, 32, 32): the output-innermost W is 64 floats apart
    in the source; the row tile is C (contiguous in the source), not H (the output's
    second-innermost, ROW_TILE_BY_SOURCE off): a 16 x 16 block per tile."""
    ext = _loop_extents(build_and_compare(_transpose([2, 32, 32, 64], [0, 3, 1, 2])))
    assert ext == [32 // LANES, 64 // TT.ROW_TILE, 2, 32, TT.ROW_TILE, LANES]
    monkeypatch.setattr(TT, "ROW_TILE_BY_SOURCE", False)
    ext = _loop_extents(build_and_compare(_transpose([2, 32, 32, 64], [0, 3, 1, 2])))
    assert ext == [32 // LANES, 32 // TT.ROW_TILE, 2, 64, TT.ROW_TILE, LANES]


def _affine_transpose(shape: list[int], perm: list[int]) -> onnx.ModelProto:
    """A per-channel affine (x * s + b, s and b constants of shape [1, C, 1, 1]) then Transpose
    ``perm``: one fused block whose largest read is x."""
    import numpy as np
    from onnx import numpy_helper

    rng = np.random.default_rng(1)
    c = [1, shape[1], 1, 1]
    inits = [numpy_helper.from_array(rng.standard_normal(c).astype(np.float32), n) for n in ("s", "b")]
    nodes = [helper.make_node("Mul", ["x", "s"], ["m"]), helper.make_node("Add", ["m", "b"], ["a"]),
             helper.make_node("Transpose", ["a"], ["y"], perm=perm)]
    out = helper.make_tensor_value_info("y", TensorProto.FLOAT, [shape[p] for p in perm])
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)
    g = helper.make_graph(nodes, "at", [x], [out], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def test_elementwise_fused_into_a_transpose_is_tiled(monkeypatch: pytest.MonkeyPatch) -> None:
    """The stem's batch norm written HWNC for its weight gradient, shrunk: (2, 32, 32, 32) NCHW,
    x * s[c] + b[c], -> (32, 32, 2, 32). The largest read (x) decides: C is the output-innermost
    axis, 1024 floats apart in x; the row tile is W. Off (TILE_LINEAR_TRANSPOSE): the output order."""
    m = _affine_transpose([2, 32, 32, 32], [2, 3, 0, 1])
    assert _loop_extents(build_and_compare(m)) == [32 // LANES, 32 // TT.ROW_TILE, 2, 32, TT.ROW_TILE, LANES]
    monkeypatch.setattr(TT, "TILE_LINEAR_TRANSPOSE", False)
    ext = _loop_extents(build_and_compare(m))
    assert ext[-1] == LANES and ext[0] != 32 // LANES
