"""The catalogue of hostile and malformed model inputs, built programmatically into a folder.

Each entry of :data:`CASES` is a function ``build(root) -> HostileCase`` that writes one hostile
input under ``root`` (the model itself always sits in ``root / "model"``; files the loader must
never read sit in ``root / "outside"``) and says what the refusal message must name.

Rules every case must satisfy (checked by ``test_hostile_load.py``):
1. ``partitioner.load.load`` raises ``ModelLoadError`` (or a subclass) whose message is one line
   and contains every string of ``expect``.
2. ``partitioner inspect`` exits 2 with exactly one stderr line ``partitioner: error: ...``
   containing ``expect``, no traceback, within 10 s and bounded memory.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 17
SECRET_TEXT = b"TOP-SECRET: the loader must never open this file\n"


@dataclass(frozen=True)
class HostileCase:
    """One hostile input: where it is, what the message must contain, how to call the loader."""

    name: str
    path: Path
    expect: tuple[str, ...]
    batch: int | None = None
    shapes: dict[str, list[int]] = field(default_factory=dict)
    cli_args: tuple[str, ...] = ()


# building blocks -------------------------------------------------------------------------------

def model_dir(root: Path) -> Path:
    d = root / "model"
    d.mkdir(parents=True, exist_ok=True)
    return d


def outside_dir(root: Path) -> Path:
    """A folder beside the model's folder holding a secret the loader must never open."""
    d = root / "outside"
    d.mkdir(parents=True, exist_ok=True)
    (d / "secret.bin").write_bytes(SECRET_TEXT + bytes(48))
    return d


def make_model(nodes, inputs, outputs, initializers=(), opset: int = OPSET, name: str = "g",
               opsets: list | None = None) -> onnx.ModelProto:
    graph = helper.make_graph(list(nodes), name, list(inputs), list(outputs), initializer=list(initializers))
    ops = opsets if opsets is not None else [helper.make_opsetid("", opset)]
    model = helper.make_model(graph, opset_imports=ops)
    model.ir_version = 8
    return model


def small_model() -> onnx.ModelProto:
    """A valid model: Z = Relu(X @ W), X float[2,3], W float[3,4] (seeded)."""
    w = np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32)
    return make_model(
        [helper.make_node("MatMul", ["X", "W"], ["Y"], name="mm"), helper.make_node("Relu", ["Y"], ["Z"], name="relu")],
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_value_info("Z", TensorProto.FLOAT, [2, 4])],
        [numpy_helper.from_array(w, "W")],
    )


def save(model: onnx.ModelProto, path: Path) -> Path:
    path.write_bytes(model.SerializeToString())
    return path


def external_model(location: str, offset: int | None = None, length: int | None = None,
                   dims: tuple[int, ...] = (3, 4)) -> onnx.ModelProto:
    """``small_model`` whose initializer W lives in external data at ``location``."""
    model = small_model()
    w = model.graph.initializer[0]
    w.ClearField("raw_data")
    w.ClearField("float_data")
    del w.dims[:]
    w.dims.extend(dims)
    w.data_location = TensorProto.EXTERNAL
    entries = {"location": location}
    if offset is not None:
        entries["offset"] = str(offset)
    if length is not None:
        entries["length"] = str(length)
    for k, v in entries.items():
        e = w.external_data.add()
        e.key, e.value = k, v
    return model


def w_bytes() -> bytes:
    return onnx.numpy_helper.to_array(small_model().graph.initializer[0]).tobytes()


# the catalogue ---------------------------------------------------------------------------------

CASES: dict[str, Callable[[Path], HostileCase]] = {}


def case(fn: Callable[[Path], HostileCase]) -> Callable[[Path], HostileCase]:
    CASES[fn.__name__] = fn
    return fn


@case
def ext_dotdot(root: Path) -> HostileCase:
    outside_dir(root)
    p = save(external_model("../outside/secret.bin", length=48), model_dir(root) / "m.onnx")
    return HostileCase("ext_dotdot", p, ("'W'", "'..' is refused"))


@case
def ext_dotdot_inner(root: Path) -> HostileCase:
    """A ``..`` hidden in the middle of a path that would come back inside (``sub/../../``)."""
    outside_dir(root)
    (model_dir(root) / "sub").mkdir()
    p = save(external_model("sub/../../outside/secret.bin", length=48), model_dir(root) / "m.onnx")
    return HostileCase("ext_dotdot_inner", p, ("'W'", "'..' is refused"))


@case
def ext_absolute(root: Path) -> HostileCase:
    secret = outside_dir(root) / "secret.bin"
    p = save(external_model(str(secret.resolve()), length=48), model_dir(root) / "m.onnx")
    return HostileCase("ext_absolute", p, ("'W'", "absolute paths are refused"))


@case
def ext_symlink_file(root: Path) -> HostileCase:
    secret = outside_dir(root) / "secret.bin"
    d = model_dir(root)
    (d / "weights.bin").symlink_to(secret.resolve())
    p = save(external_model("weights.bin", length=48), d / "m.onnx")
    return HostileCase("ext_symlink_file", p, ("'W'", "'weights.bin' is a symlink"))


@case
def ext_symlink_folder(root: Path) -> HostileCase:
    out = outside_dir(root)
    d = model_dir(root)
    (d / "data").symlink_to(out.resolve(), target_is_directory=True)
    p = save(external_model("data/secret.bin", length=48), d / "m.onnx")
    return HostileCase("ext_symlink_folder", p, ("'W'", "'data' is a symlink"))


@case
def ext_missing_file(root: Path) -> HostileCase:
    p = save(external_model("nowhere.bin", length=48), model_dir(root) / "m.onnx")
    return HostileCase("ext_missing_file", p, ("'W'", "'nowhere.bin'", "no such file"))


@case
def ext_offset_out_of_range(root: Path) -> HostileCase:
    d = model_dir(root)
    (d / "w.bin").write_bytes(w_bytes())
    p = save(external_model("w.bin", offset=4096, length=48), d / "m.onnx")
    return HostileCase("ext_offset_out_of_range", p, ("'W'", "offset 4096", "outside the file (48 bytes)"))


@case
def ext_length_out_of_range(root: Path) -> HostileCase:
    d = model_dir(root)
    (d / "w.bin").write_bytes(w_bytes())
    p = save(external_model("w.bin", offset=0, length=10**12), d / "m.onnx")
    return HostileCase("ext_length_out_of_range", p, ("'W'", "length 1000000000000", "outside the file"))


@case
def ext_over_2gb(root: Path) -> HostileCase:
    """3 GiB of external data (a sparse file) in a Constant node's attribute, which the loader
    must read into the protobuf: refused before it is read. (A main-graph initializer of that
    size is fine: it stays a lazy, memory-mapped reference; tests/test_large_models.py.)"""
    d = model_dir(root)
    n = 3 * 2**30 // 4
    with open(d / "big.bin", "wb") as f:
        f.truncate(n * 4)
    w = external_model("big.bin", offset=0, length=n * 4, dims=(n // 4, 4)).graph.initializer[0]
    const = helper.make_node("Constant", [], ["W"], name="w_const", value=w)
    m = make_model([const, helper.make_node("Relu", ["W"], ["Z"], name="relu")], [],
                   [helper.make_tensor_value_info("Z", TensorProto.FLOAT, [n // 4, 4])])
    p = save(m, d / "m.onnx")
    return HostileCase("ext_over_2gb", p, ("'W'", "2 GB"))


@case
def raw_data_dims_mismatch(root: Path) -> HostileCase:
    m = small_model()
    m.graph.initializer[0].raw_data = bytes(40)  # dims [3, 4] float need 48
    p = save(m, model_dir(root) / "m.onnx")
    return HostileCase("raw_data_dims_mismatch", p, ("'W'", "40 bytes", "need 48"))


@case
def typed_count_mismatch(root: Path) -> HostileCase:
    m = small_model()
    w = m.graph.initializer[0]
    w.ClearField("raw_data")
    w.float_data.extend([1.0] * 5)
    p = save(m, model_dir(root) / "m.onnx")
    return HostileCase("typed_count_mismatch", p, ("'W'", "holds 5 values", "need 12"))


@case
def negative_dims(root: Path) -> HostileCase:
    m = small_model()
    w = m.graph.initializer[0]
    w.ClearField("raw_data")
    del w.dims[:]
    w.dims.extend([-3, -4])
    p = save(m, model_dir(root) / "m.onnx")
    return HostileCase("negative_dims", p, ("'W'", "negative dimension"))


@case
def huge_dims_no_data(root: Path) -> HostileCase:
    m = small_model()
    w = m.graph.initializer[0]
    w.ClearField("raw_data")
    del w.dims[:]
    w.dims.extend([10**9, 10**9, 10**9])
    p = save(m, model_dir(root) / "m.onnx")
    return HostileCase("huge_dims_no_data", p, ("'W'", "1e+27 elements", "over the limit"))


@case
def bomb_constant_of_shape(root: Path) -> HostileCase:
    shape = numpy_helper.from_array(np.array([100_000, 1_000_000], dtype=np.int64), "bomb_shape")
    m = make_model(
        [helper.make_node("ConstantOfShape", ["bomb_shape"], ["big"], name="bomb",
                          value=numpy_helper.from_array(np.array([1.0], np.float32))),
         helper.make_node("ReduceSum", ["big"], ["Y"], name="sum", keepdims=0)],
        [], [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [])], [shape])
    p = save(m, model_dir(root) / "m.onnx")
    return HostileCase("bomb_constant_of_shape", p, ("node 'bomb'", "ConstantOfShape", "1e+11 elements"))


@case
def bomb_expand(root: Path) -> HostileCase:
    shape = numpy_helper.from_array(np.array([100_000, 1_000_000], dtype=np.int64), "bomb_shape")
    one = numpy_helper.from_array(np.array([[1.0]], dtype=np.float32), "one")
    m = make_model(
        [helper.make_node("Expand", ["one", "bomb_shape"], ["big"], name="bomb"),
         helper.make_node("ReduceSum", ["big"], ["Y"], name="sum", keepdims=0)],
        [], [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [])], [shape, one])
    p = save(m, model_dir(root) / "m.onnx")
    return HostileCase("bomb_expand", p, ("node 'bomb'", "Expand", "1e+11 elements"))


@case
def bomb_in_subgraph(root: Path) -> HostileCase:
    """A ConstantOfShape bomb inside an If branch, its shape a Constant node of the branch."""
    def branch(tag: str, bomb: bool):
        nodes = [helper.make_node("Constant", [], [f"{tag}_s"], name=f"{tag}_shape",
                                  value=numpy_helper.from_array(np.array([100_000, 1_000_000], np.int64)))]
        nodes.append(helper.make_node("ConstantOfShape", [f"{tag}_s"], [f"{tag}_big"], name=f"{tag}_bomb")
                     if bomb else helper.make_node("Identity", [f"{tag}_s"], [f"{tag}_big"], name=f"{tag}_id"))
        nodes.append(helper.make_node("ReduceSum", [f"{tag}_big"], [f"{tag}_y"], name=f"{tag}_sum", keepdims=0))
        out = helper.make_tensor_value_info(f"{tag}_y", TensorProto.FLOAT if bomb else TensorProto.INT64, [])
        return helper.make_graph(nodes, tag, [], [out])
    then_g, else_g = branch("then", True), branch("else", True)
    m = make_model(
        [helper.make_node("If", ["C"], ["Y"], name="if", then_branch=then_g, else_branch=else_g)],
        [helper.make_tensor_value_info("C", TensorProto.BOOL, [])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [])])
    p = save(m, model_dir(root) / "m.onnx")
    return HostileCase("bomb_in_subgraph", p, ("_bomb'", "ConstantOfShape", "1e+11 elements"))


@case
def cycle(root: Path) -> HostileCase:
    m = make_model(
        [helper.make_node("Add", ["X", "B"], ["A"], name="add_a"),
         helper.make_node("Relu", ["A"], ["B"], name="relu_b"),
         helper.make_node("Identity", ["A"], ["Y"], name="out")],
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [2])])
    p = save(m, model_dir(root) / "m.onnx")
    return HostileCase("cycle", p, ("cycle", "'add_a'", "'relu_b'"))


@case
def non_ssa(root: Path) -> HostileCase:
    m = make_model(
        [helper.make_node("Relu", ["X"], ["Y"], name="first"),
         helper.make_node("Neg", ["X"], ["Y"], name="second")],
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [2])])
    p = save(m, model_dir(root) / "m.onnx")
    return HostileCase("non_ssa", p, ("'Y'", "produced twice", "'second'", "not SSA"))


@case
def dangling_input(root: Path) -> HostileCase:
    m = make_model(
        [helper.make_node("Add", ["X", "ghost"], ["Y"], name="add")],
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [2])])
    p = save(m, model_dir(root) / "m.onnx")
    return HostileCase("dangling_input", p, ("'ghost'", "node 'add'", "not produced"))


@case
def dangling_output(root: Path) -> HostileCase:
    m = make_model(
        [helper.make_node("Relu", ["X"], ["Y"], name="relu")],
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("Nope", TensorProto.FLOAT, [2])])
    p = save(m, model_dir(root) / "m.onnx")
    return HostileCase("dangling_output", p, ("graph output 'Nope'", "not produced"))


@case
def unknown_op(root: Path) -> HostileCase:
    m = make_model(
        [helper.make_node("FrobnicateX", ["X"], ["A"], name="frob1"),
         helper.make_node("Relu", ["A"], ["B"], name="ok"),
         helper.make_node("Wibble", ["B"], ["Y"], name="wib")],
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [2])])
    p = save(m, model_dir(root) / "m.onnx")
    return HostileCase("unknown_op", p, ("2 unsupported operator(s)", "FrobnicateX (node 'frob1')", "Wibble (node 'wib')"))


@case
def unknown_domain(root: Path) -> HostileCase:
    m = make_model(
        [helper.make_node("Relu", ["X"], ["Y"], name="evil_relu", domain="com.evil")],
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [2])],
        opsets=[helper.make_opsetid("", OPSET), helper.make_opsetid("com.evil", 1)])
    p = save(m, model_dir(root) / "m.onnx")
    return HostileCase("unknown_domain", p, ("unsupported operator", "com.evil::Relu", "'evil_relu'"))


def _relu_model(opset: int) -> onnx.ModelProto:
    return make_model(
        [helper.make_node("Relu", ["X"], ["Y"], name="relu")],
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [2])], opset=opset)


@case
def opset_999(root: Path) -> HostileCase:
    p = save(_relu_model(999), model_dir(root) / "m.onnx")
    return HostileCase("opset_999", p, ("opset 999", "out of range"))


@case
def opset_3(root: Path) -> HostileCase:
    p = save(_relu_model(3), model_dir(root) / "m.onnx")
    return HostileCase("opset_3", p, ("opset 3", "out of range"))


@case
def softmax_axis_out_of_range(root: Path) -> HostileCase:
    m = make_model(
        [helper.make_node("Softmax", ["X"], ["Y"], name="sm", axis=5)],
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [2, 3])])
    p = save(m, model_dir(root) / "m.onnx")
    return HostileCase("softmax_axis_out_of_range", p, ("shape inference failed", "node name: sm", "'axis'"))


@case
def gather_axis_out_of_range(root: Path) -> HostileCase:
    idx = numpy_helper.from_array(np.array([0, 1], np.int64), "idx")
    m = make_model(
        [helper.make_node("Gather", ["X", "idx"], ["Y"], name="gth", axis=7)],
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [2, 2])], [idx])
    p = save(m, model_dir(root) / "m.onnx")
    return HostileCase("gather_axis_out_of_range", p, ("shape inference failed", "node name: gth", "axis"))


@case
def empty_file(root: Path) -> HostileCase:
    p = model_dir(root) / "m.onnx"
    p.write_bytes(b"")
    return HostileCase("empty_file", p, ("m.onnx", "empty file"))


@case
def truncated_file(root: Path) -> HostileCase:
    data = small_model().SerializeToString()
    p = model_dir(root) / "m.onnx"
    p.write_bytes(data[: len(data) // 2])
    return HostileCase("truncated_file", p, ("m.onnx", "not an ONNX model"))


@case
def random_bytes(root: Path) -> HostileCase:
    p = model_dir(root) / "m.onnx"
    p.write_bytes(np.random.default_rng(1234).bytes(4096))
    return HostileCase("random_bytes", p, ("m.onnx", "not an ONNX model"))


@case
def text_file(root: Path) -> HostileCase:
    p = model_dir(root) / "m.onnx"
    p.write_text("This is a README, not a model.\nIt has two lines.\n")
    return HostileCase("text_file", p, ("m.onnx", "not an ONNX model"))


@case
def png_file(root: Path) -> HostileCase:
    p = model_dir(root) / "m.onnx"
    p.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\x00\x00\x00\x01\x00\x00\x00\x01\x08\x06\x00\x00\x00\x1f\x15\xc4\x89")
    return HostileCase("png_file", p, ("m.onnx", "not an ONNX model"))


@case
def json_file(root: Path) -> HostileCase:
    p = model_dir(root) / "m.onnx"
    p.write_text(json.dumps({"graph": {"node": [{"op_type": "Relu"}]}, "ir_version": 8}))
    return HostileCase("json_file", p, ("m.onnx", "not an ONNX model"))


@case
def folder(root: Path) -> HostileCase:
    p = model_dir(root) / "looks_like.onnx"
    p.mkdir()
    return HostileCase("folder", p, ("looks_like.onnx", "is a folder"))


@case
def device_file(root: Path) -> HostileCase:
    """A character device (endless zeros) given as the model: refused without reading."""
    return HostileCase("device_file", Path("/dev/zero"), ("/dev/zero", "not a regular file"))


@case
def fifo_file(root: Path) -> HostileCase:
    """A named pipe given as the model: opening it would block forever."""
    p = model_dir(root) / "pipe.onnx"
    os.mkfifo(p)
    return HostileCase("fifo_file", p, ("pipe.onnx", "not a regular file"))


@case
def dangling_symlink(root: Path) -> HostileCase:
    p = model_dir(root) / "gone.onnx"
    p.symlink_to(root / "does_not_exist.onnx")
    return HostileCase("dangling_symlink", p, ("gone.onnx", "no such file"))


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
    """One length-delimited protobuf field (wire type 2)."""
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def nested_if_model(depth: int) -> bytes:
    """Bytes of a model whose If nodes nest ``depth`` deep through their then-branches.

    Encoded by hand: deeper than about 30 levels protobuf itself refuses to build or parse the
    message (upb's depth limit of 100), so ``helper.make_node`` cannot make it.
    """
    def leaf(level: int) -> onnx.GraphProto:
        out = helper.make_tensor_value_info(f"y{level}", TensorProto.FLOAT, [2])
        return helper.make_graph([helper.make_node("Identity", ["X"], [f"y{level}"], name=f"leaf{level}")],
                                 f"leaf{level}", [], [out])

    inner = leaf(depth).SerializeToString()
    for level in range(depth - 1, -1, -1):
        node = helper.make_node("If", ["C"], [f"y{level}"], name=f"if{level}", else_branch=leaf(level))
        then_attr = _field(1, b"then_branch") + _field(6, inner) + _varint(20 << 3) + _varint(AttributeGraph)
        node_bytes = node.SerializeToString() + _field(5, then_attr)
        out = helper.make_tensor_value_info(f"y{level}", TensorProto.FLOAT, [2]).SerializeToString()
        inner = _field(1, node_bytes) + _field(2, f"level{level}".encode()) + _field(12, out)
    inputs = [helper.make_tensor_value_info("C", TensorProto.BOOL, []),
              helper.make_tensor_value_info("X", TensorProto.FLOAT, [2])]
    inner += b"".join(_field(11, vi.SerializeToString()) for vi in inputs)
    top = make_model([], [], [helper.make_tensor_value_info("y0", TensorProto.FLOAT, [2])])
    top.ClearField("graph")
    return top.SerializeToString() + _field(7, inner)


AttributeGraph = onnx.AttributeProto.GRAPH


@case
def deep_if_nesting_40(root: Path) -> HostileCase:
    p = model_dir(root) / "m.onnx"
    p.write_bytes(nested_if_model(40))
    return HostileCase("deep_if_nesting_40", p, ("m.onnx", "nested too deeply"))


@case
def deep_if_nesting_20(root: Path) -> HostileCase:
    p = model_dir(root) / "m.onnx"
    p.write_bytes(nested_if_model(20))
    return HostileCase("deep_if_nesting_20", p, ("m.onnx", "nested 17 deep", "the limit is 16"))


@case
def file_over_2gb(root: Path) -> HostileCase:
    """A sparse 3 GiB file: refused by its size before a byte is read."""
    p = model_dir(root) / "huge.onnx"
    with open(p, "wb") as f:
        f.write(small_model().SerializeToString())
        f.truncate(3 * 2**30)
    return HostileCase("file_over_2gb", p, ("huge.onnx", "3.0 GiB", "2 GB limit"))


def _symbolic_model() -> onnx.ModelProto:
    m = small_model()
    d = m.graph.input[0].type.tensor_type.shape.dim[0]
    d.Clear()
    d.dim_param = "batch"
    m.graph.output[0].type.tensor_type.shape.dim[0].Clear()
    m.graph.output[0].type.tensor_type.shape.dim[0].dim_param = "batch"
    return m


@case
def symbolic_batch_unbound(root: Path) -> HostileCase:
    p = save(_symbolic_model(), model_dir(root) / "m.onnx")
    return HostileCase("symbolic_batch_unbound", p, ("input 'X'", "symbolic dimension 'batch'", "--batch"))


@case
def wrong_shape_rank(root: Path) -> HostileCase:
    p = save(_symbolic_model(), model_dir(root) / "m.onnx")
    return HostileCase("wrong_shape_rank", p, ("--shape X", "3 dims given", "rank 2"),
                       shapes={"X": [1, 2, 3]}, cli_args=("--shape", "X=1,2,3"))


@case
def wrong_shape_fixed_dim(root: Path) -> HostileCase:
    p = save(_symbolic_model(), model_dir(root) / "m.onnx")
    return HostileCase("wrong_shape_fixed_dim", p, ("--shape X", "dimension 3 is fixed", "cannot bind 5"),
                       shapes={"X": [4, 5]}, cli_args=("--shape", "X=4,5"))


@case
def wrong_shape_name(root: Path) -> HostileCase:
    p = save(_symbolic_model(), model_dir(root) / "m.onnx")
    return HostileCase("wrong_shape_name", p, ("--shape", "unknown input(s) nosuch", "inputs are X"),
                       shapes={"nosuch": [1, 3]}, cli_args=("--shape", "nosuch=1,3"))


# running the CLI with bounded time and memory -------------------------------------------------

# A hostile input must not make the CLI work long: its CPU time (user + system, the child's own
# rusage) stays under CLI_CPU_LIMIT_S. CPU time does not grow when other processes share the
# cores; wall time does (under a load of 9 on 2 cores, 45 cases once passed 10 s of wall time
# while using 1-2 s of CPU each). A child that blocks without using CPU is caught by the
# wall-clock kill, set far above any loaded run: a hang never ends, so any bound catches it.
CLI_CPU_LIMIT_S = 10.0
CLI_TIMEOUT_S = 120.0
CLI_ADDRESS_SPACE = 4 * 2**30


@dataclass(frozen=True)
class CliResult:
    returncode: int
    stdout: str
    stderr: str
    seconds: float
    max_rss_bytes: int
    cpu_seconds: float


def _limit_memory() -> None:
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (CLI_ADDRESS_SPACE, CLI_ADDRESS_SPACE))


def run_cli(args: list[str], cwd: Path, timeout: float = CLI_TIMEOUT_S) -> CliResult:
    """Run ``python -m partitioner.cli ARGS`` under a 4 GiB address-space limit; reap it with
    ``os.wait4`` to get this child's own peak RSS and CPU time. Kills it and raises TimeoutError
    past ``timeout`` seconds of wall time."""
    import subprocess
    import tempfile

    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(repo), "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        t0 = time.monotonic()
        proc = subprocess.Popen([sys.executable, "-m", "partitioner.cli", *args], stdout=out, stderr=err,
                                stdin=subprocess.DEVNULL, cwd=cwd, env=env, preexec_fn=_limit_memory)
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if time.monotonic() - t0 > timeout:
                proc.kill()
                os.wait4(proc.pid, 0)
                proc.returncode = -9
                raise TimeoutError(f"partitioner {' '.join(args)} ran past {timeout} s")
            time.sleep(0.02)
        seconds = time.monotonic() - t0
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        return CliResult(proc.returncode, out.read().decode(errors="replace"), err.read().decode(errors="replace"),
                         seconds, usage.ru_maxrss * 1024, usage.ru_utime + usage.ru_stime)
