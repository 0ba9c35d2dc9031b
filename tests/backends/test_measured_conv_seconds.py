"""A built TVM rank's convs priced at the seconds its build measured (``conv_algorithms`` rule 6,
``bench`` rule 9): the ONNX conv maps to the build's cache key, only chosen convs with cached
seconds are priced so, and the simulator puts exactly those seconds in place of the roofline's."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from backends.tvm.conv_algorithms import measured_conv_seconds


def _program() -> onnx.ModelProto:
    """x [2, 16, 10, 12] -> 3x3 conv (pads 1, 32 out) -> 1x1 conv (8 out) -> y."""
    rng = np.random.default_rng(0)
    g = helper.make_graph(
        [helper.make_node("Conv", ["x", "w1"], ["h"], name="c3", pads=[1, 1, 1, 1], kernel_shape=[3, 3]),
         helper.make_node("Conv", ["h", "w2"], ["y"], name="c1")],
        "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 16, 10, 12])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 8, 10, 12])],
        initializer=[numpy_helper.from_array(rng.standard_normal((32, 16, 3, 3)).astype(np.float32), "w1"),
                     numpy_helper.from_array(rng.standard_normal((8, 32, 1, 1)).astype(np.float32), "w2")])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


# the key the TVM build gives c3 after ConvertLayout (NHWC input, HWIO weight), 1-thread build
KEY = json.dumps([[2, 10, 12, 16], [3, 3, 16, 32], [1, 1], [1, 1], [1, 1, 1, 1], {"threads": 1}])


def _cache(tmp_path, entry) -> object:
    path = tmp_path / "conv_algorithms.json"
    path.write_text(json.dumps({KEY: entry}))
    return path


def test_a_chosen_conv_gets_its_cached_seconds(tmp_path) -> None:
    cache = _cache(tmp_path, {"fastest": "winograd", "seconds": {"direct": 3e-4, "winograd": 2e-4}})
    choices = [{"conv": KEY, "algorithm": "winograd", "from": "measured"}]
    assert measured_conv_seconds(_program(), choices, cache) == {"c3": 2e-4}
    # the build's choice decides which seconds (a cached "fastest" that the build did not take is not used)
    direct = [{"conv": KEY, "algorithm": "direct", "from": "cache"}]
    assert measured_conv_seconds(_program(), direct, cache) == {"c3": 3e-4}


def test_convs_without_a_choice_or_a_cached_time_keep_the_cost_model(tmp_path) -> None:
    cache = _cache(tmp_path, {"fastest": "direct", "seconds": {"direct": 3e-4}})
    assert measured_conv_seconds(_program(), [], cache) == {}  # a direct build records no choices
    other_threads = KEY.replace('{"threads": 1}', '{"threads": null}')
    assert measured_conv_seconds(_program(), [{"conv": other_threads, "algorithm": "direct"}], cache) == {}
    no_seconds = _cache(tmp_path, {"fastest": "direct"})
    assert measured_conv_seconds(_program(), [{"conv": KEY, "algorithm": "direct"}], no_seconds) == {}


def test_the_simulator_prices_the_named_node_at_its_measured_seconds() -> None:
    """The step with c3 at 1 ms minus the step without: exactly 1 ms minus c3's roofline price."""
    import onnx_ir as ir

    from partitioner.cluster import cpu_cluster
    from partitioner.cost.ops import op_class
    from partitioner.cost.roofline import fused_nodes, op_time
    from partitioner.cost.simulate import simulate
    from partitioner.cost.workdepth import constant_values, node_costs

    model = ir.serde.deserialize_model(onnx.shape_inference.infer_shapes(_program()))
    cl = cpu_cluster(1)
    base = simulate([model], cl).step_latency
    timed = simulate([model], cl, node_seconds=[{"c3": 1e-3}]).step_latency
    g = model.graph
    c3 = next(i for i, n in enumerate(g) if n.name == "c3")
    roof = op_time(node_costs(g, constant_values(g))[c3], cl.devices[0], "float32", op_class(list(g)[c3]),
                   list(g)[c3] in fused_nodes(g))
    assert timed - base == pytest.approx(1e-3 - roof, rel=1e-9, abs=1e-12)
