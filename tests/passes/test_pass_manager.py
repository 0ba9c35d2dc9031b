from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest
from onnx import helper
from passes_testkit import assert_same_outputs, check_model, const, make_model, op_types, tensor_info, to_ir

import passes
from partitioner.core.errors import PassError, UsageError, VerifyError
from passes import DEFAULT_PIPELINE, REGISTRY, PassManager, get_pass, run_pipeline
from passes.registry import register


class _Explodes(ir.passes.InPlacePass):
    name = "explodes"

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        raise ValueError("boom at node 'relu'")


class _BreaksOrder(ir.passes.InPlacePass):
    """Moves node 'add2' (it reads 's' and 'ck') to the front: the graph no longer verifies."""

    name = "breaks_order"

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        last = model.graph.node("add2")
        model.graph.remove(last)
        model.graph.insert_before(model.graph.node(0), last)
        return ir.passes.PassResult(model, True)


def _model():
    nodes = [
        helper.make_node("Identity", ["x"], ["x1"], name="id"),
        helper.make_node("Relu", ["x1"], ["a"], name="relu_a"),
        helper.make_node("Relu", ["x1"], ["b"], name="relu_b"),
        helper.make_node("Constant", [], ["c"], name="c", value_floats=[1.0, 2.0, 3.0]),
        helper.make_node("Mul", ["c", "k"], ["ck"], name="ck"),
        helper.make_node("Add", ["a", "b"], ["s"], name="add"),
        helper.make_node("Add", ["s", "ck"], ["y"], name="add2"),
        helper.make_node("Exp", ["x"], ["unused"], name="dead"),
    ]
    return make_model(nodes, [tensor_info("x", [2, 3])], [tensor_info("y", None)],
                      [const("k", np.array([2.0, 2.0, 2.0], np.float32))])


def test_default_pipeline_end_to_end():
    proto = _model()
    model = to_ir(proto)
    assert op_types(model) == ["Identity", "Relu", "Relu", "Constant", "Mul", "Add", "Add", "Exp"]
    model = run_pipeline(model)
    assert op_types(model) == ["Relu", "Add", "Add"]
    assert model.graph.outputs[0].shape == ir.Shape([2, 3])
    passes.verify(model)
    assert_same_outputs(proto, model)
    check_model(model)


def test_error_names_failing_pass_and_previous_passes():
    manager = PassManager([get_pass("shape_inference")(), get_pass("dead_code_elimination")(), _Explodes()])
    with pytest.raises(PassError) as info:
        manager(to_ir(_model()))
    message = str(info.value)
    assert message.startswith("pass 'explodes' failed (after: shape_inference, dead_code_elimination): ")
    assert "boom at node 'relu'" in message
    assert "\n" not in message


def test_verify_failure_after_a_pass_is_a_pass_error():
    manager = PassManager(["topological_sort", _BreaksOrder()])
    expected = (
        r"pass 'breaks_order' failed \(after: topological_sort\): "
        r"graph does not verify: .*not topologically"
    )
    with pytest.raises(PassError, match=expected):
        manager(to_ir(_model()))
    # with verification off the broken graph goes through
    PassManager([_BreaksOrder()], verify=False)(to_ir(_model()))


def test_shapes_required_only_after_shape_inference():
    # without inference, intermediates have no shapes: structure-only verify passes
    model = PassManager(["dead_code_elimination"])(to_ir(_model())).model
    assert "Exp" not in op_types(model)
    with pytest.raises(PassError, match="has no known"):
        PassManager(["dead_code_elimination"], require_shapes=True)(to_ir(_model()))


def test_registry_and_unknown_names():
    assert set(DEFAULT_PIPELINE) <= set(REGISTRY)
    assert {"topological_sort", "constant_folding"} <= set(REGISTRY)
    assert get_pass("constant_folding").name == "constant_folding"
    with pytest.raises(UsageError, match=r"unknown pass 'constant_fold'; valid passes: .*constant_folding"):
        get_pass("constant_fold")
    with pytest.raises(UsageError, match="unknown pass 'nope'"):
        run_pipeline(to_ir(_model()), ["shape_inference", "nope"])
    with pytest.raises(UsageError, match="registered twice"):
        register("constant_folding")(_Explodes)


def test_empty_pipeline_still_verifies():
    model = to_ir(_model())
    assert run_pipeline(model, []) is model
    assert op_types(model)[0] == "Identity"
    nodes = [helper.make_node("Add", ["x", "ghost"], ["y"], name="add")]
    broken = to_ir(make_model(nodes, [tensor_info("x", [2])], [tensor_info("y", [2])]))
    with pytest.raises(VerifyError, match="dangling"):
        run_pipeline(broken, [])


def _shape_from_computed_constant() -> ir.Model:
    """ConstantOfShape(Max(s, s)): onnx's data propagation does not see through Max, so the first
    inference leaves ``z`` without a static shape; constant folding makes it static."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    nodes = [
        helper.make_node("Constant", [], ["s"], value=numpy_helper.from_array(np.array([2, 3], np.int64))),
        helper.make_node("Max", ["s", "s"], ["s2"]),
        helper.make_node("ConstantOfShape", ["s2"], ["z"], value=numpy_helper.from_array(np.array([1.0], np.float32))),
        helper.make_node("Add", ["x", "z"], ["y"]),
    ]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])])
    return ir.serde.deserialize_model(helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)]))


def test_shapes_are_required_from_the_last_inference_on():
    from passes import run_pipeline

    # the default pipeline infers, folds, then infers again: only the last inference must be static
    out = run_pipeline(_shape_from_computed_constant())
    assert [n.op_type for n in out.graph] == ["Add"]
    # a lone inference is the last one, so it must leave every shape static
    with pytest.raises(PassError, match="non-static shape"):
        PassManager(["shape_inference"])(_shape_from_computed_constant())
