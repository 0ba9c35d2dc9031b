"""pipeline_runner.ACCUMULATE_IN_PROGRAM (default on): a TVM stage's per-micro-batch programs sum
the weight gradients over the micro-batches themselves (``W.grad = W.grad.acc + g``, the add on
the weight gradient's MatMul / Gemm product where there is one, so TVM fuses it into that kernel),
the running sum passed from call to call as the previous output tensor. On 2 ranks TVM 1F1B the
conv net's weights after 10 SGD steps are the numpy accumulation's (knob off), rtol 1e-4, atol
1e-5, and each step's loss too."""

from __future__ import annotations

import numpy as np
import onnx

from partitioner.runtime.comm_local import LocalWorld
from partitioner.training import pipeline_runner
from partitioner.training.optimizers import SGD
from partitioner.training.pipeline import build_pipeline
from partitioner.training.pipeline_runner import PipelineRunner, accumulating, gathered_state

from .test_pipeline_hoist import _conv_net, _run_pipeline


def _trained(plan, batches, tmp_path, on: bool, monkeypatch) -> tuple[list[float], dict, list[PipelineRunner]]:
    monkeypatch.setattr(pipeline_runner, "ACCUMULATE_IN_PROGRAM", on)
    world = LocalWorld(2, timeout_s=120)
    runners = [PipelineRunner(plan, s, comm=world.communicator(s), backend="tvm", workdir=tmp_path / str(on))
               for s in range(2)]
    losses = _run_pipeline(runners, batches)
    return losses, gathered_state(runners), runners


def test_in_program_sum_trains_as_numpy_sum(tmp_path, monkeypatch) -> None:
    import tvm

    plan = build_pipeline(_conv_net(), "cross_entropy", SGD(lr=0.1), batch=8, stages=2, micro_batches=4,
                          backend="tvm")
    rng = np.random.default_rng(3)
    batches = [(rng.standard_normal((8, 2, 5, 5)).astype(np.float32), rng.integers(0, 10, 8)) for _ in range(10)]
    fed: list[bool] = []
    on_losses, on_state, runners = _trained(plan, batches[:1], tmp_path, True, monkeypatch)
    for r in runners:  # every program call after the first of a step reads the sum as a tensor
        for kind, names in r._sums.inputs.items():
            exe = r._exe[kind]

            def counted(feeds, comm, run=exe.run, names=names):
                fed.extend(isinstance(feeds[n], tvm.runtime.Tensor) for n in names.values())
                return run(feeds, comm)

            exe.run = counted
    assert {k for r in runners for k in r._sums.inputs} == {"B", "FB"}, [r._sums.inputs for r in runners]
    on_losses += _run_pipeline(runners, batches[1:])
    on_state = gathered_state(runners)
    assert fed and all(fed)
    off_losses, off_state, off_runners = _trained(plan, batches, tmp_path, False, monkeypatch)
    assert not any(r._sums.inputs for r in off_runners)
    np.testing.assert_allclose(on_losses, off_losses, rtol=1e-4, atol=1e-5)
    assert set(on_state) == set(off_state)
    for name, w in off_state.items():
        np.testing.assert_allclose(on_state[name], w, rtol=1e-4, atol=1e-5, err_msg=name)


def test_accumulating_adds_at_the_product(monkeypatch) -> None:
    """The conv weight gradient's add sits on its MatMul (before the reshape to the weight's
    shape), the fc's on its Gemm; with ``ACCUMULATE_AT_PRODUCT`` off, on the ``W.grad`` output.
    The NCHW im2col form (linear.IM2COL_NHWC off): the NHWC form transposes dW to OIHW after its
    MatMul, so its add sits behind that transpose (fused with it by TVM)."""
    from partitioner.training.rules import linear

    monkeypatch.setattr(linear, "IM2COL_NHWC", False)
    plan = build_pipeline(_conv_net(), "cross_entropy", SGD(lr=0.1), batch=8, stages=2, micro_batches=4,
                          backend="tvm")
    for at_product in (True, False):
        monkeypatch.setattr(pipeline_runner, "ACCUMULATE_AT_PRODUCT", at_product)
        for st in plan.stages:
            prog = st.backward if st.backward is not None else st.fused
            new, names = accumulating(prog, st.weights)
            onnx.checker.check_model(new, full_check=True)
            prod = {o: n for n in new.graph.node for o in n.output}
            for w, acc in names.items():
                add = next(n for n in new.graph.node if n.op_type == "Add" and n.name.endswith(".accumulate")
                           and (acc in n.input or f"{acc}.view" in n.input))
                before = prod[add.input[0]].op_type
                assert before in (("MatMul", "Gemm") if at_product else ("Identity",)), (w, before)
            inputs = [v.name for v in new.graph.input]
            assert all(a in inputs for a in names.values())
            assert accumulating(prog, [])[1] == {}
