"""An ``onnx.backend.base.Backend`` that runs ONNX models through the project's whole pipeline.

``PartitionerBackend.prepare(model, device)``:

1. ``partitioner.load.load(model)``: validation, static shapes, strict shape inference;
2. ``passes.run_pipeline(model)``: the default passes, verified after each one;
3. 1 rank: the optimised model itself is the program; 2 ranks: ``partitioner.partition.partition``
   over ``cpu:2`` (``auto``; when auto keeps one device, the first fixed strategy that splits);
4. each program is built and loaded with the TVM backend's contract (:func:`compile_program`:
   ``backends.tvm.build`` into a temporary folder, then ``backends.tvm.load``) and run with a ``LocalWorld``
   communicator, one thread per rank, inputs scattered and outputs gathered by
   :mod:`partitioner.core.bindings`.

With ``fallback="onnxruntime"``, the case goes through the product's own path for
``partitioner compile --fallback onnxruntime``: :func:`partitioner.compiler.build_artifact` with
``fallback="onnxruntime"`` (per-segment: only the runs of ops TVM cannot import go to ONNX
Runtime inside the TVM rank; a rank whose TVM build fails falls back whole), then each rank is
loaded with the artifact's backend. So the fallback row measures what a user gets. The prepared
rep records what ran (:attr:`PartitionerRep.engine`: ``tvm``, ``tvm+onnxruntime-segments`` or
``onnxruntime``).

Shape inputs: a static compiler needs the values that decide shapes at compile time (TVM's
importer refuses a Reshape whose shape, or a Reduce whose axes, is a runtime tensor, and the
project's loader needs static shapes). With ``specialise=True`` (the default), graph inputs
that feed a shape-deciding slot (:data:`SHAPE_SLOTS`: Reshape's shape, Slice's starts/ends,
Reduce axes, Resize sizes/scales, ...) are bound to the values given to ``run`` as
initializers, and the model is compiled for them on first use (once per distinct value set).
The rep says which inputs it specialised (:attr:`PartitionerRep.specialised`), and the runner
counts those cases apart.

Every refusal is a :class:`partitioner.core.errors.PartitionerError`; anything else escaping
``prepare``/``run`` is a bug of the project and is reported as such by the runner.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import onnx
from onnx.backend.base import Backend, BackendRep

from partitioner.core.errors import BackendError, PartitionerError, StrategyNotApplicable

FALLBACKS = (None, "onnxruntime")
# op type -> input slots whose values decide output shapes (or are attributes in older opsets),
# plus the few slots TVM's importer reads as constants (Pad's constant_value).
SHAPE_SLOTS: dict[str, tuple[int, ...]] = {
    "Reshape": (1,), "Expand": (1,), "Tile": (1,), "ConstantOfShape": (0,), "Slice": (1, 2, 3, 4),
    "Pad": (1, 2, 3), "Resize": (1, 2, 3), "Upsample": (1,), "Squeeze": (1,), "Unsqueeze": (1,), "TopK": (1,),
    "Split": (1,), "OneHot": (1,), "Range": (0, 1, 2), "CenterCropPad": (1,), "Trilu": (1,), "CumSum": (1,),
    "DFT": (1, 2), "STFT": (1, 3), "AffineGrid": (1,), "Col2Im": (1, 2), "BlackmanWindow": (0,),
    "HannWindow": (0,), "HammingWindow": (0,), "MelWeightMatrix": (0, 1, 2, 3, 4),
    "ReduceSum": (1,), "ReduceMean": (1,), "ReduceMax": (1,), "ReduceMin": (1,), "ReduceProd": (1,),
    "ReduceL1": (1,), "ReduceL2": (1,), "ReduceLogSum": (1,), "ReduceLogSumExp": (1,), "ReduceSumSquare": (1,),
    "NonMaxSuppression": (2, 3, 4), "RandomNormalLike": (), "Multinomial": (),
}
SPLIT_STRATEGIES = ("data", "tensor", "spatial", "pipeline")
_TARGET: dict[str, Any] | None = None


def host_target() -> dict[str, Any]:
    """The host LLVM target dict, detected once per process."""
    global _TARGET
    if _TARGET is None:
        from backends.tvm.target import detect_host_target

        _TARGET = detect_host_target()
    return _TARGET


def compile_program(program: onnx.ModelProto, target: dict[str, Any] | None = None) -> Any:
    """Build ``program`` with the TVM backend's own contract and load it: ``backends.tvm.build``
    (lower, CPU pipeline, ``tvm.compile``, ``export_library``) into a fresh temporary folder,
    then ``backends.tvm.load``. The folder is deleted once the library is loaded (nothing is
    cached across cases or runs). Going through the real ``.so`` path, rather than running the
    ``tvm.compile`` result directly, keeps the suite honest about export and load too and
    does not depend on the executable's internals.
    """
    import backends.tvm as bt

    with tempfile.TemporaryDirectory(prefix="conformance-") as tmp:
        path = Path(tmp) / f"rank0{bt.FILE_SUFFIX}"
        bt.build(program, path, target=target or host_target())
        return bt.load(program, path, threads=1)


@dataclass(frozen=True)
class Compiled:
    """What ``prepare`` made: per-rank executables, their bindings, and how they were made."""

    executables: tuple[Any, ...]
    bindings: Any  # partitioner.core.bindings.Bindings, or None for the 1-rank program
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    engine: str  # "tvm", "tvm+onnxruntime-segments" or "onnxruntime" (what ran; see the module docstring)
    strategy: str  # "single" for 1 rank, else the strategy that split the model


def _load_and_optimise(model: onnx.ModelProto) -> Any:
    import passes
    from partitioner.load import load

    return passes.run_pipeline(load(model))


def _make_executable(program: onnx.ModelProto) -> Any:
    from backends.tvm.lower import check_supported

    check_supported(program)
    return compile_program(program)


def _build_as_product(programs: Sequence[onnx.ModelProto], bindings: Any, source: onnx.ModelProto,
                      fallback: str) -> tuple[tuple[Any, ...], Any, str]:
    """Build ``programs`` exactly as ``partitioner compile --fallback <fallback>`` does (an artifact
    in a temporary folder), load every rank with the artifact's backend, and say what ran."""
    from backends import get_backend
    from partitioner.compiler import build_artifact

    with tempfile.TemporaryDirectory(prefix="conformance-fallback-") as tmp:
        art = build_artifact(Path(tmp) / "artifact", list(programs), bindings, source=source, backend="tvm",
                             target=host_target(), jobs=1, fallback=fallback, progress=False)
        backend = get_backend(art.backend)
        exes = tuple(backend.load(art.programs[r], art.backend_file(r), threads=1) for r in range(art.world_size))
        note = art.manifest.get("fallback")
        engine = ("tvm" if not note else "tvm+onnxruntime-segments" if note.get("scope") == "segments"
                  else "onnxruntime")
        return exes, art.bindings, engine


def _split(ir_model: Any) -> tuple[Any, str]:
    """Partition over 2 CPU ranks: ``auto`` first; if it keeps one device, the first fixed
    strategy that splits. Raises StrategyNotApplicable when none does."""
    from partitioner.cluster import Cluster
    from partitioner.partition import partition

    cluster = Cluster.resolve("cpu:2")
    reasons = []
    for strategy in ("auto", *SPLIT_STRATEGIES):
        try:
            res = partition(ir_model, cluster, strategy=strategy, **({} if strategy == "auto" else {"degree": 2}))
        except StrategyNotApplicable as exc:
            reasons.append(f"{strategy}: {str(exc).splitlines()[0]}")
            continue
        if res.bindings.world_size >= 2:
            return res, f"{strategy}:{res.plan.strategy}" if strategy == "auto" else strategy
        reasons.append(f"{strategy}: world size {res.bindings.world_size}")
    raise StrategyNotApplicable("no strategy splits this model over 2 ranks (" + "; ".join(reasons)[:300] + ")")


def compile_model(model: onnx.ModelProto, *, ranks: int = 1, fallback: str | None = None) -> Compiled:
    """Load, optimise, (partition,) and compile ``model``; see the module docstring."""
    import onnx_ir as ir

    if fallback not in FALLBACKS:
        raise BackendError(f"fallback {fallback!r} is not one of {FALLBACKS}")
    if ranks not in (1, 2):
        raise BackendError(f"ranks={ranks}: the conformance backend runs 1 or 2 ranks")
    optimised = _load_and_optimise(model)
    init_names = {v.name for v in model.graph.initializer}
    inputs = tuple(v.name for v in model.graph.input if v.name not in init_names)
    outputs = tuple(v.name for v in model.graph.output)
    if fallback:
        from partitioner.partition import partition

        res, strategy = ((partition(optimised, "cpu:1", strategy="single"), "single") if ranks == 1
                         else _split(optimised))
        exes, bindings, engine = _build_as_product(res.programs, res.bindings, model, fallback)
        return Compiled(exes, bindings, inputs, outputs, engine, strategy)
    if ranks == 1:
        program = ir.serde.serialize_model(optimised)
        return Compiled((_make_executable(program),), None, inputs, outputs, "tvm", "single")
    res, strategy = _split(optimised)
    exes = tuple(_make_executable(p) for p in res.programs)
    return Compiled(exes, res.bindings, inputs, outputs, "tvm", strategy)


def run_compiled(compiled: Compiled, feeds: dict[str, np.ndarray], timeout_s: float = 60.0) -> dict[str, np.ndarray]:
    """Run every rank (threads over one LocalWorld) and return the global outputs by name."""
    from partitioner.runtime.comm_local import LocalWorld

    if compiled.bindings is None:
        world = LocalWorld(1, timeout_s=timeout_s)
        return compiled.executables[0].run(feeds, world.communicator(0))

    from partitioner.runtime.in_process import run_in_threads

    return run_in_threads(compiled.executables, compiled.bindings, feeds, timeout_s=timeout_s)


def shape_inputs(model: onnx.ModelProto) -> tuple[str, ...]:
    """Graph inputs (not initializers) read by a top-level node at a :data:`SHAPE_SLOTS` slot."""
    init_names = {t.name for t in model.graph.initializer}
    inputs = [v.name for v in model.graph.input if v.name not in init_names]
    wanted = set()
    for node in model.graph.node:
        if node.domain not in ("", "ai.onnx"):
            continue
        for slot in SHAPE_SLOTS.get(node.op_type, ()):
            if slot < len(node.input) and node.input[slot] in inputs:
                wanted.add(node.input[slot])
    return tuple(n for n in inputs if n in wanted)


def specialise_model(model: onnx.ModelProto, values: dict[str, np.ndarray]) -> onnx.ModelProto:
    """A copy of ``model`` whose inputs named in ``values`` are initializers holding them."""
    from onnx import numpy_helper

    out = onnx.ModelProto()
    out.CopyFrom(model)
    keep = [v for v in out.graph.input if v.name not in values]
    del out.graph.input[:]
    out.graph.input.extend(keep)
    for name, value in values.items():
        out.graph.initializer.append(numpy_helper.from_array(np.asarray(value), name))
    return out


class PartitionerRep(BackendRep):
    """A prepared model: ``run(inputs)`` takes positional inputs in graph-input order.

    Without shape inputs to specialise, the model is compiled by ``prepare``; otherwise on the
    first ``run`` with a given set of shape-input values (see the module docstring).
    """

    def __init__(self, model: onnx.ModelProto, *, ranks: int, fallback: str | None, specialise: bool) -> None:
        init_names = {v.name for v in model.graph.initializer}
        self.model = model
        self.inputs = tuple(v.name for v in model.graph.input if v.name not in init_names)
        self.outputs = tuple(v.name for v in model.graph.output)
        self.ranks, self.fallback = ranks, fallback
        self.specialised = shape_inputs(model) if specialise else ()
        self._compiled: dict[bytes, Compiled] = {}
        self.compiled: Compiled | None = None
        if not self.specialised:
            self.compiled = compile_model(model, ranks=ranks, fallback=fallback)

    @property
    def engine(self) -> str:
        return self.compiled.engine if self.compiled else ""

    def _for(self, feeds: dict[str, np.ndarray]) -> tuple[Compiled, dict[str, np.ndarray]]:
        if not self.specialised:
            assert self.compiled is not None
            return self.compiled, feeds
        fixed = {n: feeds[n] for n in self.specialised}
        key = b"".join(n.encode() + b"\0" + str(v.dtype).encode() + repr(v.shape).encode() + v.tobytes()
                       for n, v in fixed.items())
        if key not in self._compiled:
            self._compiled[key] = compile_model(specialise_model(self.model, fixed), ranks=self.ranks,
                                                fallback=self.fallback)
        self.compiled = self._compiled[key]
        return self.compiled, {n: v for n, v in feeds.items() if n not in fixed}

    def run(self, inputs: Any, **kwargs: Any) -> tuple[np.ndarray, ...]:
        if isinstance(inputs, dict):
            feeds = dict(inputs)
        else:
            seq = [inputs] if isinstance(inputs, np.ndarray) else list(inputs)
            if len(seq) != len(self.inputs):
                raise BackendError(f"{len(seq)} input(s) given, the model takes {len(self.inputs)}: "
                                   f"{', '.join(self.inputs)}")
            feeds = dict(zip(self.inputs, seq))
        compiled, rest = self._for({k: np.asarray(v) for k, v in feeds.items()})
        out = run_compiled(compiled, rest)
        return tuple(out[name] for name in self.outputs)


class PartitionerBackend(Backend):
    """``prepare(model, device, ranks=1, fallback=None, specialise=True)``; CPU only."""

    ranks: int = 1
    fallback: str | None = None
    specialise: bool = True

    @classmethod
    def is_compatible(cls, model: onnx.ModelProto, device: str = "CPU", **kwargs: Any) -> bool:
        return True

    @classmethod
    def prepare(cls, model: onnx.ModelProto, device: str = "CPU", **kwargs: Any) -> PartitionerRep:
        ranks = int(kwargs.pop("ranks", cls.ranks))
        fallback = kwargs.pop("fallback", cls.fallback)
        specialise = bool(kwargs.pop("specialise", cls.specialise))
        if device.upper() != "CPU":
            raise BackendError(f"device {device!r}: the conformance backend runs on the CPU only")
        return PartitionerRep(model, ranks=ranks, fallback=fallback, specialise=specialise)

    @classmethod
    def run_node(cls, node: onnx.NodeProto, inputs: Any, device: str = "CPU", outputs_info: Sequence[Any] | None = None,
                 **kwargs: Any) -> tuple[np.ndarray, ...]:
        raise BackendError("run_node is not supported; build a model (onnx.helper.make_model) and call prepare")

    @classmethod
    def supports_device(cls, device: str) -> bool:
        return device.upper() == "CPU"


class TwoRankBackend(PartitionerBackend):
    ranks = 2


class FallbackBackend(PartitionerBackend):
    fallback = "onnxruntime"
