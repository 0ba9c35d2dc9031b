"""The training loop: ``train(model, data, ...)`` for one rank or data-parallel ranks.

Rules:

1. Data come from an ``.npz`` with ``x`` and ``y`` (or a dict of the same, or an iterable of
   ``(x, y)`` batches), checked before any
   step runs: a missing key, a sample shape that does not match the model's input, labels that
   are not integers in ``[0, classes)`` for cross-entropy: one :class:`InputError` line (exit 2).
2. Each epoch shuffles the samples with ``numpy.random.default_rng(seed + epoch)`` and runs
   ``len(x) // batch`` steps (the last partial batch is dropped, so every step has the same
   shape). With ``devices = R`` (strategy ``data``) rank r takes rows ``[r*b/R, (r+1)*b/R)`` of
   each global batch; the step's AllReduce makes every rank apply the global mean gradient.
   The ranks run as threads of this process over the project's in-process communicator, or as
   processes under ``mpiexec`` (``launcher="mpi"``, :mod:`partitioner.training.mpi_worker`).
3. State (weights, BN statistics, optimizer moments) stays in each rank's
   :class:`~partitioner.training.runner.StepRunner` between steps.
4. After each epoch a checkpoint is written: ``checkpoint_epoch<k>.onnx`` is the original model
   with the trained initializers (``partitioner compile`` deploys it as is) and
   ``checkpoint_epoch<k>.state.npz`` holds the optimizer state beside it; ``model.onnx`` is the
   latest, ``history.json`` the loss curve (one entry per step) and ``report.html`` its plot.
5. A NaN or infinite loss stops training at once, naming the epoch and step; the last good
   checkpoint is left as it was (:class:`RunFailed`, exit 1).
6. Gradient buckets (:mod:`partitioner.training.step` rule 5): at most :data:`BUCKET_BYTES` each,
   except on data-parallel TVM ranks of one thread, which AllReduce every gradient as one bucket
   (:func:`bucket_bytes`, :data:`TVM_ONE_BUCKET`). Such a rank has one core (each rank is
   pinned to its share), so the comm thread that overlaps a bucket's AllReduce with the rest of
   the backward (:mod:`partitioner.training.overlap` rule 2) only takes turns with it on that
   core, busy-polling while it waits for the peer, and each extra bucket cuts the backward into
   one more TVM library (the activations the later part reads cross as arrays). Measured on the
   zoo resnet (local batch 8, SGD, 2 MPI ranks, CPU per step of each rank, 3 interleaved rounds,
   load 5-8): 212.3 / 224.7 ms with one 45 MiB bucket against 225.1 / 243.0 ms with the two
   25 MiB ones; `benchmarks/train_step.py` paired (load 2.5-3.8, 2 rounds) 244.8 / 356.6 ms
   of wall against 321.7 / 511.5 with the same CPU on average (docs/training.md). ONNX Runtime
   ranks keep their buckets (not measured apart).
7. MPI ranks build their programs (TVM: minutes for a conv net's pipeline stage on a loaded
   machine) and then wait at a barrier for every rank to finish building, with a deadline of
   :data:`BUILD_WAIT_S` (``$PARTITIONER_BUILD_WAIT``), before the first step. Without it a rank
   that builds faster waited for its first message under the step's 30 s deadline
   (:mod:`partitioner.runtime.comm_mpi` rule 3): seen in session 19 at a load of 9, rank 1 of a
   TVM resnet 1F1B pipeline timed out on its first receive while rank 0 was still building. A rank whose
   build fails aborts every rank (:mod:`partitioner.training.mpi_worker`), so the barrier never
   waits on a dead peer.
"""

from __future__ import annotations

import json
import os
import resource
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import numpy_helper

from partitioner.core.env import env_number
from partitioner.core.errors import InputError, RunFailed, UsageError
from partitioner.training.losses import logits_shape
from partitioner.training.optimizers import Optimizer, make_optimizer
from partitioner.training.runner import StepRunner
from partitioner.training.step import build_training_graph, signature

STRATEGIES = ("data", "single", "auto", "pipeline", "tensor", "hybrid")
#: rule 6: the most gradient bytes one AllReduce carries (step rule 5's default)
BUCKET_BYTES = 25 * 2**20
#: rule 6: data-parallel TVM ranks of one thread AllReduce all their gradients as one bucket
#: (``$PARTITIONER_TRAIN_TVM_ONE_BUCKET=0``: :data:`BUCKET_BYTES` buckets, to measure it)
TVM_ONE_BUCKET = os.environ.get("PARTITIONER_TRAIN_TVM_ONE_BUCKET", "1") != "0"


#: rule 7: how long an MPI rank waits for the others to finish building (seconds)
BUILD_WAIT_S = 1800.0
BUILD_WAIT_ENV = "PARTITIONER_BUILD_WAIT"


def build_wait_s() -> float:
    """Rule 7's deadline: ``$PARTITIONER_BUILD_WAIT`` seconds, else :data:`BUILD_WAIT_S`."""
    return env_number(BUILD_WAIT_ENV, BUILD_WAIT_S, float, lambda v: v > 0, "a positive number of seconds")


def bucket_bytes(backend: str, threads: int) -> int:
    """Rule 6: the bucket size of a data-parallel rank on ``backend`` with ``threads`` threads."""
    return 1 << 62 if backend == "tvm" and threads == 1 and TVM_ONE_BUCKET else BUCKET_BYTES


@dataclass
class TrainResult:
    """The trained model (original graph, trained initializers) and the loss history."""

    model: onnx.ModelProto
    history: list[dict[str, Any]] = field(default_factory=list)
    checkpoints: list[str] = field(default_factory=list)


def load_data(data: Any) -> tuple[np.ndarray, np.ndarray]:
    """``x`` and ``y`` from an .npz path, a mapping with ``x`` and ``y``, or an iterable of
    ``(x, y)`` batches (concatenated in memory: the loop reshuffles every epoch)."""
    if not isinstance(data, (str, os.PathLike, Mapping)):
        try:
            pairs = list(data)
        except TypeError:
            raise InputError(f"cannot read data from a {type(data).__name__}; give an .npz path, a dict with x and y, "
                             "or an iterable of (x, y) batches") from None
        if not pairs or any(not isinstance(p, (tuple, list)) or len(p) != 2 for p in pairs):
            raise InputError("the data iterator must yield (x, y) pairs, and at least one")
        data = {"x": np.concatenate([np.asarray(p[0]) for p in pairs]),
                "y": np.concatenate([np.asarray(p[1]) for p in pairs])}
    if isinstance(data, Mapping):
        arrays, label = dict(data), "the data"
    else:
        label = str(data)
        if not os.path.isfile(data):
            raise InputError(f"{label}: no such file; give an .npz with arrays x and y")
        try:
            with np.load(data, allow_pickle=False) as z:
                arrays = {k: z[k] for k in z.files}
        except Exception as exc:  # noqa: BLE001 - a corrupt file is bad input
            raise InputError(f"{label}: cannot read it as .npz ({type(exc).__name__}: {exc})") from None
    missing = [k for k in ("x", "y") if k not in arrays]
    if missing:
        raise InputError(f"{label}: missing array(s) {', '.join(missing)}; the .npz needs x (inputs) and y (labels), "
                         f"found {', '.join(sorted(arrays)) or 'none'}")
    x, y = np.asarray(arrays["x"]), np.asarray(arrays["y"])
    if len(x) != len(y):
        raise InputError(f"{label}: x has {len(x)} samples but y has {len(y)}")
    return x, y


def _check_data(x: np.ndarray, y: np.ndarray, step_proto: onnx.ModelProto, loss: str, batch: int) -> None:
    sig = signature(step_proto)
    if len(sig.data) != 1:
        raise UsageError(f"the model has {len(sig.data)} data inputs ({', '.join(sig.data)}); train takes models "
                         "with one (x)")
    vi = {v.name: v for v in step_proto.graph.input}
    want = [d.dim_value for d in vi[sig.data[0]].type.tensor_type.shape.dim][1:]
    if list(x.shape[1:]) != want:
        raise InputError(f"x has samples of shape {list(x.shape[1:])} but the model's input {sig.data[0]!r} takes "
                         f"{want}")
    lab = [d.dim_value for d in vi[sig.labels].type.tensor_type.shape.dim][1:]
    if list(y.shape[1:]) != lab:
        raise InputError(f"y has labels of shape {list(y.shape[1:])} but loss {loss} on this model needs {lab}")
    if loss == "cross_entropy":
        out = next(o for o in step_proto.graph.value_info if o.name == sig.output) if sig.output not in vi else None
        classes = (logits_shape(tuple(d.dim_value for d in out.type.tensor_type.shape.dim))[-1]
                   if out is not None else None)
        if y.dtype.kind not in "iu":
            raise InputError(f"y is {y.dtype}; cross_entropy needs integer class labels")
        if classes and (y.min() < 0 or y.max() >= classes):
            raise InputError(f"y has labels in [{y.min()}, {y.max()}] but the model has {classes} classes "
                             f"(labels must be in [0, {classes - 1}])")
    if len(x) < batch:
        raise InputError(f"the data have {len(x)} samples, fewer than one batch of {batch}")


def checkpoint_model(model: onnx.ModelProto, weights: Mapping[str, np.ndarray]) -> onnx.ModelProto:
    """The original model with its initializers replaced by the trained ``weights``."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    for i, t in enumerate(out.graph.initializer):
        if t.name in weights:
            dtype = onnx.helper.tensor_dtype_to_np_dtype(t.data_type)
            out.graph.initializer[i].CopyFrom(numpy_helper.from_array(np.asarray(weights[t.name]).astype(dtype), t.name))
    return out


def without_weights(model: onnx.ModelProto, names: Any) -> onnx.ModelProto:
    """``model`` with the data of the trained initializers ``names`` dropped (names, types and
    shapes kept): :func:`checkpoint_model` fills every one of them from the state, so a rank
    need not hold a second copy of the whole model's weights while it trains."""
    names = set(names)
    out = onnx.ModelProto()
    out.CopyFrom(model)
    for t in out.graph.initializer:
        if t.name in names:
            name, dims, dtype = t.name, list(t.dims), t.data_type
            t.Clear()
            t.name, t.data_type = name, dtype
            t.dims.extend(dims)
    return out


def train(model: Any, data: Any, *, loss: str = "cross_entropy", optimizer: str | Optimizer = "sgd",
          lr: float = 0.01, weight_decay: float = 0.0, batch: int = 32, epochs: int = 1, devices: int = 1,
          strategy: str = "data", backend: str = "onnxruntime", out_dir: str | os.PathLike[str] | None = None,
          seed: int = 0, progress: bool = True, trainable: list[str] | None = None,
          launcher: str = "threads", comm: Any = None,
          resume: str | os.PathLike[str] | None = None, threads: int = 1, schedule: str = "1f1b",
          micro_batches: int | None = None, stages: int | None = None,
          memory_limit: float | None = None) -> TrainResult:
    """Train ``model`` on ``data`` (see the module docstring); returns the trained model and history.

    ``launcher``: ``threads`` runs the data-parallel ranks in this process (the project's
    in-process communicator); ``mpi`` starts ``devices`` processes under ``mpiexec``
    (:mod:`partitioner.training.mpi_worker`), each with its own state, and reads rank 0's
    results from ``out_dir``. ``comm`` is set by that worker: this process is one MPI rank.
    ``resume``: a ``checkpoint_epoch<k>.onnx`` of the same model and its saved state (any plan and
    device count: checkpoints hold the 1-rank state). ``threads``: intra-op threads per rank.
    ``pipeline`` / ``hybrid`` / ``tensor``, ``schedule``, ``micro_batches`` (default 2 x devices),
    ``stages`` and ``memory_limit``: docs/training.md ("Pipeline, tensor and hybrid training").
    """
    from partitioner.load import load_proto

    strategy = _auto(model, strategy, devices, batch, optimizer, micro_batches, progress and comm is None,
                     memory_limit if comm is None else None)
    pipelined = _check_options(strategy, devices, batch, epochs, launcher)
    opt = make_optimizer(optimizer, lr, weight_decay) if isinstance(optimizer, str) else optimizer
    x, y = load_data(data)
    checked = load_proto(model, batch=batch)  # validated; a symbolic batch is bound for the step
    # the checkpoint keeps the model as given (a symbolic batch stays symbolic)
    original = (onnx.load(str(model)) if isinstance(model, (str, os.PathLike)) and os.path.isfile(model)
                else model if isinstance(model, onnx.ModelProto) else checked)
    local = batch if pipelined else batch // devices
    step = build_training_graph(checked, loss=loss, optimizer=opt, batch=local, world_size=1 if pipelined else devices,
                                trainable=trainable, bucket_bytes=bucket_bytes(backend, threads))
    from partitioner.training.step import step_program

    _check_data(x, y, step_program(step), loss, batch)  # bad input is refused before any rank starts
    start = resume_state(resume, original, step) if resume is not None else None
    out = Path(out_dir) if out_dir is not None else None
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
    if launcher == "mpi" and devices > 1 and comm is None:
        build_wait_s()  # rule 7: a bad $PARTITIONER_BUILD_WAIT is refused here, before any rank starts
        options = {"loss": loss, "optimizer": optimizer if isinstance(optimizer, str) else None, "lr": lr,
                   "weight_decay": weight_decay, "batch": batch, "epochs": epochs, "devices": devices,
                   "strategy": strategy, "backend": backend, "seed": seed, "progress": progress,
                   "trainable": trainable, "threads": threads, "schedule": schedule, "micro_batches": micro_batches, "stages": stages, "memory_limit": memory_limit,
                   "resume": str(Path(resume).resolve()) if resume is not None else None}
        return _launch_mpi(model, data, out, options, original)

    if pipelined and strategy == "tensor":
        from partitioner.training.tensor import tensor_runners

        ranks, runners = tensor_runners(checked, loss, opt, batch=batch, devices=devices, trainable=trainable,
                                        backend=backend, comm=comm, out=out, threads=threads, state=start)
    elif pipelined:
        from partitioner.training.pipeline_runner import pipeline_runners

        ranks, runners = pipeline_runners(checked, loss, opt, batch=batch, devices=devices, schedule=schedule,
                                          micro_batches=micro_batches or 2 * devices, trainable=trainable,
                                          backend=backend, comm=comm, out=out, threads=threads, state=start,
                                          stages=(stages or 2) if strategy == "hybrid" else devices,
                                          memory_limit=memory_limit)
    else:
        ranks, runners = _data_runners(step, devices, backend=backend, comm=comm, out=out, start=start,
                                       threads=threads)
    if comm is not None:  # rule 7: every MPI rank built its programs before any rank steps
        comm.fault.maybe_fail("built")
        comm.barrier(timeout_s=build_wait_s(), what="waiting for every rank to finish building")
    writer = ranks[0] == 0
    sig = signature(step)
    # the build's copies of the weights are dropped before the steps (memory_window rule 2)
    original = without_weights(original, sig.weights)
    del step, checked, start
    return _loop(runners, ranks, sig, original, x, y, loss=loss, batch=batch, local=local, epochs=epochs,
                 seed=seed, out=out if writer else None, progress=progress and writer, devices=devices, run_dir=out)


def _data_runners(step: Any, devices: int, *, backend: str, comm: Any, out: Path | None, start: Any,
                  threads: int) -> tuple[list[int], list[StepRunner]]:
    """One MPI rank's runner (``comm``), or every data-parallel rank's in this process."""
    if comm is not None:  # one MPI rank of ``devices``
        return [comm.rank], [StepRunner(step, backend=backend, comm=comm, state=start, threads=threads,
                                        workdir=out / f"rank{comm.rank}" if out else None)]
    if devices == 1:
        return [0], [StepRunner(step, backend=backend, workdir=out, state=start, threads=threads)]
    from partitioner.runtime.comm_local import LocalWorld

    world = LocalWorld(devices)
    return list(range(devices)), [StepRunner(step, backend=backend, comm=world.communicator(r), workdir=out,
                                             state=start, threads=threads) for r in range(devices)]


def _auto(model: Any, strategy: str, devices: int, batch: int, optimizer: Any, micro_batches: int | None,
          say: bool, memory_limit: float | None = None) -> str:
    """``--strategy auto`` on several devices: the training cost model's fastest plan that fits
    ``memory_limit`` (:func:`partitioner.training.plan.choose_strategy`), named on stderr when
    ``say``. A given strategy whose predicted peak memory per rank exceeds the limit is refused."""
    import sys

    from partitioner.training.plan import choose_strategy, predict_training

    name = optimizer if isinstance(optimizer, str) else type(optimizer).__name__
    if strategy != "auto" or devices == 1:
        if memory_limit is not None and strategy in ("data", "single", "pipeline", "tensor", "auto"):
            kind = "single" if devices == 1 else strategy
            peak = max(predict_training(model, kind, devices, batch=batch, optimizer=name, micro_batches=micro_batches,
                                        memory_limit=memory_limit).memory_per_rank)
            if peak > memory_limit:
                raise UsageError(f"train --strategy {strategy} on {devices} device(s): predicted peak memory per rank "
                                 f"{peak / 2**20:.1f} MiB exceeds --memory-limit {memory_limit / 2**20:.1f} MiB; "
                                 "use more devices or --strategy auto")
        return strategy
    chosen, preds = choose_strategy(model, devices, batch=batch, optimizer=name, micro_batches=micro_batches,
                                    memory_limit=memory_limit)
    if say:
        sys.stderr.write(f"train --strategy auto: {chosen} (predicted samples/s: "
                         f"{', '.join(f'{k} {p.samples_per_s:.0f}' for k, p in preds.items())})\n")
    return chosen


def _check_options(strategy: str, devices: int, batch: int, epochs: int, launcher: str) -> bool:
    """Refuse bad options (one line, exit 2); returns whether the run is pipelined."""
    if strategy not in STRATEGIES:
        raise UsageError(f"train --strategy {strategy}: unknown; choose one of {', '.join(STRATEGIES)}")
    if devices < 1 or batch < 1 or epochs < 1:
        raise UsageError("--devices, --batch and --epochs must be at least 1")
    if strategy == "single" and devices != 1:
        raise UsageError("--strategy single runs on one device; give --devices 1")
    pipelined = strategy in ("pipeline", "tensor", "hybrid") and devices > 1  # every rank reads the whole batch
    if batch % devices and not pipelined:
        raise UsageError(f"--batch {batch} does not split evenly over {devices} devices")
    if launcher not in ("threads", "mpi"):
        raise UsageError(f"unknown launcher {launcher!r}; choose threads or mpi")
    return pipelined


def resume_state(path: str | os.PathLike[str], original: onnx.ModelProto, step: Any) -> dict[str, np.ndarray]:
    """The start state from a checkpoint (rule 4's files), refused when it is of another model."""
    from partitioner.training.step import initial_state

    path = Path(path)
    if not path.is_file():
        raise InputError(f"--resume {path}: no such checkpoint")
    try:
        ckpt = onnx.load(str(path))
    except Exception as exc:  # noqa: BLE001 - a corrupt file is bad input
        raise InputError(f"--resume {path}: not an ONNX checkpoint ({type(exc).__name__})") from None
    mine = {t.name: tuple(t.dims) for t in original.graph.initializer}
    theirs = {t.name: tuple(t.dims) for t in ckpt.graph.initializer}
    if [n.op_type for n in ckpt.graph.node] != [n.op_type for n in original.graph.node] or mine != theirs:
        raise InputError(f"--resume {path}: a checkpoint of another model (its graph or weights differ from "
                         f"{original.graph.name or 'the model'}'s)")
    state = initial_state(step)
    weights = {t.name: numpy_helper.to_array(t) for t in ckpt.graph.initializer}
    saved = path.with_name(path.name[: -len(".onnx")] + ".state.npz")
    if saved.is_file():
        with np.load(saved, allow_pickle=False) as z:
            weights.update({k: z[k] for k in z.files})
    for name, value in state.items():
        if name in weights and weights[name].shape == value.shape:
            state[name] = weights[name].astype(value.dtype)
    return state


def _loop(runners: list[StepRunner], ranks: list[int], sig: Any, original: onnx.ModelProto, x: np.ndarray,
          y: np.ndarray, *, loss: str, batch: int, local: int, epochs: int, seed: int, out: Path | None,
          progress: bool, devices: int, run_dir: Path | None = None) -> TrainResult:
    """The epochs; ``out``: where this rank writes (rank 0's run folder, or None); ``run_dir``:
    the run folder every rank names in a NaN error (rank 0 wrote those checkpoints)."""
    from tqdm import tqdm

    steps_per_epoch = len(x) // batch
    history: list[dict[str, Any]] = []
    checkpoints: list[str] = []
    bar = tqdm(total=steps_per_epoch * epochs, disable=None if progress else True, unit="step", dynamic_ncols=True)
    y_dtype = np.int64 if loss == "cross_entropy" else np.float32
    x_dtype = np.int64 if x.dtype.kind in "iu" else np.float32  # token ids stay integers (bert, gpt)
    from partitioner.training.memory_window import CURRENT as window

    window.start_steps(sum(int(a.nbytes) for r in runners for a in r.state.values()))
    try:
        for epoch in range(1, epochs + 1):
            order = np.random.default_rng(seed + epoch).permutation(len(x))
            for k in range(steps_per_epoch):
                idx = order[k * batch:(k + 1) * batch]
                xb, yb = x[idx].astype(x_dtype, copy=False), y[idx].astype(y_dtype, copy=False)
                f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                t0, c0 = time.perf_counter(), time.process_time()
                value = _run_step(runners, ranks, sig.data[0], xb, yb, local)
                dt, cpu = time.perf_counter() - t0, time.process_time() - c0
                faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
                step_no = (epoch - 1) * steps_per_epoch + k + 1
                if not np.isfinite(value):
                    last = checkpoints[-1] if checkpoints else "none written yet"
                    raise RunFailed(f"the loss is {value} at step {step_no} (epoch {epoch}); training stopped; "
                                    f"last good checkpoint: {last}")
                history.append({"step": step_no, "epoch": epoch, "loss": value, "samples_per_s": batch / dt,
                                "cpu_s": cpu,  # this process's CPU seconds (all its threads)
                                "minor_faults": faults})  # the process's page faults during the step
                bar.set_postfix(loss=f"{value:.4f}", samples_s=f"{batch / dt:.0f}")
                bar.update(1)
            window.end_steps()
            state = _full_state(runners)  # collective with pipeline stages on MPI ranks
            trained = checkpoint_model(original, state)
            if out is not None:
                path = out / f"checkpoint_epoch{epoch}.onnx"
                onnx.save(trained, str(path))
                np.savez(out / f"checkpoint_epoch{epoch}.state.npz", **state)
                onnx.save(trained, str(out / "model.onnx"))
                checkpoints.append(str(path))
                settings = {"loss": loss, "optimizer": sig.optimizer, "devices": devices, "batch": batch}
                (out / "history.json").write_text(json.dumps({**settings, "checkpoints": checkpoints,
                                                              "steps": history}, indent=1))
                from partitioner.training.report import run_report_html

                (out / "report.html").write_text(run_report_html(settings, history, checkpoints))
            elif run_dir is not None:  # rank 0 has written it before any rank can run the next step
                checkpoints.append(str(run_dir / f"checkpoint_epoch{epoch}.onnx"))
            del state
            window.after_checkpoint()
    finally:
        bar.close()
    return TrainResult(trained, history, checkpoints)


def _full_state(runners: list[Any]) -> dict[str, np.ndarray]:
    """The whole state (every stage's, for pipeline runners; a data-parallel rank holds it all)."""
    gather = getattr(runners[0], "gather_state", None)
    return gather(runners) if gather is not None else dict(runners[0].state)


def _launch_mpi(model: Any, data: Any, out: Path | None, options: dict[str, Any],
                original: onnx.ModelProto) -> TrainResult:
    """Start the ranks under mpiexec; rank 0 writes the run folder, read back here."""
    import tempfile

    from partitioner.runtime.launch import launch_mpi

    if out is None:
        out = Path(tempfile.mkdtemp(prefix="partitioner-train-"))
    if options["optimizer"] is None:
        raise UsageError("launcher mpi takes the optimizer by name (sgd, momentum, adam)")
    if not isinstance(model, (str, os.PathLike)) or not isinstance(data, (str, os.PathLike)):
        raise UsageError("launcher mpi takes the model and the data as file paths (every rank reads them)")
    config = out / "train_config.json"
    config.write_text(json.dumps({"model": os.path.abspath(model), "data": os.path.abspath(data),
                                  "out_dir": str(out.resolve()), **options}))
    launch_mpi(out, int(options["devices"]), ["--config", str(config)], module="partitioner.training.mpi_worker")
    doc = json.loads((out / "history.json").read_text())
    return TrainResult(onnx.load(str(out / "model.onnx")), doc["steps"], doc.get("checkpoints", []))


def _run_step(runners: list[StepRunner], ranks: list[int], data_name: str, xb: np.ndarray, yb: np.ndarray,
              local: int) -> float:
    if getattr(runners[0], "global_batch", False):
        local, ranks = 0, [0] * len(ranks)  # every pipeline stage takes the whole batch
    if len(runners) == 1:
        sl = slice(ranks[0] * local, (ranks[0] + 1) * local) if local else slice(None)
        return runners[0].step({data_name: xb[sl]}, yb[sl])
    losses: list[float] = [float("nan")] * len(runners)
    errors: list[BaseException] = []

    def work(r: int) -> None:
        try:
            sl = slice(r * local, (r + 1) * local) if local else slice(None)
            losses[r] = runners[r].step({data_name: xb[sl]}, yb[sl])
        except BaseException as exc:  # noqa: BLE001 - re-raised below, naming the rank
            errors.append(exc)
            runners[r].comm.world.abort(f"rank {r}: {exc}") if hasattr(runners[r].comm, "world") else None

    threads = [threading.Thread(target=work, args=(r,), daemon=True) for r in range(len(runners))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return losses[0]
