"""Session 18's two rules that shrink a conv net's backward inputs (a pipeline stage's stash):
``activations.RELU_MASK_FROM_OUTPUT`` (ReLU's gradient masks by ``y > 0``, its output, which the
next conv's weight gradient keeps anyway) and ``batchnorm.BN_SCALE_FIRST`` (``xc * (rstd * scale)``:
the gradient reads ``xc`` only, not also ``xc * rstd``).

Checked on a conv-BN-ReLU net with a residual block: with both on, stage 0's stash holds no
BatchNormalization output and one full-size BN value (``xc``) per BN, where off it held the BN
output and ``xc * rstd`` too; the 1-rank step with the rules on against off after 10 SGD steps
(ONNX Runtime, losses and every weight and running statistic within rtol 1e-4, atol 1e-5); and 2
TVM stages (1F1B x4) with both on against a 1-rank ONNX Runtime step after 10 SGD steps.
(Each rule's gradients against finite differences: test_rules.py's Relu and BatchNormalization
cases, run with the defaults.)
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from partitioner.training import SGD, batchnorm, build_training_graph
from partitioner.training import pipeline as pipe
from partitioner.training.pipeline import build_pipeline
from partitioner.training.rules import activations
from partitioner.training.runner import StepRunner
from tests.training.rank_threads import step_ranks

IMAGE = (3, 8, 10)


def _conv_bn_net(c: int = 8, seed: int = 5) -> onnx.ModelProto:
    """conv-BN-ReLU x2, conv-BN + skip, ReLU, conv-BN-ReLU, global pool, Gemm (cut after ``r2``)."""
    rng = np.random.default_rng(seed)
    inits: list[onnx.TensorProto] = []
    nodes: list[onnx.NodeProto] = []
    mk = helper.make_node

    def cbr(name: str, x: str, cin: int, relu: bool = True) -> str:
        inits.append(numpy_helper.from_array((rng.standard_normal((c, cin, 3, 3)) * 0.3).astype(np.float32),
                                             f"{name}.weight"))
        stats = {"scale": 1.0 + 0.1 * rng.standard_normal(c), "bias": 0.1 * rng.standard_normal(c),
                 "mean": 0.1 * rng.standard_normal(c), "var": 1.0 + 0.1 * rng.random(c)}
        inits.extend(numpy_helper.from_array(v.astype(np.float32), f"{name}.bn.{k}") for k, v in stats.items())
        nodes.append(mk("Conv", [x, f"{name}.weight"], [f"{name}.c"], name=name, pads=[1, 1, 1, 1]))
        nodes.append(mk("BatchNormalization", [f"{name}.c"] + [f"{name}.bn.{k}" for k in stats], [f"{name}.bn"],
                        name=f"{name}.bn"))
        if not relu:
            return f"{name}.bn"
        nodes.append(mk("Relu", [f"{name}.bn"], [f"{name}.r"], name=f"{name}.relu"))
        return f"{name}.r"

    r0 = cbr("c0", "input", IMAGE[0])
    r1 = cbr("c1", r0, c)
    b2 = cbr("c2", r1, c, relu=False)
    nodes += [mk("Add", [b2, r0], ["a2"], name="a2"), mk("Relu", ["a2"], ["r2"], name="r2")]
    r3 = cbr("c3", "r2", c)
    inits.append(numpy_helper.from_array((rng.standard_normal((10, c)) * 0.3).astype(np.float32), "fc.weight"))
    nodes += [mk("GlobalAveragePool", [r3], ["gp"], name="gp"), mk("Flatten", ["gp"], ["flat"], name="flat"),
              mk("Gemm", ["flat", "fc.weight"], ["logits"], name="fc", transB=1)]
    g = helper.make_graph(nodes, "convbn", [helper.make_tensor_value_info("input", TensorProto.FLOAT, [8, *IMAGE])],
                          [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [8, 10])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def _set(monkeypatch, on: bool) -> None:
    monkeypatch.setattr(activations, "RELU_MASK_FROM_OUTPUT", on)
    monkeypatch.setattr(batchnorm, "BN_SCALE_FIRST", on)


def _full_size(plan: pipe.PipelinePlan, names: list[str]) -> list[str]:
    """The stash values of ``names`` shaped like an activation (4-d, more than one element per channel)."""
    fwd = plan.stages[0].forward
    shapes = {vi.name: [d.dim_value for d in vi.type.tensor_type.shape.dim]
              for vi in list(fwd.graph.output) + list(fwd.graph.value_info) + list(fwd.graph.input)}
    return [v for v in names if len(shapes.get(v, [])) == 4 and np.prod(shapes[v][2:]) > 1]


@pytest.mark.parametrize("on", [True, False])
def test_stash_of_a_conv_bn_relu_stage(monkeypatch, on: bool) -> None:
    """On: stage 0 stashes no BN output (``c0.bn``, ``c1.bn``, ``a2``: the ReLU inputs) and one
    full-size BN intermediate per BN (c0, c1, c2: ``xc``); off: the BN outputs and two per BN."""
    _set(monkeypatch, on)
    monkeypatch.setattr(pipe, "CUT_AFTER", ("r2",))
    plan = build_pipeline(_conv_bn_net(), "cross_entropy", SGD(lr=0.1), batch=8, stages=2, micro_batches=4,
                          backend="onnxruntime")
    stash = plan.stages[0].stash
    relu_inputs = {"c0.bn", "c1.bn", "a2"}
    assert (relu_inputs & set(stash)) == (set() if on else relu_inputs), stash
    bn_full = [v for v in _full_size(plan, stash) if v.startswith("grad.")]
    assert len(bn_full) == (3 if on else 6), bn_full


def test_step_weights_match_with_the_rules_off(monkeypatch) -> None:
    """The 1-rank ONNX Runtime step, both rules on against off: 10 SGD steps on seeded batches,
    losses and every state entry (weights, running statistics) within rtol 1e-4, atol 1e-5."""
    rng = np.random.default_rng(7)
    batches = [(rng.standard_normal((8, *IMAGE)).astype(np.float32), rng.integers(0, 10, 8)) for _ in range(10)]
    runs = {}
    for on in (True, False):
        _set(monkeypatch, on)
        r = StepRunner(build_training_graph(_conv_bn_net(), optimizer=SGD(lr=0.1)))
        runs[on] = ([r.step({"input": x}, y) for x, y in batches], {k: np.array(v) for k, v in r.state.items()})
    np.testing.assert_allclose(runs[True][0], runs[False][0], rtol=1e-4, atol=1e-5)
    assert runs[True][1].keys() == runs[False][1].keys()
    for name, w in runs[False][1].items():
        np.testing.assert_allclose(runs[True][1][name], w, rtol=1e-4, atol=1e-5, err_msg=name)


def _run_plan(plan, backend: str, batches, workdir) -> tuple[list[float], dict]:
    """``plan``'s 2 stages on ``backend`` in a local world: the losses and the gathered state."""
    from partitioner.runtime.comm_local import LocalWorld
    from partitioner.training.pipeline_runner import PipelineRunner, gathered_state

    world = LocalWorld(2, timeout_s=120)
    runners = [PipelineRunner(plan, s, comm=world.communicator(s), backend=backend, workdir=workdir)
               for s in range(2)]
    losses = []
    for x, y in batches:
        losses.append(step_ranks(runners, lambda r, x=x, y=y: ({"input": x}, y), timeout=120)[0])
    return losses, gathered_state(runners)


@pytest.mark.slow
def test_tvm_pipeline_with_the_rules_matches_the_reference_pipeline(tmp_path, monkeypatch) -> None:
    """2 TVM stages (1F1B x4, cut after ``r2``) with both rules (and the NHWC im2col, the default)
    against the same 2-stage plan on ONNX Runtime with both rules off (a pipeline's BatchNormalization
    takes each micro-batch's statistics, so the reference is a pipeline, not 1 rank): 10 SGD steps,
    losses and every state entry within rtol 1e-4, atol 1e-5."""
    rng = np.random.default_rng(2)
    batches = [(rng.standard_normal((8, *IMAGE)).astype(np.float32), rng.integers(0, 10, 8)) for _ in range(10)]
    monkeypatch.setattr(pipe, "CUT_AFTER", ("r2",))
    runs = {}
    for on, backend in ((False, "onnxruntime"), (True, "tvm")):
        _set(monkeypatch, on)
        plan = build_pipeline(_conv_bn_net(), "cross_entropy", SGD(lr=0.1), batch=8, stages=2, micro_batches=4,
                              backend=backend)
        runs[on] = _run_plan(plan, backend, batches, tmp_path / backend)
    np.testing.assert_allclose(runs[True][0], runs[False][0], rtol=1e-4, atol=1e-5)
    for name, w in runs[False][1].items():
        np.testing.assert_allclose(runs[True][1][name], w, rtol=1e-4, atol=1e-5, err_msg=name)
