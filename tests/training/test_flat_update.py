"""Overlap rule 9: a data-parallel TVM rank builds its all-elementwise segment (the optimizer
update) over 1-D tensors, fed ``reshape(-1)`` views and returning views of the original shapes.

Also a 1-rank TVM step: its optimizer's nodes become a library of their own, built so.

Checked: which segments qualify (the update of SGD and Adam with weight decay does; a broadcast,
a non-elementwise op or a 1-D-only segment does not); on 2 in-process TVM ranks of a conv net
(4-D conv weights) the update's library receives only 1-D arrays (4-D ones with
``FLAT_ELEMENTWISE`` off: that assertion fails when the knob is off) and the weights after 10
SGD and 10 Adam steps match a 1-rank TVM run of the same global batch within rtol 1e-4, atol
1e-5 (seeded batches); the 1-rank TVM step's update library likewise receives only 1-D arrays
(fails with the knob off: one library, fed the 4-D weights), no library copied a weight into a
buffer of its own (the runner starts from 64-byte aligned state), and its losses and state match
the ONNX Runtime step within rtol 1e-4, atol 1e-5 over 4 seeded SGD steps.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto, helper

from partitioner.core.segments import Segment, split_program
from partitioner.training import SGD, AdamW, build_training_graph
from partitioner.training import buckets as buckets_mod
from partitioner.training import overlap as overlap_mod
from partitioner.training.runner import StepRunner
from partitioner.training.step import step_program

from .test_data_tvm_buckets import step_data_ranks
from .test_pipeline_hoist import _conv_net
from .test_tvm_step_conv_transpose import _tvm_steps_match_ort

OPTIMIZERS = {"sgd": SGD(lr=0.1), "adamw": AdamW(lr=1e-2, weight_decay=0.01)}
STEPS = 10


def _segments(optimizer) -> list[Segment]:
    program = buckets_mod.unbucket(step_program(build_training_graph(_conv_net(), optimizer=optimizer, batch=4,
                                                                     world_size=2)))
    return [s for s in split_program(program) if isinstance(s, Segment) and s.outputs]


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_only_the_update_segment_is_flattened(name: str) -> None:
    segments = _segments(OPTIMIZERS[name])
    flat = [overlap_mod.flat_elementwise(s.model) for s in segments]
    assert all(f is None for f in flat[:-1])  # forward and backward: Conv, Gemm, ...
    model, shapes = flat[-1]
    assert shapes["c1.weight"] == (4, 2, 3, 3) and shapes["c1.weight.next"] == (4, 2, 3, 3)
    ranks = {vi.name: len(vi.type.tensor_type.shape.dim) for vi in (*model.graph.input, *model.graph.output)}
    assert ranks["c1.weight"] == 1 and ranks["c1.weight.next"] == 1 and ranks["fc.weight"] == 1


def _elementwise(nodes, inputs) -> object:
    vis = [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in inputs]
    g = helper.make_graph(nodes, "g", vis, [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 4])])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])


def test_broadcasts_other_ops_and_flat_segments_are_left_alone() -> None:
    add = [helper.make_node("Add", ["a", "b"], ["y"])]
    assert overlap_mod.flat_elementwise(_elementwise(add, [("a", [3, 4]), ("b", [3, 4])])) is not None
    assert overlap_mod.flat_elementwise(_elementwise(add, [("a", [3, 4]), ("b", [4])])) is None  # a broadcast
    assert overlap_mod.flat_elementwise(_elementwise(add, [("a", [3, 4]), ("b", [1, 1])])) is None  # a 2-D "scalar"
    assert overlap_mod.flat_elementwise(_elementwise(add, [("a", [3, 4]), ("b", [])])) is not None  # a scalar
    relu = [helper.make_node("Relu", ["a"], ["y"])]
    assert overlap_mod.flat_elementwise(_elementwise(relu, [("a", [3, 4])])) is None  # not in ELEMENTWISE_OPS
    vis = [helper.make_tensor_value_info("a", TensorProto.FLOAT, [12])]
    one_d = helper.make_graph([helper.make_node("Neg", ["a"], ["y"])], "g", vis,
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [12])])
    assert overlap_mod.flat_elementwise(helper.make_model(one_d)) is None  # nothing of rank >= 2


def _spy_update(monkeypatch, runner: StepRunner) -> list[int]:
    """The ranks of the arrays ``runner``'s last library is called with (appended per call)."""
    fed: list[int] = []
    lib = runner._exe.steps[-1][1] if isinstance(runner._exe, overlap_mod.TvmBucketedExecutable) else runner._exe
    real = lib.run
    monkeypatch.setattr(lib, "run", lambda feeds, comm: fed.extend(np.ndim(v) for v in feeds.values()) or
                        real(feeds, comm))
    return fed


@pytest.mark.slow
def test_one_rank_tvm_step_updates_over_1d_views_and_matches_ort(tmp_path: Path, monkeypatch) -> None:
    step = build_training_graph(_conv_net(), optimizer=SGD(lr=0.1))
    tvm = StepRunner(step, backend="tvm", workdir=tmp_path)
    fed = _spy_update(monkeypatch, tvm)
    _tvm_steps_match_ort(tvm, StepRunner(step), (2, 5, 5), seed=7)
    assert fed and max(fed) == 1, sorted(set(fed))  # the whole step's 4-D inputs with FLAT_ELEMENTWISE off
    # overlap rule 8: the state went in as it lay from the first step on (runner: vm_aligned); only
    # the batch was copied into a library's buffer
    copied = {n for _, lib in tvm._exe.steps if lib is not None for n, b in zip(lib.inputs, lib._in_bufs) if b}
    assert copied <= {"input", "labels"}, copied


def _batches(seed: int = 11):
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal((8, 2, 5, 5)).astype(np.float32), rng.integers(0, 10, 8)) for _ in range(STEPS)]


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_tvm_data_ranks_update_over_1d_views_and_match_one_rank(name: str, tmp_path: Path, monkeypatch) -> None:
    from partitioner.runtime.comm_local import LocalWorld

    opt, batches = OPTIMIZERS[name], _batches()
    step2 = build_training_graph(_conv_net(), optimizer=opt, batch=4, world_size=2)
    world = LocalWorld(2, timeout_s=120)
    runners = [StepRunner(step2, backend="tvm", comm=world.communicator(r), workdir=tmp_path / f"r{r}")
               for r in range(2)]
    fed = _spy_update(monkeypatch, runners[0])
    step_data_ranks(runners, batches)
    assert fed and max(fed) == 1, sorted(set(fed))  # 4-D with FLAT_ELEMENTWISE off
    one = StepRunner(build_training_graph(_conv_net(), optimizer=opt), backend="tvm", workdir=tmp_path / "one")
    for x, y in batches:
        one.step({"input": x}, y)
    for n, w in one.weights().items():
        for r in runners:
            assert r.state[n].shape == w.shape
            np.testing.assert_allclose(r.state[n], w, rtol=1e-4, atol=1e-5, err_msg=n)
