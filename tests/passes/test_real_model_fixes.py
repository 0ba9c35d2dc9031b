"""The classes of failure real third-party models hit (issue 12), each on a small hand-built graph.

1. legacy ``dim_value: -1`` inputs; 2. shape subgraphs that fold only after repeated inference;
3. ``If`` on an input scalar (``--const``); 5. exporter-named symbolic intermediate dims. Every
transformed graph is checked against ONNX Runtime on the original model with seeded inputs.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto as T
from onnx import helper as h
from onnx import numpy_helper as nh

from partitioner.core.errors import ModelLoadError, PassError
from partitioner.load import load
from passes import run_pipeline


def _model(nodes, inputs, outputs, inits=(), opset=17) -> onnx.ModelProto:
    m = h.make_model(h.make_graph(nodes, "g", inputs, outputs, list(inits)),
                     opset_imports=[h.make_opsetid("", opset)])
    m.ir_version = 8
    return m


def _ort(model: onnx.ModelProto, feeds: dict) -> list[np.ndarray]:
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


def _check_against_ort(original: onnx.ModelProto, prepared: ir.Model, feeds: dict, const_feeds: dict | None = None):
    want = _ort(original, {**feeds, **(const_feeds or {})})
    got = _ort(ir.serde.serialize_model(prepared), feeds)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.shape == w.shape
        np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6)


# 1. legacy -1 dims ---------------------------------------------------------------------------

def _neg1_model() -> onnx.ModelProto:
    return _model([h.make_node("Relu", ["x"], ["y"])], [h.make_tensor_value_info("x", T.FLOAT, [-1, 3, -1, 4])],
                  [h.make_tensor_value_info("y", T.FLOAT, [-1, 3, -1, 4])])


def test_legacy_minus_one_dims_are_bindable_with_shape():
    m = _neg1_model()
    prepared = run_pipeline(load(m, shapes={"x": [2, 3, 5, 4]}))
    assert list(prepared.graph.inputs[0].shape) == [2, 3, 5, 4]
    x = np.random.default_rng(0).standard_normal((2, 3, 5, 4)).astype(np.float32)
    _check_against_ort(m, prepared, {"x": x})


def test_legacy_minus_one_dims_are_all_listed_when_unbound():
    with pytest.raises(ModelLoadError) as e:
        load(_neg1_model())
    msg = str(e.value)
    assert "2 input dimension(s) to bind" in msg and "axis 0" in msg and "axis 2" in msg
    assert "--shape x=D0,3,D2,4" in msg


def test_every_unbound_input_dimension_is_listed_in_one_message():
    m = _model([h.make_node("Add", ["a", "b"], ["y"])],
               [h.make_tensor_value_info("a", T.FLOAT, ["N", 4, "W"]), h.make_tensor_value_info("b", T.FLOAT, ["N", 4, "H"])],
               [h.make_tensor_value_info("y", T.FLOAT, ["N", 4, "W"])])
    with pytest.raises(ModelLoadError) as e:
        load(m)
    msg = str(e.value)
    for part in ("4 input dimension(s)", "'a'", "'b'", "'W' at axis 2", "'H' at axis 2", "--shape a=N,4,W", "--shape b=N,4,H"):
        assert part in msg, (part, msg)


# 2. shape subgraphs ----------------------------------------------------------------------------

def _two_level_shape_model() -> onnx.ModelProto:
    """Reshape targets computed from Shape through Div/Floor/Cast (ONNX data propagation stops at
    Div), and a second Reshape reading the Shape of the first one's output."""
    nodes = [
        h.make_node("Shape", ["x"], ["s"]), h.make_node("Gather", ["s", "i0"], ["n"], axis=0),
        h.make_node("Gather", ["s", "i2"], ["w"]), h.make_node("Mul", ["w", "three"], ["w3"]),
        h.make_node("Div", ["w3", "one"], ["w3d"]), h.make_node("Unsqueeze", ["n", "ax0"], ["nu"]),
        h.make_node("Unsqueeze", ["w3d", "ax0"], ["wu"]), h.make_node("Concat", ["nu", "wu"], ["tgt"], axis=0),
        h.make_node("Reshape", ["x", "tgt"], ["r"]), h.make_node("Shape", ["r"], ["s2"]),
        h.make_node("Slice", ["s2", "st", "en"], ["last"]), h.make_node("Cast", ["last"], ["lastf"], to=T.FLOAT),
        h.make_node("Div", ["lastf", "fthree"], ["q"]), h.make_node("Floor", ["q"], ["qf"]),
        h.make_node("Cast", ["qf"], ["qi"], to=T.INT64), h.make_node("Concat", ["m1", "qi"], ["tgt2"], axis=0),
        h.make_node("Reshape", ["r", "tgt2"], ["r2"]), h.make_node("Relu", ["r2"], ["y"]),
    ]
    i64 = lambda v, n: nh.from_array(np.array(v, np.int64), n)  # noqa: E731
    inits = [i64(0, "i0"), i64(2, "i2"), i64(3, "three"), i64(1, "one"), i64([0], "ax0"), i64([1], "st"),
             i64([2], "en"), nh.from_array(np.array(3, np.float32), "fthree"), i64([-1], "m1")]
    return _model(nodes, [h.make_tensor_value_info("x", T.FLOAT, ["N", 3, "W"])],
                  [h.make_tensor_value_info("y", T.FLOAT, ["a", "b"])], inits)


def test_shape_subgraphs_fold_to_a_fixed_point_after_binding():
    m = _two_level_shape_model()
    prepared = run_pipeline(load(m, shapes={"x": [2, 3, 5]}))
    assert [n.op_type for n in prepared.graph] == ["Reshape", "Reshape", "Relu"]
    assert list(prepared.graph.outputs[0].shape) == [6, 5]
    x = np.random.default_rng(1).standard_normal((2, 3, 5)).astype(np.float32)
    _check_against_ort(m, prepared, {"x": x})


def test_fold_shape_subgraphs_runs_before_the_pass_that_requires_static_shapes():
    from passes import DEFAULT_PIPELINE

    assert DEFAULT_PIPELINE.index("fold_shape_subgraphs") < len(DEFAULT_PIPELINE) - 1


# 3. If on an input scalar ----------------------------------------------------------------------

def _if_model(same_shapes: bool = False) -> onnx.ModelProto:
    """``y = x * 2`` reshaped to (1, -1) when sr == 16000, else ``x`` reshaped to (-1, 2): the
    branches give different shapes, so the If only compiles once ``sr`` is bound."""
    then_g = h.make_graph([h.make_node("Mul", ["x", "two"], ["t0"]), h.make_node("Reshape", ["t0", "shp_t"], ["t1"])],
                          "then", [], [h.make_tensor_value_info("t1", T.FLOAT, ["t0", "t1"])],
                          [nh.from_array(np.array(2, np.float32), "two"),
                           nh.from_array(np.array([1, -1] if not same_shapes else [-1, 2], np.int64), "shp_t")])
    else_g = h.make_graph([h.make_node("Reshape", ["x", "shp_e"], ["e1"])], "else", [],
                          [h.make_tensor_value_info("e1", T.FLOAT, ["e0", "e1"])],
                          [nh.from_array(np.array([-1, 2], np.int64), "shp_e")])
    nodes = [h.make_node("Equal", ["sr", "k16"], ["cond"]),
             h.make_node("If", ["cond"], ["b"], name="branch_on_sr", then_branch=then_g, else_branch=else_g),
             h.make_node("Relu", ["b"], ["y"])]
    return _model(nodes, [h.make_tensor_value_info("x", T.FLOAT, [2, 4]), h.make_tensor_value_info("sr", T.INT64, [])],
                  [h.make_tensor_value_info("y", T.FLOAT, ["y0", "y1"])], [nh.from_array(np.array(16000, np.int64), "k16")])


@pytest.mark.parametrize("sr", [16000, 8000])
def test_if_on_a_bound_input_folds_to_the_taken_branch(sr):
    m = _if_model()
    prepared = run_pipeline(load(m, constants={"sr": sr}))
    ops = [n.op_type for n in prepared.graph]
    assert "If" not in ops and [v.name for v in prepared.graph.inputs] == ["x"]
    x = np.random.default_rng(2).standard_normal((2, 4)).astype(np.float32)
    _check_against_ort(m, prepared, {"x": x}, {"sr": np.array(sr, np.int64)})


def test_if_that_stays_dynamic_is_refused_naming_the_node_and_the_input():
    with pytest.raises(PassError) as e:
        run_pipeline(load(_if_model()))
    msg = str(e.value)
    assert "branch_on_sr" in msg and "--const sr=VALUE" in msg


def test_if_that_stays_dynamic_with_equal_branch_shapes_stays_an_if():
    m = _if_model(same_shapes=True)
    prepared = run_pipeline(load(m))
    assert "If" in [n.op_type for n in prepared.graph]
    assert list(prepared.graph.outputs[0].shape) == [4, 2]
    x = np.random.default_rng(3).standard_normal((2, 4)).astype(np.float32)
    for sr in (16000, 1):
        _check_against_ort(m, prepared, {"x": x, "sr": np.array(sr, np.int64)})


def test_const_value_checks():
    m = _if_model()
    with pytest.raises(ModelLoadError, match="unknown input"):
        load(m, constants={"nope": 1})
    with pytest.raises(ModelLoadError, match="scalar"):
        load(m, constants={"sr": [1, 2]})


def test_cli_const_binds_an_input_and_json_reports_it(tmp_path):
    path = tmp_path / "if.onnx"
    onnx.save(_if_model(), path)
    cli = [sys.executable, "-m", "partitioner.cli"]
    ok = subprocess.run([*cli, "inspect", str(path), "--const", "sr=8000", "--json"], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    assert '"name": "sr"' not in ok.stdout and '"If"' not in ok.stdout
    bad = subprocess.run([*cli, "inspect", str(path), "--const", "sr=abc"], capture_output=True, text=True)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr and "--const" in bad.stderr
    refused = subprocess.run([*cli, "plan", str(path), "--json"], capture_output=True, text=True)
    assert refused.returncode == 2 and "branch_on_sr" in refused.stderr and "--const sr=VALUE" in refused.stderr



def test_inspect_lists_every_dimension_and_the_value_input_in_one_message(tmp_path):
    """Unbound dims of two inputs plus the scalar an If reads (silero-vad's shape): one line,
    exit 2, every ``--shape`` and the ``--const`` the next run would otherwise ask for. A float
    data input feeding the same condition is not named (its value is data, not a setting)."""
    m = _if_model()
    m.graph.input[0].type.tensor_type.shape.dim[0].dim_param = "N"
    m.graph.input.append(h.make_tensor_value_info("gain", T.FLOAT, ["G"]))
    m.graph.node[0].input[1] = "k16g"
    m.graph.node.insert(0, h.make_node("Cast", ["gain"], ["gi"], to=T.INT64))
    m.graph.node.insert(1, h.make_node("ReduceSum", ["gi"], ["gs"], keepdims=0))
    m.graph.node.insert(2, h.make_node("Add", ["k16", "gs"], ["k16g"]))
    path = tmp_path / "if_dims.onnx"
    onnx.save(m, path)
    r = subprocess.run([sys.executable, "-m", "partitioner.cli", "inspect", str(path)], capture_output=True, text=True)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    lines = [ln for ln in r.stderr.strip().splitlines() if "error" in ln]
    assert len(lines) == 1, r.stderr
    for part in ("2 input dimension(s)", "'x'", "'gain'", "--shape x=N,4", "--shape gain=G", "--const sr=VALUE"):
        assert part in lines[0], (part, lines[0])
    assert "--const gain" not in lines[0] and "--const x" not in lines[0]
    ok = subprocess.run([sys.executable, "-m", "partitioner.cli", "inspect", str(path), "--shape", "x=2,4",
                         "--const", "sr=8000", "--const", "gain=0"], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr


def test_reference_of_a_build_with_constants_keeps_the_input_with_its_value_as_default(tmp_path):
    """bind_inputs rule 6: ``run --check`` compares against ONNX Runtime on the model as given,
    with ``sr`` still an input defaulting to the bound value (ORT 1.32 segfaulted on silero-vad
    once the value was baked in and the input shapes bound)."""
    from partitioner.bind_inputs import reference_with_constant_defaults
    from partitioner.compiler import compile as compile_artifact, load_artifact

    m = _if_model()
    ref = reference_with_constant_defaults(m, {"sr": 8000})
    assert [i.name for i in ref.graph.input] == ["x", "sr"]
    assert nh.to_array(next(t for t in ref.graph.initializer if t.name == "sr")).tolist() == 8000
    art = compile_artifact(m, "cpu:1", backend="onnxruntime", out_dir=tmp_path / "art", progress=False,
                           constants={"sr": 8000})
    x = np.random.default_rng(4).standard_normal((2, 4)).astype(np.float32)
    res = load_artifact(art.root).run({"x": x}, check=True, in_process=True, timeout=300)
    assert res.check.ok, res.check
    want = _ort(m, {"x": x, "sr": np.array(8000, np.int64)})[0]
    np.testing.assert_allclose(res.outputs["y"], want, rtol=1e-6, atol=1e-6)
    assert want.shape == (4, 2)

# 5. symbolic intermediate dims -----------------------------------------------------------------

def test_exporter_named_intermediate_dims_are_propagated_from_the_bound_inputs():
    """tf2onnx writes ``unk__215``-style names on intermediates and branch outputs; once the inputs
    are bound they are recomputed, in subgraphs too."""
    then_g = h.make_graph([h.make_node("Relu", ["a"], ["t"])], "then", [],
                          [h.make_tensor_value_info("t", T.FLOAT, ["unk__215", 4])])
    else_g = h.make_graph([h.make_node("Neg", ["a"], ["e"])], "else", [],
                          [h.make_tensor_value_info("e", T.FLOAT, ["unk__216", 4])])
    nodes = [h.make_node("Sigmoid", ["x"], ["a"]),
             h.make_node("If", ["c"], ["b"], then_branch=then_g, else_branch=else_g),
             h.make_node("Relu", ["b"], ["y"])]
    m = _model(nodes, [h.make_tensor_value_info("x", T.FLOAT, ["N", 4]), h.make_tensor_value_info("c", T.BOOL, [])],
               [h.make_tensor_value_info("y", T.FLOAT, ["unk__217", 4])])
    m.graph.value_info.append(h.make_tensor_value_info("a", T.FLOAT, ["unk__214", 4]))
    prepared = run_pipeline(load(m, batch=3))
    assert list(prepared.graph.outputs[0].shape) == [3, 4]
    x = np.random.default_rng(4).standard_normal((3, 4)).astype(np.float32)
    _check_against_ort(m, prepared, {"x": x, "c": np.array(False)})


def test_data_dependent_intermediate_dims_name_the_input_to_bind():
    """A Reshape whose target is an input's *value*: the error says to bind that input."""
    nodes = [h.make_node("Concat", ["m1", "k"], ["tgt"], axis=0), h.make_node("Reshape", ["x", "tgt"], ["y"])]
    m = _model(nodes, [h.make_tensor_value_info("x", T.FLOAT, [2, 6]), h.make_tensor_value_info("k", T.INT64, [1])],
               [h.make_tensor_value_info("y", T.FLOAT, ["unk__1", "unk__2"])],
               [nh.from_array(np.array([-1], np.int64), "m1")])
    with pytest.raises(PassError) as e:
        run_pipeline(load(m))
    assert "--const k=VALUE" in str(e.value) and "'y'" in str(e.value)
    prepared = run_pipeline(load(m, constants={"k": [3]}))
    assert list(prepared.graph.outputs[0].shape) == [4, 3]
    x = np.random.default_rng(5).standard_normal((2, 6)).astype(np.float32)
    _check_against_ort(m, prepared, {"x": x}, {"k": np.array([3], np.int64)})


def _dynamic_if_reading_outer_values() -> onnx.ModelProto:
    """An If on a data-dependent condition (openwakeword's verifier head) whose branches read an
    outer weight and return an outer value as is: it stays an If."""
    then_g = h.make_graph([h.make_node("MatMul", ["a", "w"], ["t"])], "then", [],
                          [h.make_tensor_value_info("t", T.FLOAT, [2, 4])])
    else_g = h.make_graph([h.make_node("Identity", ["a"], ["e"])], "else", [],
                          [h.make_tensor_value_info("e", T.FLOAT, [2, 4])])  # identity_elimination drops it
    nodes = [h.make_node("Relu", ["x"], ["r"]), h.make_node("Sigmoid", ["r"], ["a"]),
             h.make_node("ReduceMax", ["a"], ["mx"], keepdims=0),
             h.make_node("Greater", ["mx", "half"], ["c"]),
             h.make_node("If", ["c"], ["b"], name="verifier", then_branch=then_g, else_branch=else_g),
             h.make_node("Add", ["b", "a"], ["y"])]
    rng = np.random.default_rng(6)
    return _model(nodes, [h.make_tensor_value_info("x", T.FLOAT, [2, 4])], [h.make_tensor_value_info("y", T.FLOAT, [2, 4])],
                  [nh.from_array(rng.standard_normal((4, 4)).astype(np.float32), "w"),
                   nh.from_array(np.array(0.7, np.float32), "half")])


@pytest.mark.parametrize("strategy", ["pipeline", "auto"])
def test_dynamic_if_reading_outer_values_runs_partitioned(strategy, tmp_path):
    from partitioner.compiler import compile as compile_artifact, load_artifact
    from partitioner.runtime.launch import run_in_process

    m = _dynamic_if_reading_outer_values()
    art = compile_artifact(m, "cpu:2", strategy=strategy, backend="onnxruntime", out_dir=tmp_path / "a", progress=False)
    for x in (np.full((2, 4), -3.0, np.float32), np.random.default_rng(7).standard_normal((2, 4)).astype(np.float32) + 2):
        got, _ = run_in_process(load_artifact(art.root), {"x": x}, timeout=120)
        np.testing.assert_allclose(got["y"], _ort(m, {"x": x})[0], rtol=1e-6, atol=1e-6)
