"""Pipeline rule 14 (partitioner/training/nhwc_stash.py): a TVM stage's ``F`` returns its stashed
conv-side activations in NHWC and ``B`` reads them so.

The plan's stash names the NHWC values (sent values and program inputs keep their layout); the
2 TVM stages still train like 1 rank (1F1B, 4 micro-batches, 6 SGD steps against a 1-rank ONNX
Runtime step, every weight within rtol 1e-4, atol 1e-5); and the ``transpose`` kernels a call of
stage 0's ``F`` runs drop with the knob on (the NCHW outputs TVM had to write).
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from partitioner.training import SGD, nhwc_stash
from partitioner.training import pipeline as pipe
from partitioner.training.pipeline import build_pipeline
from partitioner.training.pipeline_runner import executable
from partitioner.training.rules import activations, linear

from .test_pipeline_training import _tvm_pipeline_trains_like_one_rank

IMAGE = (3, 8, 10)  # C, H, W all different: a wrong permutation changes a shape


def _resnet_like(c: int = 6, seed: int = 5) -> onnx.ModelProto:
    """Conv-Relu, a residual block (Conv-Relu-Conv, Add, Relu), Conv-Relu, global pool, Gemm; no
    BatchNormalization (rule 7), so the pipeline must match 1 rank. Cut after the block."""
    rng = np.random.default_rng(seed)
    cin = IMAGE[0]

    def w(name: str, shape: tuple[int, ...]) -> onnx.TensorProto:
        return numpy_helper.from_array((rng.standard_normal(shape) * 0.2).astype(np.float32), name)

    inits = [w("c0.weight", (c, cin, 3, 3)), w("c1.weight", (c, c, 3, 3)), w("c2.weight", (c, c, 3, 3)),
             w("c3.weight", (c, c, 3, 3)), w("fc.weight", (10, c))]
    mk, pads = helper.make_node, [1, 1, 1, 1]
    nodes = [mk("Conv", ["input", "c0.weight"], ["c0"], name="c0", pads=pads), mk("Relu", ["c0"], ["r0"], name="r0"),
             mk("Conv", ["r0", "c1.weight"], ["c1"], name="c1", pads=pads), mk("Relu", ["c1"], ["r1"], name="r1"),
             mk("Conv", ["r1", "c2.weight"], ["c2"], name="c2", pads=pads), mk("Add", ["c2", "r0"], ["a2"], name="a2"),
             mk("Relu", ["a2"], ["r2"], name="r2"),
             mk("Conv", ["r2", "c3.weight"], ["c3"], name="c3", pads=pads), mk("Relu", ["c3"], ["r3"], name="r3"),
             mk("GlobalAveragePool", ["r3"], ["gp"], name="gp"), mk("Flatten", ["gp"], ["flat"], name="flat"),
             mk("Gemm", ["flat", "fc.weight"], ["logits"], name="fc", transB=1)]
    g = helper.make_graph(nodes, "resnetlike", [helper.make_tensor_value_info("input", TensorProto.FLOAT, [8, *IMAGE])],
                          [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [8, 10])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def _plan(monkeypatch, on: bool) -> pipe.PipelinePlan:
    monkeypatch.setattr(nhwc_stash, "NHWC_STASH", on)
    # the NCHW im2col (Pad reads r0, r1: rule 1's layout-bound case); test_im2col_nhwc.py has rule 5
    monkeypatch.setattr(linear, "IM2COL_NHWC", False)
    # ReLU masks from the ReLU inputs (c0, c1, a2: the values this rule rewrites), not the outputs
    monkeypatch.setattr(activations, "RELU_MASK_FROM_OUTPUT", False)
    monkeypatch.setattr(pipe, "CUT_AFTER", ("r2",))
    return build_pipeline(_resnet_like(), "cross_entropy", SGD(lr=0.1), batch=8, stages=2, micro_batches=4,
                          backend="tvm")


@pytest.mark.parametrize("on", [True, False])
def test_stash_names_the_nhwc_values(monkeypatch, on) -> None:
    """On: every stashed 4-d value F makes and no layout-bound op of B reads (the ReLU masks' ``c0``,
    ``c1``, ``a2``) is returned as ``<v>.nhwc`` with its shape permuted and read so by B; the data
    input, the sent value (``r2``) and the weight gradients' im2col inputs (``r0``, ``r1``: Pad)
    keep their names and layout. Off: nothing renamed."""
    plan = _plan(monkeypatch, on)
    st = plan.stages[0]
    made = {"a2", "c0", "c1"}
    want = sorted(v + nhwc_stash.SUFFIX for v in made) if on else sorted(made)
    assert sorted(v for v in st.stash if v not in ("input", "r0", "r1")) == want
    assert {"input", "r0", "r1"} <= set(st.stash)
    f_out = {o.name: [d.dim_value for d in o.type.tensor_type.shape.dim] for o in st.forward.graph.output}
    b_in = {i.name: [d.dim_value for d in i.type.tensor_type.shape.dim] for i in st.backward.graph.input}
    assert f_out["r2"] == [2, 6, 8, 10]
    for v in want:
        assert f_out[v] == b_in[v] == ([2, 8, 10, 6] if on else [2, 6, 8, 10]), v
    for prog in (st.forward, st.backward):
        onnx.checker.check_model(prog, full_check=True)
    assert plan.stages[1].stash == []


def test_nhwc_stash_pipeline_trains_like_one_rank(monkeypatch, tmp_path) -> None:
    """2 TVM stages (1F1B x4) with rule 14 against a 1-rank ONNX Runtime step: 6 SGD steps,
    losses and every weight within rtol 1e-4, atol 1e-5."""
    plan = _plan(monkeypatch, True)
    assert any(v.endswith(nhwc_stash.SUFFIX) for v in plan.stages[0].stash)
    _tvm_pipeline_trains_like_one_rank(_resnet_like(), plan, IMAGE, tmp_path, steps=6)


def _f_transposes(plan: pipe.PipelinePlan, workdir) -> int:
    """``transpose`` kernels (any kernel whose symbol names one) one call of stage 0's ``F`` runs,
    built as the runner builds it, on seeded inputs, counted by a VM instrument."""
    fwd = plan.stages[0].forward
    exe = executable(fwd, "tvm", workdir, 1)
    calls: dict[str, int] = defaultdict(int)

    def instrument(func, symbol, before, ret, *args) -> int:
        if before:
            calls[str(symbol)] += 1
        return 0

    exe._vm.set_instrument(instrument)
    rng = np.random.default_rng(2)
    feeds = {i.name: rng.standard_normal([d.dim_value for d in i.type.tensor_type.shape.dim]).astype(np.float32)
             for i in fwd.graph.input}
    exe.run(feeds, None)
    return sum(n for s, n in calls.items() if "transpose" in s)


def test_fewer_transpose_kernels_per_forward_call(monkeypatch, tmp_path) -> None:
    """Stage 0's F writes its three NHWC stash values without a transpose kernel each: off, 7 a
    call (five stashed activations, the input to NHWC, the sent value back to NCHW); on, 4."""
    off = _f_transposes(_plan(monkeypatch, False), tmp_path / "off")
    on = _f_transposes(_plan(monkeypatch, True), tmp_path / "on")
    assert off - on >= 3 and on <= 4, (off, on)
