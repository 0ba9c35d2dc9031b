"""The row-wise rule (backends/tvm/schedules/rowwise.py): LayerNorm and softmax over the last
axis reduce with vector partial sums (an ``rfactor`` block whose lane loop is vectorised), the
row loop is parallel only from ``threads.PARALLEL_MIN_ELEMENTS`` elements, and every build
matches ONNX Runtime (seeded inputs, rtol 1e-4, atol 1e-5, through build_and_compare).
With ``ROWWISE`` off the functions fall back to dlight's scalar reductions (no partial sums)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import tvm
from onnx import TensorProto, helper, numpy_helper

from backends.tvm.schedules import rowwise as R
from backends.tvm.schedules import threads
from backends.tvm.schedules.vector import vector_lanes
from backends.tvm.target import detect_host_target
from tvm_build_check import build_and_compare


def _model(op: str, shape: list[int]) -> onnx.ModelProto:
    rng = np.random.default_rng(sum(shape))
    inits = []
    if op == "LayerNormalization":
        d = shape[-1]
        inits = [numpy_helper.from_array(rng.standard_normal(d).astype(np.float32), "g"),
                 numpy_helper.from_array(rng.standard_normal(d).astype(np.float32), "b")]
        node = helper.make_node(op, ["x", "g", "b"], ["y"], axis=-1, epsilon=1e-5)
    else:
        node = helper.make_node(op, ["x"], ["y"], axis=-1)
    g = helper.make_graph([node], "rowwise", [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    return onnx.shape_inference.infer_shapes(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]))


def _row_kernels(mod: tvm.IRModule) -> list[str]:
    """Scripts of the scheduled PrimFuncs that reduce (LayerNorm / softmax)."""
    return [f.script() for gv, f in mod.functions_items()
            if isinstance(f, tvm.tirx.PrimFunc) and ("layer_norm" in gv.name_hint or "softmax" in gv.name_hint)]


def _has_vector_partial_sums(script: str) -> bool:
    return "_rf_update" in script and "T.vectorized" in script


CASES = [("LayerNormalization", [1, 64, 128]), ("LayerNormalization", [8, 65, 96]),
         ("Softmax", [1, 4, 64, 64]), ("Softmax", [2, 4, 16, 32])]


@pytest.mark.parametrize("op,shape", CASES, ids=[f"{o}-{'x'.join(map(str, s))}" for o, s in CASES])
def test_rows_reduce_in_vectors_and_match_ort(op: str, shape: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    lanes = vector_lanes(tvm.target.Target(detect_host_target()))
    assert R.accumulator_width(shape[-1], lanes)  # these rows split into whole vectors
    scripts = _row_kernels(build_and_compare(_model(op, shape)))
    assert scripts and all(_has_vector_partial_sums(s) for s in scripts)
    monkeypatch.setattr(R, "ROWWISE", False)  # the old schedule: scalar reductions, same numbers
    scripts = _row_kernels(build_and_compare(_model(op, shape)))
    assert scripts and not any(_has_vector_partial_sums(s) for s in scripts)


@pytest.mark.parametrize("d", [65, 50])
def test_rows_no_vector_divides_reduce_in_scalar_partials(d: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Softmax over 65 keys (a ViT with a class token) or 50: no vector width divides the row,
    so each reduction takes a divisor of D as independent scalar partial sums (rule 3b), and the
    numbers still match; with ``SCALAR_PARTIALS`` off, one scalar chain (no partial-sum block)."""
    lanes = vector_lanes(tvm.target.Target(detect_host_target()))
    assert R.accumulator_width(d, lanes) == 0
    width = R.scalar_partials(d, lanes)
    assert 4 <= width <= lanes and d % width == 0
    scripts = _row_kernels(build_and_compare(_model("Softmax", [1, 2, d, d])))
    assert scripts and all("_rf" in s and not _has_vector_partial_sums(s) for s in scripts)
    monkeypatch.setattr(R, "SCALAR_PARTIALS", False)
    scripts = _row_kernels(build_and_compare(_model("Softmax", [1, 2, d, d])))
    assert scripts and not any("_rf" in s for s in scripts)


def test_prime_rows_keep_one_chain_and_match_ort() -> None:
    """197 tokens (ViT-B/16's 14x14 patches + class token) is prime: nothing to split."""
    lanes = vector_lanes(tvm.target.Target(detect_host_target()))
    assert R.accumulator_width(197, lanes) == 0 and R.scalar_partials(197, lanes) == 0
    scripts = _row_kernels(build_and_compare(_model("Softmax", [1, 1, 8, 197])))
    assert scripts and not any("_rf" in s for s in scripts)


@pytest.mark.parametrize("shape", [[1, 64, 128], [8, 64, 128]], ids=["b1", "b8"])
def test_rows_parallel_only_above_the_element_threshold(shape: list[int]) -> None:
    (script,) = _row_kernels(build_and_compare(_model("LayerNormalization", shape)))
    elements = int(np.prod(shape))
    assert ("T.parallel" in script) == (elements >= threads.PARALLEL_MIN_ELEMENTS)


def test_symbolic_row_count_is_scheduled_serial_and_matches_ort() -> None:
    """A LayerNorm over ``(n, 128)`` with ``n`` symbolic (a dynamic batch): the rule applies,
    the rows stay serial (rule 4: size unknown), and n = 37 rows match ORT's LayerNormalization."""
    import onnxruntime as ort
    from tvm import te, tirx, topi

    target = tvm.target.Target(detect_host_target())
    n = tirx.Var("n", "int64")
    x, g, b = (te.placeholder(s, "float32", name=k) for k, s in (("x", (n, 128)), ("g", (128,)), ("b", (128,))))
    func = te.create_prim_func([x, g, b, topi.nn.layer_norm(x, g, b, axis=[1], epsilon=1e-5)])
    with target:
        sch = R.Rowwise().apply(func, target, False)
    assert sch is not None and "T.parallel" not in sch.mod.script()
    assert _has_vector_partial_sums(sch.mod.script())
    m = _model("LayerNormalization", [37, 128])
    xs = np.random.default_rng(0).standard_normal((37, 128)).astype(np.float32)
    gs, bs = (numpy_helper.to_array(t) for t in m.graph.initializer)
    ref = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": xs})[0]
    out = tvm.runtime.tensor(np.zeros_like(xs))
    tvm.compile(sch.mod, target)["main"](*(tvm.runtime.tensor(a) for a in (xs, gs, bs)), out)
    np.testing.assert_allclose(out.numpy(), ref, rtol=1e-4, atol=1e-5)
