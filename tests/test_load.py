"""Valid inputs load cleanly through ``partitioner.load.load``: every zoo model, a model with
external data in its own folder (checked against ONNX Runtime on the original), symbolic
batches bound with ``batch``/``shapes``, and the small rules of the loader (sorting, sub-byte
tensor sizes, limits). Hostile inputs are in tests/hostile/.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import models_zoo
from partitioner.core.errors import ModelLoadError, UnsupportedOpError
from partitioner.load import load

ZOO = [e.name for e in models_zoo.list_models()]
# covered by test-slow: resnet50 (about 2 s to build and infer) and the three largest light models
# (240-550 MiB of weights: 10-30 s each for the build and full_check's copies, mostly system time;
# the other light models stay in the fast suite)
SLOW_ZOO = {"resnet50", "light_vgg19", "light_zfnet512", "light_bvlc_alexnet"}


def _static(model: ir.Model) -> list[str]:
    """Names of used node outputs whose shape is unknown or not all-integer (an unused output, such
    as Dropout's mask in the opset-9 light models, may stay without a shape)."""
    bad = []
    for node in model.graph:
        for v in node.outputs:
            if not v.uses() and not v.is_graph_output():
                continue
            if v.shape is None or not all(isinstance(d, int) for d in v.shape):
                bad.append(v.name)
    return bad


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW_ZOO else n for n in ZOO])
def test_zoo_model_loads(name: str) -> None:
    kwargs = {"symbolic_batch": True} if name == "gpt" else {}
    proto = models_zoo.build(name, **kwargs)
    model = load(proto, batch=2 if name == "gpt" else None)
    assert isinstance(model, ir.Model)
    assert len(model.graph) == len(proto.graph.node)
    assert [v.name for v in model.graph.outputs] == [o.name for o in proto.graph.output]
    assert _static(model) == []
    onnx.checker.check_model(ir.serde.serialize_model(model), full_check=True)


def test_zoo_name_loads_like_the_proto() -> None:
    by_name = load("mlp")
    assert [n.op_type for n in by_name.graph] == [n.op_type for n in models_zoo.build("mlp").graph.node]


def _run(proto: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    sess = ort.InferenceSession(proto.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


def test_external_data_in_folder_matches_onnxruntime(tmp_path: Path) -> None:
    original = models_zoo.build("mlp")
    copy = onnx.ModelProto()
    copy.CopyFrom(original)
    path = tmp_path / "mlp.onnx"
    onnx.save(copy, str(path), save_as_external_data=True, all_tensors_to_one_file=True, location="weights.bin",
              size_threshold=0)
    stored = onnx.load(str(path), load_external_data=False)
    assert sum(t.data_location == TensorProto.EXTERNAL for t in stored.graph.initializer) == len(original.graph.initializer)
    assert (tmp_path / "weights.bin").stat().st_size > 0

    model = load(str(path))
    lazy = [v.name for v in model.graph.initializers.values() if isinstance(v.const_value, ir.ExternalTensor)]
    assert lazy  # the large weights stay memory-mapped references (issue 14); tests/test_large_models.py
    loaded = ir.serde.serialize_model(ir.external_data.load_to_model(model))
    assert all(t.data_location == TensorProto.DEFAULT for t in loaded.graph.initializer)
    x = np.random.default_rng(7).standard_normal((1, 128)).astype(np.float32)
    want = _run(original, {"input": x})
    got = _run(loaded, {"input": x})
    for w, g in zip(want, got):
        np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6)


def test_symlinked_model_file_is_followed(tmp_path: Path) -> None:
    """A symlink to the model itself is fine: its external data is read beside the target."""
    real = tmp_path / "real"
    real.mkdir()
    onnx.save(models_zoo.build("mlp"), str(real / "mlp.onnx"), save_as_external_data=True, location="w.bin",
              size_threshold=0)
    (tmp_path / "link.onnx").symlink_to(real / "mlp.onnx")
    assert len(load(str(tmp_path / "link.onnx")).graph) == len(models_zoo.build("mlp").graph.node)


def test_batch_binds_symbolic_dims() -> None:
    model = load(models_zoo.build("gpt", symbolic_batch=True), batch=3)
    assert list(model.graph.inputs[0].shape) == [3, 32]
    assert int(model.graph.outputs[0].shape[0]) == 3


def test_shapes_bind_symbolic_dims() -> None:
    model = load(models_zoo.build("gpt", symbolic_batch=True), shapes={"input_ids": [5, 32]})
    assert list(model.graph.inputs[0].shape) == [5, 32]


def test_out_of_order_graph_is_sorted() -> None:
    nodes = [helper.make_node("Neg", ["A"], ["Y"], name="second"), helper.make_node("Relu", ["X"], ["A"], name="first")]
    proto = helper.make_model(
        helper.make_graph(nodes, "g", [helper.make_tensor_value_info("X", TensorProto.FLOAT, [2])],
                          [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [2])]),
        opset_imports=[helper.make_opsetid("", 17)])
    assert [n.name for n in load(proto).graph] == ["first", "second"]


def test_unnamed_node_is_named_by_index() -> None:
    nodes = [helper.make_node("Relu", ["X"], ["Y"]), helper.make_node("Neg", ["X"], ["Y"])]
    proto = helper.make_model(
        helper.make_graph(nodes, "g", [helper.make_tensor_value_info("X", TensorProto.FLOAT, [2])],
                          [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [2])]),
        opset_imports=[helper.make_opsetid("", 17)])
    with pytest.raises(ModelLoadError, match=r"value 'Y' is produced twice \(node #1 \(Neg\)\)"):
        load(proto)


def test_every_unsupported_op_is_listed() -> None:
    nodes = [helper.make_node(op, ["X"], [f"y{i}"], name=f"n{i}") for i, op in enumerate(["Foo", "Relu", "Bar", "Baz"])]
    proto = helper.make_model(
        helper.make_graph(nodes, "g", [helper.make_tensor_value_info("X", TensorProto.FLOAT, [2])],
                          [helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, [2]) for i in range(4)]),
        opset_imports=[helper.make_opsetid("", 17)])
    with pytest.raises(UnsupportedOpError) as info:
        load(proto)
    assert info.value.ops == [("Foo", "n0"), ("Bar", "n2"), ("Baz", "n3")]


def _with_initializer(t: TensorProto) -> onnx.ModelProto:
    graph = helper.make_graph([helper.make_node("Identity", [t.name], ["Y"], name="id")], "g", [],
                              [helper.make_tensor_value_info("Y", t.data_type, list(t.dims))], initializer=[t])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 25)])  # int2 needs opset 25


@pytest.mark.parametrize("dtype, nbytes", [(TensorProto.INT4, 3), (TensorProto.UINT4, 3), (TensorProto.INT2, 2),
                                           (TensorProto.UINT2, 2)])
def test_sub_byte_tensors(dtype: int, nbytes: int) -> None:
    """5 packed 4-bit values take 3 bytes, 5 packed 2-bit values 2 bytes (hand-computed)."""
    vals = [1, 0, 1, 1, 0]
    raw = helper.make_tensor("T", dtype, [5], np.array(vals, np.int8 if dtype in (TensorProto.INT4, TensorProto.INT2)
                                                       else np.uint8), raw=True)
    assert len(raw.raw_data) == nbytes
    load(_with_initializer(raw))
    typed = helper.make_tensor("T", dtype, [5], vals)
    load(_with_initializer(typed))
    raw.raw_data = raw.raw_data + b"\x00"
    with pytest.raises(ModelLoadError, match=f"raw_data has {nbytes + 1} bytes but dims \\[5\\] need {nbytes}"):
        load(_with_initializer(raw))


def test_max_elements_is_a_parameter() -> None:
    proto = models_zoo.build("mlp")
    biggest = max(int(np.prod(t.dims)) for t in proto.graph.initializer)
    load(proto, max_elements=biggest)
    with pytest.raises(ModelLoadError, match=f"has {biggest} elements, over the limit of {biggest - 1}$"):
        load(proto, max_elements=biggest - 1)


def test_in_memory_model_cannot_use_external_data() -> None:
    proto = models_zoo.build("mlp")
    t = proto.graph.initializer[0]
    t.ClearField("raw_data")
    t.data_location = TensorProto.EXTERNAL
    e = t.external_data.add()
    e.key, e.value = "location", "w.bin"
    with pytest.raises(ModelLoadError, match=f"tensor '{t.name}'.*given in memory cannot use external data"):
        load(proto)


def test_not_a_model_type_is_refused() -> None:
    with pytest.raises(ModelLoadError, match="cannot load a model from a int"):
        load(42)  # type: ignore[arg-type]


def test_missing_path_that_is_not_a_zoo_name(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="no such file .*not a zoo name"):
        load(str(tmp_path / "nope.onnx"))


def test_initializer_and_numpy_helper_agree() -> None:
    """The loaded weights are the stored ones, bit for bit."""
    proto = models_zoo.build("mlp")
    model = load(proto)
    for t in proto.graph.initializer:
        np.testing.assert_array_equal(model.graph.initializers[t.name].const_value.numpy(), numpy_helper.to_array(t))
