"""``benchmarks/pipeline_kernels.py``'s helpers: the seeded feeds (only arguments, not constants)
and the grouping of kernel calls by class and layer key."""

from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper

from tests.bench_scripts import load

kernels = load("pipeline_kernels")


def test_feeds_skip_constants_and_keep_dtypes() -> None:
    """An input with an initializer is bound by the build: no feed for it; floats are seeded
    normals, integers zeros."""
    g = helper.make_graph([helper.make_node("Add", ["x", "w"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3]),
                           helper.make_tensor_value_info("w", TensorProto.FLOAT, [2, 3]),
                           helper.make_tensor_value_info("labels", TensorProto.INT64, [2])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])],
                          [helper.make_tensor("w", TensorProto.FLOAT, [2, 3], [0.0] * 6)])
    feeds = kernels.feeds_for(helper.make_model(g))
    assert sorted(feeds) == ["labels", "x"]
    assert feeds["x"].dtype == np.float32 and feeds["x"].shape == (2, 3) and np.abs(feeds["x"]).max() > 0
    assert feeds["labels"].dtype == np.int64 and not feeds["labels"].any()
    np.testing.assert_array_equal(kernels.feeds_for(helper.make_model(g))["x"], feeds["x"])  # seeded


def test_calls_group_by_layer_key_or_name_without_suffix() -> None:
    """Two calls of one conv layer add up under its key; an unclassified kernel is keyed by its
    name without the trailing number; a symbol without info is ``other``."""
    infos = {"conv2d_a1": {"class": "conv3x3", "layer": "conv3x3 64->64 @16x16"},
             "fused_add12": {"class": "other", "layer": None}}
    calls = [("conv2d_a1", 1.0), ("conv2d_a1", 2.0), ("fused_add12", 0.5), ("vm.builtin.alloc_tensor", 0.25)]
    out = kernels.per_key(calls, infos)
    assert out == {"conv3x3   conv3x3 64->64 @16x16": 3.0, "other     fused_add": 0.5,
                   "other     vm.builtin.alloc_tensor": 0.25}
