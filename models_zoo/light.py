"""The nine real architectures that the onnx package ships for its backend tests.

They live in ``<onnx package>/backend/test/data/light/light_<arch>.onnx`` (ResNet-50, VGG-19,
DenseNet-121, Inception v1/v2, ShuffleNet, SqueezeNet, AlexNet, ZFNet-512). Their weights are
``ConstantOfShape`` nodes (so the files are tiny), their opset is 9, and their batch is fixed
to 1. A model loads by its file stem (``light_resnet50``).

Weights. Every shipped weight is the constant 0.02, so every class score is equal and the softmax
output is exactly 1/1000 whatever the computation: a check against ONNX Runtime on the shipped
file proves little. By default (``weights="random"``) the loader therefore replaces each
``ConstantOfShape`` weight with an initializer of seeded random values (``seed``, default 0) in
the range its role needs (:func:`_random_weight`): He-normal Conv weights, 1/sqrt(fan-in) Gemm
weights, small biases and shifts, scales near 1 and positive BatchNormalization variances. Same
graph, same ops, same shapes, same seed -> same bytes; then the classifier's weight is scaled so
the logits have unit spread on a seeded input (:func:`_calibrate_classifier`). ``weights="as_shipped"`` returns the file
exactly as ``onnx.load`` gives it.
"""

from __future__ import annotations

import os
from functools import cache
from pathlib import Path

import numpy as np
import onnx
from google.protobuf.message import DecodeError
from onnx import numpy_helper

from partitioner.core.errors import ModelLoadError, UsageError

PREFIX = "light_"
LIGHT_BATCH = 1
WEIGHTS = ("random", "as_shipped")

_DESCRIPTIONS = {
    "light_bvlc_alexnet": "AlexNet (BVLC), real architecture from onnx's test data",
    "light_densenet121": "DenseNet-121, real architecture from onnx's test data",
    "light_inception_v1": "Inception v1 (GoogLeNet), real architecture from onnx's test data",
    "light_inception_v2": "Inception v2, real architecture from onnx's test data",
    "light_resnet50": "ResNet-50, real architecture from onnx's test data",
    "light_shufflenet": "ShuffleNet, real architecture from onnx's test data",
    "light_squeezenet": "SqueezeNet, real architecture from onnx's test data",
    "light_vgg19": "VGG-19, real architecture from onnx's test data",
    "light_zfnet512": "ZFNet-512, real architecture from onnx's test data",
}


def light_dir() -> Path:
    """The folder of the ``light_*.onnx`` files inside the installed onnx package."""
    return Path(os.path.dirname(onnx.__file__)) / "backend" / "test" / "data" / "light"


@cache
def light_names() -> tuple[str, ...]:
    """The stems of the ``light_*.onnx`` files on disk, sorted."""
    folder = light_dir()
    if not folder.is_dir():
        return ()
    return tuple(sorted(p.stem for p in folder.glob(f"{PREFIX}*.onnx")))


def describe(name: str) -> str:
    """A one-line description of a light model."""
    return _DESCRIPTIONS.get(name, f"{name[len(PREFIX):]}, real architecture from onnx's test data")


def load_light(name: str, batch: int | None = None, weights: str = "random", seed: int = 0) -> onnx.ModelProto:
    """Load ``<name>.onnx`` from :func:`light_dir`; ``batch`` must be None or 1.

    ``weights="random"`` (the default) fills the 0.02 constant weights with seeded random values
    (see the module docstring); ``"as_shipped"`` returns the file unchanged.
    """
    if name not in light_names():
        raise UsageError(f"{name!r} is not one of the onnx light models: {', '.join(light_names())}")
    if batch is not None and batch != LIGHT_BATCH:
        raise UsageError(f"{name}: the batch of this real model is fixed to {LIGHT_BATCH}, "
                         f"got batch={batch}; "
                         "use a builder model (e.g. resnet50) for other batches")
    if weights not in WEIGHTS:
        raise UsageError(f"{name}: weights must be one of {', '.join(WEIGHTS)}, got {weights!r}")
    path = light_dir() / f"{name}.onnx"
    try:
        model = onnx.load(str(path))
    except (OSError, ValueError, DecodeError) as exc:
        raise ModelLoadError(f"{path}: cannot load the onnx light model ({exc}); reinstall onnx") from exc
    return randomize_constant_weights(model, seed) if weights == "random" else model


def _random_weight(rng: np.random.Generator, shape: tuple[int, ...], role: tuple[str, int]) -> np.ndarray:
    """Seeded values for one weight, by its first consumer ``(op_type, input index)``.

    Rules (chosen so 50+ layers keep activations finite and the classes distinguishable):
    1. Conv weight: He-normal, std sqrt(2 / fan_in), fan_in = C/g * kh * kw.
    2. Gemm / MatMul weight (also through a Reshape): normal, std sqrt(1 / fan_in), fan_in = the
       smaller dimension (Gemm's transB is not read: both layouts get the same scale).
    3. BatchNormalization scale and a Mul scale: uniform [0.8, 1.2]; variance: uniform [0.5, 1.5]
       (positive, so the square root is real).
    4. Anything else (biases, BN bias and mean, an Add shift): normal, std 0.1.
    """
    op, index = role
    if op == "Conv" and index == 1:
        fan_in = int(np.prod(shape[1:])) or 1
        return rng.standard_normal(shape, dtype=np.float32) * np.float32(np.sqrt(2.0 / fan_in))
    if op in ("Gemm", "MatMul") and index == 1 and len(shape) == 2:
        return rng.standard_normal(shape, dtype=np.float32) * np.float32(np.sqrt(1.0 / max(1, min(shape))))
    if (op == "BatchNormalization" and index == 1) or op == "Mul":
        return rng.uniform(0.8, 1.2, shape)
    if op == "BatchNormalization" and index == 4:
        return rng.uniform(0.5, 1.5, shape)
    return rng.standard_normal(shape, dtype=np.float32) * np.float32(0.1)


def randomize_constant_weights(model: onnx.ModelProto, seed: int = 0) -> onnx.ModelProto:
    """In place: replace every float ``ConstantOfShape`` whose shape is an initializer with an initializer of
    seeded random values (rules in :func:`_random_weight`); drop the shape initializers no longer
    used, and return ``model``. Node order and every other node are kept; IR v3 graphs also list the new initializers
    as graph inputs (that IR version requires it)."""
    g = model.graph
    inits = {t.name: t for t in g.initializer}
    consumers: dict[str, list[tuple[str, int, str]]] = {}
    for node in g.node:
        for i, name in enumerate(node.input):
            consumers.setdefault(name, []).append((node.op_type, i, node.output[0] if node.output else ""))

    def role(value: str) -> tuple[str, int]:
        op, index, out = consumers.get(value, [("", 0, "")])[0]
        if op in ("Unsqueeze", "Reshape") and index == 0:  # a reshaped weight: its user decides
            op, index, _ = consumers.get(out, [(op, index, "")])[0]
        return op, index

    rng = np.random.default_rng(seed)
    keep, new_inits, replaced_shapes = [], [], set()
    for node in g.node:
        value = next((a.t for a in node.attribute if a.name == "value"), None)
        if (node.op_type == "ConstantOfShape" and node.input and node.input[0] in inits and value is not None
                and value.data_type == onnx.TensorProto.FLOAT):
            shape = tuple(int(d) for d in numpy_helper.to_array(inits[node.input[0]]))
            data = _random_weight(rng, shape, role(node.output[0])).astype(np.float32, copy=False)
            new_inits.append(numpy_helper.from_array(data, node.output[0]))
            replaced_shapes.add(node.input[0])
            continue
        keep.append(node)
    still_used = {name for node in keep for name in node.input} | {o.name for o in g.output}
    dropped = replaced_shapes - still_used
    # edited in place (the caller's model was just loaded): copying ~550 MB of VGG weights costs seconds
    del g.node[:]
    g.node.extend(keep)
    for i in reversed([i for i, t in enumerate(g.initializer) if t.name in dropped]):
        del g.initializer[i]
    g.initializer.extend(new_inits)
    if model.ir_version < 4:
        for i in reversed([i for i, v in enumerate(g.input) if v.name in dropped]):
            del g.input[i]
        g.input.extend(onnx.helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)) for t in new_inits)
    _calibrate_classifier(model, {t.name for t in new_inits}, seed)
    return model


def _calibrate_classifier(model: onnx.ModelProto, generated: set[str], seed: int) -> None:
    """Scale the last Gemm/MatMul weight so its output (the logits) has standard deviation 1 on a
    seeded standard-normal input, in place.

    Why: random weights in 50 layers with residual sums leave the features at a scale no rule can
    know in advance (ResNet-50's reach ~60); logits that large make the softmax one-hot, and a
    one-hot output checks little. One ONNX Runtime run of the model measures the scale instead.
    """
    g = model.graph
    producers = {o: n for n in g.node for o in n.output}

    def weight_of(node: onnx.NodeProto) -> str:  # the generated initializer, also through a Reshape
        name = node.input[1] if len(node.input) > 1 else ""
        while name not in generated and name in producers and producers[name].op_type in ("Reshape", "Unsqueeze"):
            name = producers[name].input[0]
        return name if name in generated else ""

    last = next((n for n in reversed(g.node) if n.op_type in ("Gemm", "MatMul") and weight_of(n)), None)
    if last is None:
        return
    weight = weight_of(last)
    import onnxruntime as ort

    outputs = list(g.output)  # probe the logits: swap the outputs for one serialisation, no copy
    del g.output[:]
    g.output.append(onnx.helper.make_empty_tensor_value_info(last.output[0]))
    probe = model.SerializeToString()
    del g.output[:]
    g.output.extend(outputs)
    inits = {t.name for t in g.initializer}
    rng = np.random.default_rng(seed)
    feeds = {i.name: rng.standard_normal([d.dim_value for d in i.type.tensor_type.shape.dim]).astype(np.float32)
             for i in g.input if i.name not in inits}
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    sess = ort.InferenceSession(probe, opts, providers=["CPUExecutionProvider"])
    std = float(np.std(sess.run(None, feeds)[0]))
    if not np.isfinite(std) or std <= 0:
        return
    for i, t in enumerate(g.initializer):
        if t.name == weight:
            g.initializer[i].CopyFrom(numpy_helper.from_array(numpy_helper.to_array(t) / np.float32(std), t.name))
