"""The nine real architectures that the onnx package ships for its backend tests.

They live in ``<onnx package>/backend/test/data/light/light_<arch>.onnx`` (ResNet-50, VGG-19,
DenseNet-121, Inception v1/v2, ShuffleNet, SqueezeNet, AlexNet, ZFNet-512). Their weights are
``ConstantOfShape`` nodes (so the files are tiny), their opset is 9, and their batch is fixed
to 1. A model loads by its file stem (``light_resnet50``) and is returned as ``onnx.load``
gives it: no rewriting.
"""

from __future__ import annotations

import os
from functools import cache
from pathlib import Path

import onnx
from google.protobuf.message import DecodeError

from partitioner.core.errors import ModelLoadError, UsageError

PREFIX = "light_"
LIGHT_BATCH = 1

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


def load_light(name: str, batch: int | None = None) -> onnx.ModelProto:
    """Load ``<name>.onnx`` from :func:`light_dir`; ``batch`` must be None or 1."""
    if name not in light_names():
        raise UsageError(f"{name!r} is not one of the onnx light models: {', '.join(light_names())}")
    if batch is not None and batch != LIGHT_BATCH:
        raise UsageError(f"{name}: the batch of this real model is fixed to {LIGHT_BATCH}, "
                         f"got batch={batch}; "
                         "use a builder model (e.g. resnet50) for other batches")
    path = light_dir() / f"{name}.onnx"
    try:
        return onnx.load(str(path))
    except (OSError, ValueError, DecodeError) as exc:
        raise ModelLoadError(f"{path}: cannot load the onnx light model ({exc}); reinstall onnx") from exc
