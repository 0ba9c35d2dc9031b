"""Tests for the model zoo (models_zoo/) and the ``partitioner zoo`` command.

Numbers are checked against ONNX Runtime with seeded inputs, and ONNX Runtime against
independent numpy implementations of what each builder's docstring says it builds (MLP,
transformer blocks), at float32 tolerances (rtol 1e-4). Structure is checked against counts
known from the papers (ResNet-18 has 20 convolutions, ResNet-50 53, MobileNetV2 52).
"""

from __future__ import annotations

import json
import time

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import numpy_helper
from scipy.special import erf

import models_zoo
from models_zoo import ZooEntry, build, is_zoo_name, list_models
from models_zoo.light import light_dir
from partitioner.cli import main
from partitioner.core.errors import UsageError

#: Every builder at a small size (fast to build and to run).
SMALL: dict[str, dict] = {
    "mlp": dict(batch=2, layers=3, hidden=32, in_features=16, out_features=5),
    "resnet": dict(batch=2, depth=18, image=32, width=8, classes=7),
    "resnet50": dict(batch=1, image=32, width=8, classes=7),
    "bert": dict(batch=2, seq=8, hidden=32, heads=4, layers=2, vocab=50),
    "gpt": dict(batch=2, seq=8, hidden=32, heads=4, layers=2, vocab=50),
    "unet": dict(batch=1, image=32, base=4, levels=3),
    "inception": dict(batch=2, image=32, blocks=3, classes=6),
    "mobilenet": dict(batch=1, image=32, width_mult=0.25, classes=6),
}
#: The output shape each small model must produce.
EXPECTED_OUTPUT: dict[str, tuple[int, ...]] = {
    "mlp": (2, 5), "resnet": (2, 7), "resnet50": (1, 7), "bert": (2, 8, 32), "gpt": (2, 8, 50),
    "unet": (1, 2, 32, 32), "inception": (2, 6), "mobilenet": (1, 6),
}
LIGHT = ["light_bvlc_alexnet", "light_densenet121", "light_inception_v1", "light_inception_v2",
         "light_resnet50", "light_shufflenet", "light_squeezenet", "light_vgg19", "light_zfnet512"]


def _session(model: onnx.ModelProto) -> ort.InferenceSession:
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])


def _feeds(model: onnx.ModelProto, seed: int = 0, vocab: int = 50, batch: int = 1) -> dict[str, np.ndarray]:
    """Seeded inputs: ints in [0, vocab) for int64 inputs, N(0, 1) floats otherwise."""
    rng = np.random.default_rng(seed)
    inits = {t.name for t in model.graph.initializer}
    feeds = {}
    for x in model.graph.input:
        if x.name in inits:
            continue
        tt = x.type.tensor_type
        shape = tuple(d.dim_value if d.HasField("dim_value") else batch for d in tt.shape.dim)
        if tt.elem_type == onnx.TensorProto.INT64:
            feeds[x.name] = rng.integers(0, vocab, shape).astype(np.int64)
        else:
            feeds[x.name] = rng.standard_normal(shape).astype(np.float32)
    return feeds


def _weights(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    return {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}


@pytest.fixture(scope="module")
def small_models() -> dict[str, onnx.ModelProto]:
    return {name: build(name, **kw) for name, kw in SMALL.items()}


# -- every builder -------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(SMALL))
def test_builder_checks_and_has_static_shapes(name: str, small_models: dict[str, onnx.ModelProto]) -> None:
    model = small_models[name]
    onnx.checker.check_model(model, full_check=True)
    assert model.graph.name == name
    assert model.producer_name == "partitioner.models_zoo"
    assert [(o.domain, o.version) for o in model.opset_import] == [("", 18)]
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True)
    values = [*inferred.graph.input, *inferred.graph.value_info, *inferred.graph.output]
    produced = {o for n in model.graph.node for o in n.output}
    assert produced <= {v.name for v in values}, "some node output has no inferred type"
    for v in values:
        dims = v.type.tensor_type.shape.dim
        static = all(d.HasField("dim_value") and d.dim_value > 0 for d in dims)
        assert static, f"{name}: {v.name} is not static"


@pytest.mark.parametrize("name", list(SMALL))
def test_builder_names_are_unique_and_readable(name: str, small_models: dict[str, onnx.ModelProto]) -> None:
    model = small_models[name]
    names = [n.name for n in model.graph.node]
    assert all(names) and len(set(names)) == len(names)
    values = [o for n in model.graph.node for o in n.output] + [t.name for t in model.graph.initializer]
    assert len(set(values)) == len(values)
    assert all(" " not in n for n in names)


@pytest.mark.parametrize("name", list(SMALL))
def test_builder_runs_in_onnxruntime_with_unit_scale_outputs(
        name: str, small_models: dict[str, onnx.ModelProto]) -> None:
    model = small_models[name]
    (out,) = _session(model).run(None, _feeds(model))
    assert out.shape == EXPECTED_OUTPUT[name]
    assert out.dtype == np.float32
    assert np.isfinite(out).all()
    # Activations stay O(1): neither vanishing nor exploding through the network.
    assert 1e-2 < float(out.std()) < 1e2, f"{name}: output std {out.std()}"


@pytest.mark.parametrize("name", list(SMALL))
def test_builder_is_deterministic_and_seeded(name: str, small_models: dict[str, onnx.ModelProto]) -> None:
    again = build(name, **SMALL[name])
    assert again.SerializeToString() == small_models[name].SerializeToString()
    other = build(name, **SMALL[name], seed=1)
    assert other.SerializeToString() != again.SerializeToString()
    assert [n.name for n in other.graph.node] == [n.name for n in again.graph.node]


# -- numbers against independent numpy implementations ------------------------------------------


def test_mlp_matches_numpy(small_models: dict[str, onnx.ModelProto]) -> None:
    model = small_models["mlp"]
    ops = [n.op_type for n in model.graph.node]
    assert "MatMul" in ops and "Gemm" in ops
    assert all(n.attribute[0].i == 1 for n in model.graph.node if n.op_type == "Gemm")  # transB=1
    w = _weights(model)
    feeds = _feeds(model)
    x = feeds["input"].astype(np.float64)
    for i in range(SMALL["mlp"]["layers"]):
        wt = w[f"fc{i}.weight"].astype(np.float64)
        x = np.maximum((x @ wt if i % 2 == 0 else x @ wt.T) + w[f"fc{i}.bias"], 0.0)
    ref = x @ w["head.weight"].T.astype(np.float64) + w["head.bias"]
    (out,) = _session(model).run(None, feeds)
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-5)


def _layer_norm(x: np.ndarray, scale: np.ndarray, bias: np.ndarray) -> np.ndarray:
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + 1e-5) * scale + bias


def _transformer_numpy(w: dict[str, np.ndarray], ids: np.ndarray, *, heads: int, layers: int,
                       causal: bool) -> np.ndarray:
    """Pre-LN transformer, written from the textbook definition, in float64."""
    w = {k: v.astype(np.float64) for k, v in w.items()}
    b, s = ids.shape
    x = w["embeddings.token.weight"][ids] + w["embeddings.position.weight"]
    hidden = x.shape[-1]
    dh = hidden // heads
    for i in range(layers):
        p = f"layer{i}"
        h = _layer_norm(x, w[f"{p}.ln1.weight"], w[f"{p}.ln1.bias"])

        def proj(name: str, inp: np.ndarray, p: str = p) -> np.ndarray:
            return inp @ w[f"{p}.{name}.weight"] + w[f"{p}.{name}.bias"]

        q, k, v = (proj(f"attn.{n}_proj", h).reshape(b, s, heads, dh).transpose(0, 2, 1, 3) for n in "qkv")
        scores = q @ k.transpose(0, 1, 3, 2) / np.sqrt(dh)
        if causal:
            scores = np.where(np.triu(np.ones((s, s), bool), 1), -np.inf, scores)
        scores = np.exp(scores - scores.max(-1, keepdims=True))
        att = scores / scores.sum(-1, keepdims=True)
        ctx = (att @ v).transpose(0, 2, 1, 3).reshape(b, s, hidden)
        x = x + proj("attn.out_proj", ctx)
        h = _layer_norm(x, w[f"{p}.ln2.weight"], w[f"{p}.ln2.bias"])
        m = proj("mlp.fc1", h)
        m = 0.5 * m * (1.0 + erf(m / np.sqrt(2.0)))
        x = x + proj("mlp.fc2", m)
    return _layer_norm(x, w["final_ln.weight"], w["final_ln.bias"])


def test_bert_matches_numpy(small_models: dict[str, onnx.ModelProto]) -> None:
    model = small_models["bert"]
    feeds = _feeds(model, vocab=SMALL["bert"]["vocab"])
    (out,) = _session(model).run(None, feeds)
    ref = _transformer_numpy(_weights(model), feeds["input_ids"], heads=4, layers=2, causal=False)
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-4)


def test_gpt_matches_numpy(small_models: dict[str, onnx.ModelProto]) -> None:
    model = small_models["gpt"]
    feeds = _feeds(model, vocab=SMALL["gpt"]["vocab"])
    (out,) = _session(model).run(None, feeds)
    w = _weights(model)
    ref = _transformer_numpy(w, feeds["input_ids"], heads=4, layers=2, causal=True) @ w["lm_head.weight"]
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-4)


def test_gpt_is_causal_and_bert_is_not(small_models: dict[str, onnx.ModelProto]) -> None:
    t = 5
    for name, causal in (("gpt", True), ("bert", False)):
        model = small_models[name]
        sess = _session(model)
        feeds = _feeds(model, vocab=50)
        (before,) = sess.run(None, feeds)
        ids = feeds["input_ids"].copy()
        ids[:, t] = (ids[:, t] + 1) % 50
        (after,) = sess.run(None, {"input_ids": ids})
        assert not np.allclose(before[:, t:], after[:, t:], atol=1e-3)
        assert np.allclose(before[:, :t], after[:, :t], atol=1e-6) == causal, name


def test_transformer_uses_the_erf_gelu_and_head_layout(small_models: dict[str, onnx.ModelProto]) -> None:
    ops = [n.op_type for n in small_models["bert"].graph.node]
    for op in ("Gather", "LayerNormalization", "Reshape", "Transpose", "Softmax", "Erf", "Div"):
        assert op in ops
    assert ops.count("Erf") == SMALL["bert"]["layers"]
    assert ops.count("Softmax") == SMALL["bert"]["layers"]
    softmax = [n for n in small_models["gpt"].graph.node if n.op_type == "Softmax"]
    assert all(a.i == -1 for n in softmax for a in n.attribute if a.name == "axis")


# -- structure known from the papers -------------------------------------------------------------


@pytest.mark.parametrize(("name", "kwargs", "convs"), [
    ("resnet", dict(depth=18), 20), ("resnet", dict(depth=34), 36),
    ("resnet50", {}, 53), ("resnet", dict(depth=101), 104),
])
def test_resnet_conv_counts(name: str, kwargs: dict, convs: int) -> None:
    model = build(name, image=32, width=4, classes=3, **kwargs)
    ops = [n.op_type for n in model.graph.node]
    assert ops.count("Conv") == convs
    assert ops.count("BatchNormalization") == convs
    assert ops.count("MaxPool") == 1 and ops.count("GlobalAveragePool") == 1 and ops.count("Gemm") == 1
    blocks = {18: 8, 34: 16, 50: 16, 101: 33}[kwargs.get("depth", 50)]
    assert ops.count("Add") == blocks


def test_resnet50_alias_is_resnet_depth50() -> None:
    a = build("resnet50", image=32, width=4, classes=3)
    b = build("resnet", depth=50, image=32, width=4, classes=3)
    assert a.graph.name == "resnet50" and b.graph.name == "resnet"
    assert [n.name for n in a.graph.node] == [n.name for n in b.graph.node]
    assert [t.raw_data for t in a.graph.initializer] == [t.raw_data for t in b.graph.initializer]
    with pytest.raises(UsageError, match="resnet"):
        build("resnet50", depth=18)


def test_mobilenet_structure() -> None:
    model = build("mobilenet", image=32, width_mult=1.0, classes=3)
    ops = [n.op_type for n in model.graph.node]
    assert ops.count("Conv") == 52  # torchvision's mobilenet_v2 has 52 convolutions
    assert ops.count("Add") == 10  # residual blocks of MobileNetV2 (Sandler et al., table 2)
    assert ops.count("Clip") == 35
    w = _weights(model)
    depthwise = [n for n in model.graph.node if n.op_type == "Conv" and n.name.endswith(".depthwise")]
    assert len(depthwise) == 17
    for n in depthwise:
        group = next(a.i for a in n.attribute if a.name == "group")
        assert group == w[n.input[1]].shape[0] > 1 and w[n.input[1]].shape[1] == 1
    clip = next(n for n in model.graph.node if n.op_type == "Clip")
    assert (float(w[clip.input[1]]), float(w[clip.input[2]])) == (0.0, 6.0)


def test_unet_and_inception_structure(small_models: dict[str, onnx.ModelProto]) -> None:
    ops = [n.op_type for n in small_models["unet"].graph.node]
    assert ops.count("Concat") == 3 and ops.count("MaxPool") == 3
    assert ops.count("ConvTranspose") == 2 and ops.count("Resize") == 1  # levels 0, 2 and level 1
    incep = small_models["inception"]
    concats = [n for n in incep.graph.node if n.op_type == "Concat"]
    assert len(concats) == 3 and all(len(n.input) == 4 for n in concats)


# -- gpt at scale and with a symbolic batch ------------------------------------------------------


def test_gpt_symbolic_batch() -> None:
    kw = dict(seq=8, hidden=32, heads=4, layers=2, vocab=50)
    model = build("gpt", symbolic_batch=True, **kw)
    onnx.checker.check_model(model, full_check=True)
    for v in (model.graph.input[0], model.graph.output[0]):
        dims = v.type.tensor_type.shape.dim
        assert dims[0].dim_param == "batch"
        assert all(d.HasField("dim_value") for d in dims[1:])
    feeds = _feeds(model, vocab=50, batch=3)
    (out,) = _session(model).run(None, feeds)
    assert out.shape == (3, 8, 50)
    static = build("gpt", batch=1, **kw)
    sess = _session(static)
    for row in range(3):
        (one,) = sess.run(None, {"input_ids": feeds["input_ids"][row:row + 1]})
        np.testing.assert_allclose(out[row:row + 1], one, rtol=1e-4, atol=1e-5)


def test_gpt_48_layers_builds_quickly() -> None:
    start = time.perf_counter()
    model = build("gpt", layers=48, seq=16, hidden=32, heads=4, vocab=100)
    elapsed = time.perf_counter() - start
    assert len(model.graph.node) > 1500
    assert elapsed < 15.0, f"48-layer gpt took {elapsed:.2f}s to build"
    assert sum(n.op_type == "Softmax" for n in model.graph.node) == 48


# -- light models --------------------------------------------------------------------------------


def test_light_models_are_listed_as_on_disk() -> None:
    on_disk = sorted(p.stem for p in light_dir().glob("light_*.onnx"))
    assert on_disk == LIGHT
    listed = [e.name for e in list_models() if e.kind == "light"]
    assert listed == LIGHT


@pytest.mark.parametrize("name", LIGHT)
def test_light_model_loads_by_name(name: str) -> None:
    model = build(name, weights="as_shipped")
    onnx.checker.check_model(model, full_check=True)
    assert model.SerializeToString() == onnx.load(str(light_dir() / f"{name}.onnx")).SerializeToString()
    assert any(n.op_type == "ConstantOfShape" for n in model.graph.node)
    assert build(name, batch=1, seed=None, weights="as_shipped").SerializeToString() == model.SerializeToString()


@pytest.mark.parametrize("name", ["light_squeezenet", "light_resnet50"])
def test_light_model_default_weights_are_seeded_random(name: str) -> None:
    """The shipped weights are all 0.02 (the softmax is then 1/1000 whatever runs); the loader's
    default replaces them with seeded random values: same seed same bytes, another seed other
    values, no ConstantOfShape weight left, and ONNX Runtime's output is finite and not flat."""
    import onnxruntime as ort

    model = build(name)
    onnx.checker.check_model(model, full_check=True)
    assert not any(n.op_type == "ConstantOfShape" for n in model.graph.node)
    weights = {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer if len(t.dims) == 4}
    assert len(weights) >= 10
    assert all(np.unique(w).size > 1 for w in weights.values())
    if name == "light_squeezenet":  # (cheap to load three times)
        assert build(name, seed=0).SerializeToString() == model.SerializeToString()
        some = next(iter(weights))
        assert not np.array_equal(weights[some], onnx.numpy_helper.to_array(
            next(t for t in build(name, seed=1).graph.initializer if t.name == some)))
    x = np.random.default_rng(3).standard_normal((1, 3, 224, 224)).astype(np.float32)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    y = sess.run(None, {sess.get_inputs()[0].name: x})[0].ravel()
    assert np.isfinite(y).all()
    assert y.std() > 1e-4 * max(1.0, float(np.abs(y).max()))  # classes differ
    assert y.max() < 0.9 if name == "light_resnet50" else True  # softmax not one-hot


def test_light_model_weights_option_is_checked() -> None:
    with pytest.raises(UsageError, match="weights"):
        build("light_squeezenet", weights="zeros")


def test_light_model_batch_is_fixed() -> None:
    with pytest.raises(UsageError, match="batch"):
        build("light_resnet50", batch=2)
    with pytest.raises(UsageError, match="layers"):
        build("light_resnet50", layers=2)


def test_light_squeezenet_runs_to_onnx_reference_output() -> None:
    model = build("light_squeezenet", weights="as_shipped")  # the reference output is for 0.02 weights
    inits = {t.name for t in model.graph.initializer}
    feeds = {}
    for x in model.graph.input:  # onnx's backend runner feeds arange(n) / n
        if x.name not in inits:
            shape = tuple(d.dim_value for d in x.type.tensor_type.shape.dim)
            n = int(np.prod(shape))
            feeds[x.name] = (np.arange(n).reshape(shape) / n).astype(np.float32)
    (out,) = _session(model).run(None, feeds)
    ref = numpy_helper.to_array(onnx.load_tensor(str(light_dir() / "light_squeezenet_output_0.pb")))
    np.testing.assert_allclose(out, ref, rtol=1e-3, atol=1e-7)


# -- API errors ----------------------------------------------------------------------------------


def test_list_models_and_is_zoo_name() -> None:
    entries = list_models()
    names = [e.name for e in entries]
    assert names[:8] == list(SMALL)
    assert all(isinstance(e, ZooEntry) and e.description for e in entries)
    gpt = next(e for e in entries if e.name == "gpt")
    assert gpt.kind == "builder"
    assert gpt.params["layers"] == 2 and gpt.params["symbolic_batch"] is False and gpt.params["batch"] == 1
    assert all(is_zoo_name(n) for n in names)
    assert not is_zoo_name("resnet19") and not is_zoo_name("model.onnx")


def test_unknown_name_lists_valid_names() -> None:
    with pytest.raises(UsageError, match="valid names: mlp, resnet") as info:
        build("resnet19")
    assert "light_vgg19" in str(info.value)


def test_unknown_argument_names_it_and_the_accepted_ones() -> None:
    with pytest.raises(UsageError, match="does not take hiden; it accepts: batch, layers, hidden"):
        build("mlp", hiden=3)


def test_none_arguments_are_ignored() -> None:
    a = build("mlp", batch=None, layers=None, hidden=8, in_features=4)
    b = build("mlp", hidden=8, in_features=4)
    assert a.SerializeToString() == b.SerializeToString()


@pytest.mark.parametrize(("name", "kwargs", "match"), [
    ("resnet", dict(depth=20), "depth must be one of"),
    ("bert", dict(hidden=30, heads=4), "divisible by heads"),
    ("mlp", dict(batch=0), "batch must be a positive integer"),
    ("unet", dict(image=36, levels=3), "divisible by 2\\*\\*levels"),
    ("mobilenet", dict(width_mult=-1.0), "width_mult"),
    ("gpt", dict(seed=-1), "seed"),
])
def test_bad_values_raise_usage_error(name: str, kwargs: dict, match: str) -> None:
    with pytest.raises(UsageError, match=match):
        build(name, **kwargs)


def test_public_constants() -> None:
    assert models_zoo.OPSET == 18
    assert models_zoo.PRODUCER_NAME == "partitioner.models_zoo"


# -- CLI -----------------------------------------------------------------------------------------


def test_cli_zoo_list(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["zoo", "list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["NAME", "KIND", "DESCRIPTION"]
    rows = {line.split()[0]: line.split()[1] for line in lines[1:]}
    assert rows["gpt"] == "builder" and rows["light_vgg19"] == "light"
    assert len(rows) == 9 + len(LIGHT)  # 8 builders of SMALL and llama (tests/test_zoo_llama.py)
    assert main(["zoo", "list", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [d["name"] for d in data] == [e.name for e in list_models()]
    assert data[0]["params"]["hidden"] == 256


def test_cli_zoo_export(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "gpt.onnx"
    rc = main(["zoo", "export", "gpt", "-o", str(path), "--layers", "1", "--seq", "8", "--hidden", "16",
               "--heads", "2", "--batch", "3", "--seed", "4"])
    assert rc == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and str(path) in out[0] and out[0].startswith("wrote gpt")
    model = onnx.load(str(path))
    assert model.SerializeToString() == build("gpt", layers=1, seq=8, hidden=16, heads=2, batch=3,
                                              seed=4).SerializeToString()
    (logits,) = _session(model).run(None, _feeds(model, vocab=1000))
    assert logits.shape == (3, 8, 1000)


def test_cli_zoo_export_light_and_errors(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "sq.onnx"
    assert main(["zoo", "export", "light_squeezenet", "-o", str(path), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["name"] == "light_squeezenet" and report["bytes"] == path.stat().st_size
    assert main(["zoo", "export", "nosuch", "-o", str(tmp_path / "x.onnx")]) == 2
    assert "valid names" in capsys.readouterr().err
    assert main(["zoo", "export", "light_vgg19", "--batch", "2", "-o", str(tmp_path / "x.onnx")]) == 2
    assert "batch" in capsys.readouterr().err
    assert main(["zoo", "export", "mlp", "--seq", "4", "-o", str(tmp_path / "x.onnx")]) == 2
    assert "seq" in capsys.readouterr().err
    assert main(["zoo", "export", "mlp", "--weights", "as_shipped", "-o", str(tmp_path / "x.onnx")]) == 2
    assert "weights" in capsys.readouterr().err
    assert not (tmp_path / "x.onnx").exists()
    shipped = tmp_path / "sq_shipped.onnx"
    assert main(["zoo", "export", "light_squeezenet", "--weights", "as_shipped", "-o", str(shipped)]) == 0
    assert shipped.read_bytes() == (light_dir() / "light_squeezenet.onnx").read_bytes() or \
        onnx.load(shipped).SerializeToString() == onnx.load(light_dir() / "light_squeezenet.onnx").SerializeToString()
    assert not any(n.op_type == "ConstantOfShape" for n in onnx.load(path).graph.node)  # the default: random


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SMALL))
def test_builder_at_default_size_runs(name: str) -> None:
    model = build(name)
    onnx.checker.check_model(model, full_check=True)
    (out,) = _session(model).run(None, _feeds(model, vocab=1000))
    assert np.isfinite(out).all() and 1e-2 < float(out.std()) < 1e2
