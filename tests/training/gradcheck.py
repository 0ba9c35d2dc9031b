"""Gradient oracles for the training tests: central finite differences through ONNX Runtime on a
float64 graph, and TVM Relax's own ``relax.transform.Gradient`` on the ``from_onnx`` import of
the same forward model with the same loss."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from partitioner.training import build_training_graph, initial_state, step_program

FD_EPS = 1e-6


def to_float64(model: onnx.ModelProto) -> onnx.ModelProto:
    """A float64 copy: float initializers, value types, Cast targets and float Constants."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    g = m.graph
    for i, t in enumerate(g.initializer):
        if t.data_type == TensorProto.FLOAT:
            g.initializer[i].CopyFrom(numpy_helper.from_array(numpy_helper.to_array(t).astype(np.float64), t.name))
    for vi in list(g.input) + list(g.output) + list(g.value_info):
        if vi.type.tensor_type.elem_type == TensorProto.FLOAT:
            vi.type.tensor_type.elem_type = TensorProto.DOUBLE
    for n in g.node:
        for a in n.attribute:
            if n.op_type == "Cast" and a.name == "to" and a.i == TensorProto.FLOAT:
                a.i = TensorProto.DOUBLE
            if a.type == onnx.AttributeProto.TENSOR and a.t.data_type == TensorProto.FLOAT:
                a.t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(a.t).astype(np.float64), a.t.name))
    return m


def _reference_fixes() -> list:
    """Three float64 gaps of onnx.reference: its Erf rounds through float32, its ConvTranspose
    ignores ``group``, and its LRN loops over the batch axis where the spec sums over channels
    (onnx 1.x ``op_lrn.py``: ``for c in range(x.shape[0])``; only the first N channels get their
    window). Fixed here by scipy's erf, by running each group separately, and by the spec's
    channel window (checked against ONNX Runtime's float32 LRN to 1e-7)."""
    from onnx.reference.op_run import OpRun
    from onnx.reference.ops.op_conv_transpose import ConvTranspose as _RefConvT
    from scipy.special import erf

    class Erf(OpRun):
        def _run(self, x):
            return (erf(x).astype(x.dtype),)

    class ConvTranspose(_RefConvT):
        def _run(self, X, W, B=None, group=None, **kw):
            g = int(group or 1)
            if g == 1:
                return _RefConvT._run(self, X, W, B, group=1, **kw)
            cx, cw = X.shape[1] // g, W.shape[1]
            outs = [_RefConvT._run(self, X[:, i * cx:(i + 1) * cx], W[i * cx:(i + 1) * cx],
                                   None if B is None else B[i * cw:(i + 1) * cw], group=1, **kw)[0]
                    for i in range(g)]
            return (np.concatenate(outs, axis=1),)

    class LRN(OpRun):
        def _run(self, x, alpha=None, beta=None, bias=None, size=None):
            lo, hi = (size - 1) // 2, size // 2  # floor and ceil of (size - 1) / 2
            channels = x.shape[1]
            square_sum = np.stack([np.sum(x[:, max(0, c - lo):min(channels, c + hi + 1)] ** 2, axis=1)
                                   for c in range(channels)], axis=1)
            return ((x / (bias + alpha / size * square_sum) ** beta).astype(x.dtype),)

    return [Erf, ConvTranspose, LRN]


def session(model: onnx.ModelProto):
    """An ONNX Runtime session; where ORT has no float64 kernel for an op (Conv, pools, Erf,
    ...) ONNX's own float64 reference evaluator runs the graph instead (same ``run`` call)."""
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    try:
        return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    except Exception as exc:
        if "NOT_IMPLEMENTED" not in str(exc):
            raise
        from onnx.reference import ReferenceEvaluator

        return ReferenceEvaluator(model, new_ops=_reference_fixes())


def gradients(model: onnx.ModelProto, feeds: Mapping[str, np.ndarray], loss: str,
              trainable: Sequence[str] | None = None) -> tuple[float, dict[str, np.ndarray], onnx.ModelProto, dict]:
    """Our gradients (ORT run of the gradients-only step): loss, {weight: grad}, program, weights."""
    step = build_training_graph(model, loss=loss, trainable=trainable, gradients_only=True)
    prog = step_program(step)
    weights = initial_state(step)
    sess = session(prog)
    outs = sess.run(None, {**feeds, **weights})
    names = [o.name for o in prog.graph.output]
    grads = {n[: -len(".grad")]: v for n, v in zip(names[1:], outs[1:])}
    return float(outs[0]), grads, prog, weights


def finite_differences(prog: onnx.ModelProto, feeds: Mapping[str, np.ndarray], weights: Mapping[str, np.ndarray],
                       grads: Mapping[str, np.ndarray], *, per_weight: int = 6, seed: int = 0,
                       rtol: float = 1e-4, atol: float = 1e-7) -> list[str]:
    """Central differences of the loss for ``per_weight`` random entries of each weight; returns
    one line per entry outside the tolerance."""
    sess = session(prog)
    rng = np.random.default_rng(seed)
    bad = []

    def loss(ws: Mapping[str, np.ndarray]) -> float:
        return float(sess.run(["loss"], {**feeds, **ws})[0])

    for name, w in weights.items():
        flat_idx = rng.choice(w.size, size=min(per_weight, w.size), replace=False)
        for i in flat_idx:
            idx = np.unravel_index(int(i), w.shape)
            ws = {k: v.copy() for k, v in weights.items()}
            ws[name][idx] += FD_EPS
            up = loss(ws)
            ws[name][idx] -= 2 * FD_EPS
            down = loss(ws)
            fd = (up - down) / (2 * FD_EPS)
            got = float(grads[name][idx])
            if abs(fd - got) > atol + rtol * max(abs(fd), abs(got)):
                bad.append(f"{name}{list(idx)}: autodiff {got:.8g}, finite differences {fd:.8g}")
    return bad


def with_mse_loss(model: onnx.ModelProto, output: str, label: str = "labels") -> onnx.ModelProto:
    """The forward model with ``loss = mean((output - labels)^2)`` appended (for Relax)."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    g = m.graph
    out = next(o for o in g.output if o.name == output)
    elem = out.type.tensor_type.elem_type
    shape = [d.dim_value for d in out.type.tensor_type.shape.dim]
    g.input.append(helper.make_tensor_value_info(label, elem, shape))
    np_t = helper.tensor_dtype_to_np_dtype(elem)
    g.initializer.append(numpy_helper.from_array(np.asarray(1.0 / max(1, int(np.prod(shape))), dtype=np_t), "mse.scale"))
    g.node.extend([
        helper.make_node("Sub", [output, label], ["mse.diff"]),
        helper.make_node("Mul", ["mse.diff", "mse.diff"], ["mse.sq"]),
        helper.make_node("ReduceSum", ["mse.sq"], ["mse.sum"], keepdims=0),
        helper.make_node("Mul", ["mse.sum", "mse.scale"], ["mse.loss"]),
    ])
    del g.output[:]
    g.output.append(helper.make_tensor_value_info("mse.loss", elem, []))
    return m


def _sanitize(name: str) -> str:
    import re

    return re.sub(r"[^0-9A-Za-z_]", "_", name)


def relax_gradients(model: onnx.ModelProto, feeds: Mapping[str, np.ndarray],
                    weights: Mapping[str, np.ndarray]) -> tuple[float, dict[str, np.ndarray]]:
    """TVM Relax's gradient of the model's scalar output w.r.t. ``weights`` (by name)."""
    import tvm
    from tvm import relax
    from tvm.relax.frontend.onnx import from_onnx

    mod = from_onnx(model, keep_params_in_input=True)
    params = mod["main"].params
    names = [str(p.name_hint) if hasattr(p, "name_hint") else str(p) for p in params]
    # the importer sanitises names ('.' -> '_'): match parameters through the same mapping
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    known = {_sanitize(k): v for k, v in {**inits, **feeds, **weights}.items()}
    plain = {_sanitize(k): k for k in {**inits, **feeds, **weights}}
    want = [p for p, n in zip(params, names) if plain.get(n) in weights]
    mod = relax.transform.DecomposeOpsForTraining()(mod) if hasattr(relax.transform, "DecomposeOpsForTraining") else mod
    mod = relax.transform.Gradient("main", require_grads=want)(mod)
    mod = relax.get_pipeline("zero")(mod)
    ex = tvm.compile(mod, tvm.target.Target({"kind": "llvm"}))
    vm = relax.VirtualMachine(ex, tvm.cpu())
    args = []
    for p, n in zip(params, names):
        value = known[n]
        args.append(tvm.runtime.tensor(np.asarray(value, order="C")))  # keeps 0-d arrays 0-d
    loss, grads = vm["main_adjoint"](*args)
    wnames = [plain[n] for n in names if plain.get(n) in weights]
    return float(loss.numpy()), {n: g.numpy() for n, g in zip(wnames, grads)}


def assert_same_descending_losses(step, data, labels, workdir, compared: int = 3) -> list[float]:
    """3 steps of ``step`` on ONNX Runtime and on TVM from the same state: the first ``compared``
    losses equal within 1e-4 and each backend's loss going down; returns ORT's losses."""
    from partitioner.training.runner import StepRunner

    ort_runner = StepRunner(step, backend="onnxruntime")
    ort_losses = [ort_runner.step(data, labels) for _ in range(3)]
    tvm_runner = StepRunner(step, backend="tvm", workdir=workdir)
    tvm_losses = [tvm_runner.step(data, labels) for _ in range(3)]
    np.testing.assert_allclose(tvm_losses[:compared], ort_losses[:compared], rtol=0, atol=1e-4)
    assert ort_losses[2] < ort_losses[1] < ort_losses[0], ort_losses
    assert tvm_losses[2] < tvm_losses[1] < tvm_losses[0], tvm_losses
    return ort_losses
