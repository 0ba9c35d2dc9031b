"""TVM builds of an external-data model take the weights as parameters (backends/tvm/weight_params.py).

- The compiled ``rank<i>.so`` holds code only: far smaller than the rank's weights, which live once,
  in ``rank<i>.data``.
- The ranks run under MPI (each worker maps its ``rank<i>.data``) and in one process (programs
  loaded with their data), and both match ONNX Runtime on the whole model.
- A model whose weights are in the protobuf keeps them as constants (rule 1): its library embeds
  them, as before.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from backends.tvm.lower import lower_program
from backends.tvm.weight_params import PREFIX, param_weight_names


def _mlp(hidden: int = 256, seed: int = 0) -> onnx.ModelProto:
    rng = np.random.default_rng(seed)
    w1 = (rng.standard_normal((hidden, 2 * hidden)) / np.sqrt(hidden)).astype(np.float32)
    b1 = rng.standard_normal(2 * hidden).astype(np.float32)
    w2 = (rng.standard_normal((2 * hidden, hidden)) / np.sqrt(2 * hidden)).astype(np.float32)
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"], name="mm1"),
             helper.make_node("Add", ["h", "b1"], ["hb"], name="add1"),
             helper.make_node("Relu", ["hb"], ["r"], name="relu"),
             helper.make_node("MatMul", ["r", "w2"], ["y"], name="mm2")]
    graph = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [8, hidden])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [8, hidden])],
                              [numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(b1, "b1"),
                               numpy_helper.from_array(w2, "w2")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _ort(proto: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> np.ndarray:
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    return ort.InferenceSession(proto.SerializeToString(), opts, providers=["CPUExecutionProvider"]).run(None, feeds)[0]


@pytest.fixture(scope="module")
def tvm_artifact(tmp_path_factory: pytest.TempPathFactory):
    from partitioner.compiler import compile as compile_artifact

    tmp = tmp_path_factory.mktemp("tvm_params")
    proto = _mlp()
    folder = tmp / "m"
    folder.mkdir()
    copy = onnx.ModelProto()
    copy.CopyFrom(proto)
    onnx.save(copy, str(folder / "model.onnx"), save_as_external_data=True, all_tensors_to_one_file=True,
              location="w.data", size_threshold=0)
    art = compile_artifact(str(folder / "model.onnx"), "cpu:2", strategy="tensor", backend="tvm",
                           out_dir=tmp / "art", jobs=1, progress=False, build_options={"pipeline": "zero"})
    return art, proto


def test_rank_libraries_hold_code_not_weights(tvm_artifact) -> None:
    art, _ = tvm_artifact
    for r in range(2):
        data = (art.root / f"rank{r}.data").stat().st_size
        lib = (art.root / f"rank{r}.so").stat().st_size
        assert data >= 512 * 1024  # half of w1 and of w2
        assert lib < data / 4, f"rank{r}.so is {lib} bytes for {data} bytes of weights: weights embedded?"
        lean = art.program(r, load_data=False)
        assert set(param_weight_names(lean)) >= {t.name for t in lean.graph.initializer
                                                 if t.data_location == TensorProto.EXTERNAL}


def test_weight_parameters_run_under_mpi_and_in_process(tvm_artifact) -> None:
    art, proto = tvm_artifact
    x = np.random.default_rng(2).standard_normal((8, 256)).astype(np.float32)
    want = _ort(proto, {"x": x})
    mpi = art.run({"x": x}, timeout=120)
    np.testing.assert_allclose(mpi.outputs["y"], want, rtol=1e-4, atol=1e-4)
    local = art.run({"x": x}, in_process=True)
    np.testing.assert_allclose(local.outputs["y"], want, rtol=1e-4, atol=1e-4)


def test_weights_in_the_protobuf_stay_constants() -> None:
    proto = _mlp(hidden=64)
    lowered = lower_program(proto)
    assert lowered.weights == ()
    assert not any(str(p.name).startswith(PREFIX) for p in lowered.mod["main"].params)
    lazy = onnx.ModelProto()
    lazy.CopyFrom(proto)
    t = lazy.graph.initializer[0]
    t.ClearField("raw_data")
    t.data_location = TensorProto.EXTERNAL
    for key, value in (("location", "rank0.data"), ("offset", "0"), ("length", str(64 * 128 * 4))):
        e = t.external_data.add()
        e.key, e.value = key, value
    lowered = lower_program(lazy)
    assert lowered.weights == ("w1",) and lowered.inputs == ("x",)
    assert str(lowered.mod["main"].params[-1].name) == PREFIX + "w1"
