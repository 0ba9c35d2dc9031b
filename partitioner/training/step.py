"""``build_training_graph``: one ONNX graph for one training step.

Rules of the builder (numbered; the tests check each):

1. The step's inputs are the model's data inputs, ``labels``, then the state: every trainable
   weight ``W``, the BatchNormalization running statistics and the optimizer state
   (``W.velocity`` / ``W.m``, ``W.v``, ``optimizer.step``). Its outputs are ``loss`` and, for
   every state input ``S``, ``S.next`` (same order). One step is forward + loss + backward +
   optimizer update, all standard ONNX ops (opset 18), so ONNX Runtime and TVM both run it.
2. Every state input also has an initializer of the same name (ONNX's overridable default
   input): the model is self-contained. :func:`initial_state` reads those values and
   :func:`step_program` strips them for a backend that must treat them as inputs.
3. Default trainable weights: float initializers of more than one element, all finite and below
   1e4 in magnitude (masks such as GPT's causal ``-1e9`` are constants, not weights), that feed
   a differentiable input slot (not Resize scales, Pad values, BN statistics, ...).
4. Every op that needs a gradient and has no rule is listed in one error before anything is
   built (exit 2).
5. With ``world_size > 1`` (data parallelism), the gradients are flattened and concatenated into
   buckets of at most ``bucket_bytes`` (in the order the backward pass finishes them, last layer
   first; the loss rides in the first bucket), each bucket goes through one
   ``partitioner.comm.AllReduce`` (sum) over all ranks and is split back before the optimizer:
   every rank applies the same mean gradient of the global batch and reports the global loss.
   The ``1/world_size`` of the mean is applied to the loss gradient's seed (and to the local loss
   in the bucket) before the backward pass, an activation-sized multiply, instead of to every
   reduced bucket, a weight-sized pass per step (exact for a power-of-two world: the same
   products). One collective per bucket instead of one per weight (a
   step of the zoo mlp on 2 MPI ranks went from 9 AllReduces to 1). Each bucket's flatten,
   concat and AllReduce sit right after the node that finishes its last gradient, so the
   AllReduce can overlap the rest of the backward pass (:mod:`partitioner.training.overlap`
   runs it so). BatchNormalization uses each rank's local batch statistics (no SyncBN).
6. ``metadata_props["training.signature"]`` records the roles of the inputs and outputs as JSON
   (:class:`TrainingSignature`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir

from partitioner.core.errors import UsageError
from partitioner.training.autodiff import (
    Emitter,
    backward,
    check_rules,
    differentiable_nodes,
    is_float,
    shape_of,
)
from partitioner.training.batchnorm import expand_batchnorm
from partitioner.training.losses import emit_loss, label_spec, loss_input
from partitioner.training.optimizers import SGD, STEP_NAME, Optimizer

SIGNATURE_KEY = "training.signature"
STEP_OPSET = 18

#: input slots that carry no gradient (rule 3)
NON_DIFFERENTIABLE_SLOTS: dict[str, set[int]] = {
    "Resize": {1, 2, 3}, "Pad": {1, 2, 3}, "Clip": {1, 2}, "BatchNormalization": {3, 4},
    "Reshape": {1}, "Expand": {1}, "Slice": {1, 2, 3, 4}, "Gather": {1}, "Where": {0},
    "ReduceMean": {1}, "ReduceSum": {1}, "Split": {1}, "Squeeze": {1}, "Unsqueeze": {1}, "Tile": {1},
}


@dataclass(frozen=True)
class TrainingSignature:
    """Roles of the step's inputs and outputs (rule 6)."""

    data: tuple[str, ...]
    labels: str
    loss: str
    output: str
    weights: tuple[str, ...]
    state: tuple[tuple[str, str], ...]  # (input, output) pairs, weights first
    loss_kind: str
    optimizer: dict[str, Any] = field(default_factory=dict, hash=False)
    world_size: int = 1

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> TrainingSignature:
        d = json.loads(text)
        return cls(data=tuple(d["data"]), labels=d["labels"], loss=d["loss"], output=d["output"],
                   weights=tuple(d["weights"]), state=tuple(tuple(p) for p in d["state"]), loss_kind=d["loss_kind"],
                   optimizer=d.get("optimizer", {}), world_size=int(d.get("world_size", 1)))


def signature(model: ir.Model | onnx.ModelProto) -> TrainingSignature:
    props = (model.metadata_props if isinstance(model, ir.Model)
             else {p.key: p.value for p in model.metadata_props})
    if SIGNATURE_KEY not in props:
        raise UsageError("this model is not a training step (no training.signature metadata); "
                         "build it with build_training_graph")
    return TrainingSignature.from_json(props[SIGNATURE_KEY])


def default_trainable(graph: ir.Graph) -> list[str]:
    """Rule 3."""
    frozen: set[str] = set()
    used: set[str] = set()
    for node in graph:
        for i, v in enumerate(node.inputs):
            if v is None or not v.is_initializer():
                continue
            if i in NON_DIFFERENTIABLE_SLOTS.get(node.op_type, ()):
                frozen.add(v.name)
            else:
                used.add(v.name)
    names = []
    for name, v in graph.initializers.items():
        if name in frozen or name not in used or not is_float(v) or v.const_value is None:
            continue
        arr = v.const_value.numpy()
        if arr.size > 1 and np.all(np.isfinite(arr)) and float(np.max(np.abs(arr))) < 1e4:
            names.append(name)
    return names


def _load(model: Any, batch: int | None) -> ir.Model:
    from partitioner.load import load

    if isinstance(model, ir.Model):
        proto = ir.serde.serialize_model(model)
    elif isinstance(model, onnx.ModelProto):
        proto = model
    else:
        proto = None
    if batch is not None:
        proto = rebatch(proto if proto is not None else _read(model), batch)
    if proto is not None:
        opset = next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), STEP_OPSET)
        if opset < STEP_OPSET:
            proto = onnx.version_converter.convert_version(proto, STEP_OPSET)
        return load(proto)
    loaded = load(model)
    if loaded.opset_imports.get("", STEP_OPSET) < STEP_OPSET:
        return _load(ir.serde.serialize_model(loaded), None)
    return loaded


def _read(model: Any) -> onnx.ModelProto:
    from partitioner.load import load_proto

    return load_proto(model)


def rebatch(proto: onnx.ModelProto, batch: int) -> onnx.ModelProto:
    """The model with its data inputs' first dimension set to ``batch`` (shapes re-inferred).

    Intermediate shapes are dropped and inferred again; a model that bakes its batch into a
    Reshape constant fails ONNX's shape inference here, with the node named.
    """
    out = onnx.ModelProto()
    out.CopyFrom(proto)
    inits = {t.name for t in out.graph.initializer}
    del out.graph.value_info[:]
    for vi in out.graph.input:
        dims = vi.type.tensor_type.shape.dim
        if vi.name not in inits and len(dims):
            dims[0].Clear()
            dims[0].dim_value = batch
    for vi in out.graph.output:
        for d in vi.type.tensor_type.shape.dim:
            d.Clear()
    return out


def _promote(graph: ir.Graph, initial: dict[str, np.ndarray]):
    def promote(v: ir.Value) -> None:
        initial[v.name] = v.const_value.numpy().copy()
        graph.initializers.pop(v.name)
        v.const_value = None
        graph.inputs.append(v)

    return promote


def build_training_graph(
    model: ir.Model | onnx.ModelProto | str | os.PathLike[str],
    loss: str = "cross_entropy",
    trainable: Sequence[str] | None = None,
    optimizer: Optimizer | None = None,
    *,
    batch: int | None = None,
    world_size: int = 1,
    output: str | None = None,
    label_name: str = "labels",
    gradients_only: bool = False,
    bucket_bytes: int = 25 * 2**20,
    forward_rewrite: Any = None,
) -> ir.Model:
    """Build the training step of ``model`` (see the module docstring for the rules).

    ``batch`` rebinds the data inputs' first dimension (the per-rank batch for data
    parallelism); ``output`` picks the model output the loss applies to (default: the first).
    ``gradients_only`` builds no update: the outputs are ``loss`` and ``W.grad`` per weight
    (the gradient checks use it). ``bucket_bytes``: the most gradient bytes one AllReduce carries
    with ``world_size > 1`` (rule 5). ``forward_rewrite(model) -> model`` rewrites the loaded
    forward model first (tensor parallelism shards it; :mod:`partitioner.training.tensor`).
    """
    optimizer = optimizer or SGD()
    fwd = _load(model, batch)
    if forward_rewrite is not None:
        fwd = forward_rewrite(fwd)
    graph = fwd.graph
    out_value, spec, weights = _loss_target(graph, loss, output, label_name, trainable)
    dtype = out_value.dtype
    em = Emitter(graph, dtype)
    initial: dict[str, np.ndarray] = {}
    promote = _promote(graph, initial)
    data_inputs = [v.name for v in graph.inputs]

    w_values, bn_state, out_value = _checked_forward(fwd, em, promote, weights, out_value)

    labels = ir.Value(name=spec.name, shape=ir.Shape(spec.shape), type=ir.TensorType(spec.dtype))
    graph.inputs.append(labels)
    target = loss_input(loss, out_value)  # a Softmax output's logits (losses module docstring)
    loss_value, dout = emit_loss(loss, em, target, labels)
    if world_size > 1 and not gradients_only:  # rule 5: every gradient comes out already / R
        dout = em.op("Mul", dout, em.scalar(1.0 / world_size))
    grads = backward(graph, loss_value, {target.name: dout}, w_values, em)

    em.tag = "optimizer"
    if gradients_only:
        graph.outputs.clear()
        graph.outputs.append(loss_value)
        for w in w_values:
            graph.outputs.append(em.op("Identity", grads[w.name], _name=f"{w.name}.grad"))
        for v in w_values + [a for a, _ in bn_state]:  # BN statistics keep their values as defaults
            v.const_value = ir.tensor(initial[v.name], name=v.name)
            graph.initializers[v.name] = v
        sig = TrainingSignature(data=tuple(data_inputs), labels=spec.name, loss="loss", output=out_value.name,
                                weights=tuple(weights), state=tuple((w, w) for w in weights), loss_kind=loss)
        return _finish(fwd, sig, world_size=1)
    if world_size > 1:
        loss_value.name = "loss.local"
        grads, loss_value = _allreduce_buckets(em, grads, loss_value, w_values, world_size, dtype, bucket_bytes)
    pairs = _optimizer_updates(graph, em, optimizer, w_values, grads, initial, dtype, bn_state)
    if loss_value.name != "loss":
        loss_value = em.op("Identity", loss_value, _name="loss")
    graph.outputs.clear()
    graph.outputs.append(loss_value)
    for _, out in pairs:
        graph.outputs.append(out)
    # rule 2: defaults for every state input
    for v, _ in pairs:
        arr = initial[v.name]
        v.const_value = ir.tensor(arr, name=v.name)
        graph.initializers[v.name] = v
    sig = TrainingSignature(
        data=tuple(data_inputs), labels=spec.name, loss=loss_value.name, output=out_value.name,
        weights=tuple(weights), state=tuple((a.name, b.name) for a, b in pairs), loss_kind=loss,
        optimizer={"kind": type(optimizer).__name__, **asdict(optimizer)}, world_size=world_size)
    graph.name = f"{graph.name or 'model'}.train"
    return _finish(fwd, sig, world_size)


def _checked_forward(fwd: ir.Model, em: Emitter, promote: Any, weights: list[str],
                     out_value: ir.Value) -> tuple[list[ir.Value], list[tuple[ir.Value, ir.Value]], ir.Value]:
    """Rule 4 first (nothing is built when an op lacks a rule; the BN expansion's ops all have
    one), then the weights become state inputs and BatchNormalization trains in training mode.
    Returns the weight values, the BN statistics' state pairs and the (re-found) loss output."""
    graph = fwd.graph
    w_values = [graph.initializers[w] for w in weights]
    nodes, requires = differentiable_nodes(graph, set(weights), {out_value.name})
    check_rules([n for n in nodes if n.op_type != "BatchNormalization"
                 and any(o.name in requires for o in n.outputs)])
    for v in w_values:
        promote(v)
    out_name = out_value.name
    bn_state = expand_batchnorm(graph, em, promote)
    if bn_state or any(n.op_type == "BatchNormalization" for n in nodes):
        # the rules read static shapes (autodiff rule 5): infer those of the rewritten forward
        from onnx_ir.passes.common.shape_inference import ShapeInferencePass

        ShapeInferencePass()(fwd)
    return w_values, bn_state, next(o for o in graph.outputs if o.name == out_name)


def _loss_target(graph: ir.Graph, loss: str, output: str | None, label_name: str,
                 trainable: Sequence[str] | None) -> tuple[ir.Value, Any, list[str]]:
    """The output the loss applies to, the labels' spec and the trainable weights (checked)."""
    outputs = {o.name: o for o in graph.outputs}
    if output is not None and output not in outputs:
        raise UsageError(f"output {output!r} is not an output of the model; outputs: {', '.join(outputs)}")
    out_value = outputs[output] if output else graph.outputs[0]
    spec = label_spec(loss, out_value, label_name)
    weights = list(default_trainable(graph) if trainable is None else trainable)
    unknown = [w for w in weights if w not in graph.initializers]
    if unknown:
        raise UsageError(f"trainable {', '.join(unknown)}: not initializers of the model")
    if not weights:
        raise UsageError("nothing to train: the model has no float weights (pass trainable=[...])")
    return out_value, spec, weights


def _finish(fwd: ir.Model, sig: TrainingSignature, world_size: int) -> ir.Model:
    """Record the signature, raise the opset to the step's, add the comm domain when ranks
    exchange gradients, and infer every type."""
    fwd.metadata_props[SIGNATURE_KEY] = sig.to_json()
    fwd.opset_imports[""] = max(fwd.opset_imports.get("", STEP_OPSET), STEP_OPSET)
    from partitioner.core.comm_ops import DOMAIN, VERSION

    if world_size > 1 or any(n.domain == DOMAIN for n in fwd.graph):
        fwd.opset_imports[DOMAIN] = VERSION
    return _infer(fwd)


def _optimizer_updates(graph: ir.Graph, em: Emitter, optimizer: Optimizer, w_values: list[ir.Value],
                       grads: dict[str, ir.Value], initial: dict[str, np.ndarray], dtype: Any,
                       bn_state: list[tuple[ir.Value, ir.Value]]) -> list[tuple[ir.Value, ir.Value]]:
    """The optimizer's update of every weight, its slots (zero-initialised state inputs) and the
    step counter: the (state input, next state) pairs in the order the outputs list them (weights,
    BatchNormalization statistics, slots, step)."""
    step_in = step_out = None
    if optimizer.uses_step:
        step_in = ir.Value(name=STEP_NAME, shape=ir.Shape([]), type=ir.TensorType(dtype))
        initial[STEP_NAME] = np.zeros((), dtype=dtype.numpy())
        graph.inputs.append(step_in)
        step_out = em.op("Add", step_in, em.scalar(1.0), _name=f"{STEP_NAME}.next")
    state_pairs: list[tuple[ir.Value, ir.Value]] = []
    slot_pairs: list[tuple[ir.Value, ir.Value]] = []
    for w in w_values:
        slots = {}
        for slot in optimizer.slots:
            s = ir.Value(name=f"{w.name}.{slot}", shape=ir.Shape(w.shape), type=ir.TensorType(dtype))
            initial[s.name] = np.zeros(initial[w.name].shape, dtype=initial[w.name].dtype)
            graph.inputs.append(s)
            slots[slot] = s
        new_w, new_slots = optimizer.update(em, w, grads[w.name], slots, step_out)
        state_pairs.append((w, new_w))
        slot_pairs.extend((slots[k], new_slots[k]) for k in optimizer.slots)
    pairs = state_pairs + list(bn_state) + slot_pairs
    if step_in is not None:
        pairs.append((step_in, step_out))
    return pairs


def _infer(model: ir.Model) -> ir.Model:
    """Types and shapes of every emitted value, by ONNX's strict shape inference (which also
    checks that every emitted node is well formed)."""
    proto = ir.serde.serialize_model(model)
    try:
        proto = onnx.shape_inference.infer_shapes(proto, strict_mode=True)
    except Exception as exc:  # an emitted node that ONNX rejects is a bug of a rule
        raise RuntimeError(f"training step {proto.graph.name!r} fails ONNX shape inference: {exc}") from exc
    return ir.serde.deserialize_model(proto)


def _allreduce_buckets(em: Emitter, grads: dict[str, ir.Value], loss: ir.Value, w_values: Sequence[ir.Value],
                       world_size: int, dtype: ir.DataType, bucket_bytes: int) -> tuple[dict[str, ir.Value], ir.Value]:
    """Rule 5: flatten, bucket, AllReduce-mean and split back the gradients (and the loss)."""
    itemsize = dtype.itemsize
    order = list(reversed(w_values))  # the backward pass finishes the last layer's weights first
    buckets: list[list[ir.Value]] = [[]]
    size = 0
    for w in order:
        nbytes = int(np.prod(shape_of(w))) * itemsize
        if buckets[-1] and size + nbytes > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(w)
        size += nbytes
    out: dict[str, ir.Value] = {}
    loss_out = loss
    order = {id(n): i for i, n in enumerate(em.graph)}
    for b, members in enumerate(buckets):
        parts = [em.op("Reshape", grads[w.name], em.ints([-1])) for w in members]
        sizes = [int(np.prod(shape_of(w))) for w in members]
        scaled = []
        if b == 0:  # the local loss / R: the bucket's sum is the global mean
            scaled = [em.op("Mul", loss, em.scalar(1.0 / world_size))]
            parts.append(em.op("Reshape", scaled[0], em.ints([1])))
            sizes.append(1)
        flat = em.op("Concat", *parts, axis=0) if len(parts) > 1 else parts[0]
        mean = _allreduce_sum(em, flat, world_size, f"bucket{b}", ir.Shape([sum(sizes)]), dtype)
        _start_early(em.graph, [v.producer() for v in scaled] + [p.producer() for p in parts]
                     + ([flat.producer()] if len(parts) > 1 else []) + [mean.producer()],
                     [grads[w.name] for w in members] + ([loss] if b == 0 else []), order)
        pieces = em.op("Split", mean, em.ints(sizes), axis=0, _outputs=len(sizes))
        pieces = pieces if isinstance(pieces, tuple) else (pieces,)
        for w, piece in zip(members, pieces):
            out[w.name] = em.op("Reshape", piece, em.ints(shape_of(w)))
        if b == 0:
            loss_out = em.op("Reshape", pieces[-1], em.ints([]), _name="loss")
    return out, loss_out


def _start_early(graph: ir.Graph, nodes: list[ir.Node], needs: list[ir.Value], order: dict[int, int]) -> None:
    """Rule 5: move a bucket's flatten, concat and AllReduce ``nodes`` to right after the node
    that produces the last of the gradients they read (``order``: the positions before the
    buckets were emitted), so the AllReduce can run beside the rest of the backward pass."""
    producers = [v.producer() for v in needs if v.producer() is not None and id(v.producer()) in order]
    if not producers:
        return
    anchor = max(producers, key=lambda n: order[id(n)])
    graph.remove(nodes)
    graph.insert_after(anchor, nodes)


def _allreduce_sum(em: Emitter, g: ir.Value, world_size: int, tag_name: str, shape: ir.Shape,
                   dtype: ir.DataType) -> ir.Value:
    """Rule 5: ``AllReduce(sum)`` over every rank of gradients already scaled by ``1/world_size``
    (the mean). The comm output's type and shape are set here (ONNX inference does not know the
    comm domain)."""
    from partitioner.core.comm_ops import DOMAIN

    em._count += 1
    node = ir.Node(DOMAIN, "AllReduce", [g], attributes=ir.convenience.convert_attributes(
        {"group": list(range(world_size)), "reduction": "sum", "tag": 7000 + em._count}),
        num_outputs=1, name=f"allreduce.{tag_name}", metadata_props={"training.forward_node": "optimizer"})
    node.outputs[0].name = f"{tag_name}.sum"
    node.outputs[0].shape = ir.Shape(shape)
    node.outputs[0].type = ir.TensorType(dtype)
    em.graph.append(node)
    return node.outputs[0]


def initial_state(model: ir.Model | onnx.ModelProto) -> dict[str, np.ndarray]:
    """Rule 2: the start values of every state input (the defaults stored in the step)."""
    sig = signature(model)
    names = {a for a, _ in sig.state}
    if isinstance(model, ir.Model):
        return {n: model.graph.initializers[n].const_value.numpy().copy() for n in names}
    return {t.name: onnx.numpy_helper.to_array(t).copy() for t in model.graph.initializer if t.name in names}


def step_program(model: ir.Model | onnx.ModelProto) -> onnx.ModelProto:
    """The step as a ModelProto whose state inputs have no default (rule 2), for a backend."""
    proto = ir.serde.serialize_model(model) if isinstance(model, ir.Model) else model
    sig = signature(proto)
    names = {a for a, _ in sig.state}
    out = onnx.ModelProto()
    out.CopyFrom(proto)
    keep = [t for t in out.graph.initializer if t.name not in names]
    del out.graph.initializer[:]
    out.graph.initializer.extend(keep)
    return out


def state_feeds(state: Mapping[str, np.ndarray], sig: TrainingSignature) -> dict[str, np.ndarray]:
    return {a: state[a] for a, _ in sig.state}
