"""Fixtures for the pass tests."""

from __future__ import annotations

import onnx
import pytest
from passes_testkit import LIGHT_DIR


@pytest.fixture
def light_squeezenet() -> onnx.ModelProto:
    path = LIGHT_DIR / "light_squeezenet.onnx"
    if not path.exists():
        pytest.skip(f"{path} is not shipped with this onnx build")
    return onnx.load(str(path))
