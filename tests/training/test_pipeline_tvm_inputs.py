"""A TVM pipeline stage copies each weight into its program's input buffer once per step
(backends/tvm/executable.py rule 5, ``reuse_readonly_inputs``, set by the pipeline runner)."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper

from partitioner.runtime.comm_local import LocalWorld


def _add_program() -> onnx.ModelProto:
    g = helper.make_graph([helper.make_node("Add", ["w", "x"], ["y"])], "reuse",
                          [helper.make_tensor_value_info("w", TensorProto.FLOAT, [4, 4]),
                           helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 4])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 4])])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def test_read_only_feed_is_copied_once_and_a_changed_feed_again(tmp_path, monkeypatch) -> None:
    from partitioner.training.pipeline_runner import executable

    exe = executable(_add_program(), "tvm", tmp_path, 1)
    exe.reuse_readonly_inputs = True
    comm = LocalWorld(1).communicator(0)
    rng = np.random.default_rng(0)
    w = rng.standard_normal((4, 4)).astype(np.float32)
    w.flags.writeable = False
    copies = {"n": 0}
    real = np.copyto

    def counting(dst, src, *a, **k):
        copies["n"] += 1
        return real(dst, src, *a, **k)

    monkeypatch.setattr(np, "copyto", counting)
    for _ in range(3):
        x = rng.standard_normal((4, 4)).astype(np.float32)
        np.testing.assert_allclose(exe.run({"w": w, "x": x}, comm)["y"], w + x, rtol=0, atol=1e-6)
    assert copies["n"] == 1 + 3  # w once, x every call
    mutable = w.copy()  # writeable: copied every call, so an in-place change is seen
    for k in range(2):
        mutable += 1.0
        x = np.zeros((4, 4), np.float32)
        np.testing.assert_allclose(exe.run({"w": mutable, "x": x}, comm)["y"], mutable, rtol=0, atol=1e-6)
    w2 = w + 1.0  # a new read-only array: copied
    w2.flags.writeable = False
    np.testing.assert_allclose(exe.run({"w": w2, "x": x}, comm)["y"], w2, rtol=0, atol=1e-6)


def test_pipeline_runner_turns_reuse_on(tmp_path) -> None:
    import models_zoo
    from partitioner.training import SGD
    from partitioner.training.overheads import _Instant
    from partitioner.training.pipeline import build_pipeline
    from partitioner.training.pipeline_runner import PipelineRunner

    model = models_zoo.build("mlp", batch=8, hidden=32, in_features=16)
    plan = build_pipeline(model, "cross_entropy", SGD(lr=0.1), batch=8, stages=2, micro_batches=4, backend="tvm")
    r = PipelineRunner(plan, 1, comm=_Instant(1), backend="tvm", workdir=tmp_path)
    assert all(e.reuse_readonly_inputs for e in r._exe.values())
    assert all(not a.flags.writeable for a in r.state.values())
