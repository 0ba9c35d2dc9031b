"""The compile driver: the only ``compile()`` (load → passes → partition → report → build → write).

The CLI (``partitioner compile``) and the Python API (``partitioner.compile``) both call it.

Rules:
1. One load-and-passes path: :func:`prepare` loads and validates a model (path, ModelProto, zoo
   name), binds its shapes and runs the passes; everything that needs an optimised model calls it.
2. One cluster resolver: :func:`partitioner.cluster.resolve_cluster`.
3. The backend build runs inside the artifact's staging directory
   (:func:`partitioner.artifact.write_artifact`); only ``rank<i><suffix>`` is kept from it. A
   failed build falls back to ``fallback`` when asked; the TVM backend's per-segment ONNX Runtime
   fallback is its own (:mod:`backends.tvm.fallback`).
4. :class:`Artifact` is the artifact view of :mod:`partitioner.artifact` plus :meth:`Artifact.run`:
   the run sits up here, on top of the runtime, so that the runtime only ever calls
   :func:`partitioner.artifact.load_artifact` and never the reverse.
5. A TVM build learns the threads each rank will run on (``build_options["threads"]``, unless the
   caller set it): :func:`partitioner.cost.threads.build_threads` (this machine's cores // ranks
   on a one-node CPU cluster, None otherwise); a build for 1 thread has no parallel loops
   (``backends/tvm/schedules/threads.py``, "Builds for one thread").
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import onnx
import onnx_ir as ir

from partitioner import artifact as _artifact
from partitioner.core.bindings import Bindings
from partitioner.core.errors import BackendError, PartitionerError, UsageError
from partitioner.core.files import sha256_file
from partitioner.core.programs import to_proto


class Artifact(_artifact.Artifact):
    """A verified artifact directory that can also be run (``partitioner run``'s Python form)."""

    def run(self, inputs: Mapping[str, np.ndarray] | str | os.PathLike[str], *, check: bool = False,
            ranks_per_host: int | None = None, in_process: bool = False, timeout: float | None = None,
            rtol: float = 1e-4, atol: float = 1e-5, outputs: str | os.PathLike[str] | None = None) -> Any:
        """Run on ``inputs`` (a dict of arrays or an .npz path) the way ``partitioner run`` does.

        Returns a :class:`partitioner.runtime.launch.RunResult` (``outputs``, ``check``, ``wall_s``).
        """
        from partitioner.runtime.launch import run_artifact

        return run_artifact(self, inputs, check=check, ranks_per_host=ranks_per_host, in_process=in_process,
                            timeout=timeout, rtol=rtol, atol=atol, outputs_path=outputs)


def load_artifact(directory: str | os.PathLike[str]) -> Artifact:
    """Verify, then load an artifact directory (:func:`partitioner.artifact.load_artifact`), runnable."""
    art = _artifact.load_artifact(directory)
    return Artifact(art.root, art.manifest, art.plan)


def prepare(model: Any, *, batch: int | None = None, shapes: Mapping[str, Sequence[int]] | None = None,
            passes: Sequence[str] | None = None, keep_source: bool = False,
            shapes_only: bool = False,
            constants: Mapping[str, Any] | None = None) -> tuple[Any, Any]:
    """Rule 1: load and validate ``model``, bind shapes, run ``passes`` (None: the default
    clean-up pipeline). Returns the prepared ``onnx_ir.Model`` and, with ``keep_source``, the
    model as loaded, before the passes (what ``run --check`` compares against): a serialised
    model, or for a model path with lazy external weights a :class:`partitioner.artifact.SourceReference`
    (docs/large_models.md: those weights are never gathered into one protobuf). ``shapes_only``
    accepts a model whose external data file is absent (docs/large_models.md); ``constants``
    binds inputs to values (``--const``; :mod:`partitioner.bind_inputs`)."""
    from partitioner.load import load

    raw = load(model, batch=batch, shapes=dict(shapes) if shapes else None,  # refuse bad input first
               shapes_only=shapes_only, constants=constants)
    import onnx_ir as ir

    from passes import run_pipeline

    source: Any = None
    if keep_source:  # the passes edit raw in place: keep the source first
        from partitioner.lowering.lazy_weights import external_bytes

        if external_bytes(raw) and isinstance(model, (str, os.PathLike)) and not constants:
            source = _artifact.SourceReference(Path(model))  # large: by reference, never re-serialised
        elif constants:  # ORT checks the model as given, bound inputs as overridable defaults (bind_inputs rule 6)
            from partitioner.bind_inputs import reference_with_constant_defaults

            source = reference_with_constant_defaults(model, constants)
        else:
            from partitioner.lowering.lazy_weights import read_in_external

            source = ir.serde.serialize_model(read_in_external(raw))
    return run_pipeline(raw, None if passes is None else list(passes)), source


def compile(model: Any, cluster: Any = None, *, strategy: str = "auto", target: Any = None, backend: str = "tvm",
            microbatches: int | None = None, objective: str = "latency", memory_limit: int | None = None,
            out_dir: str | os.PathLike[str] | None = None, batch: int | None = None,
            shapes: Mapping[str, Sequence[int]] | None = None, passes: Sequence[str] | None = None,
            fallback: str | None = None, jobs: int | None = None, progress: bool | None = None,
            source: onnx.ModelProto | bytes | None = None, source_path: str | None = None,
            build_options: Mapping[str, Any] | None = None,
            constants: Mapping[str, Any] | None = None) -> Artifact:
    """Load, partition and build ``model`` into an artifact directory.

    ``model``: an .onnx path, an ``onnx.ModelProto``, a zoo name or an (already prepared)
    ``onnx_ir.Model``. ``cluster``: a :class:`partitioner.cluster.Cluster`, a spec string
    (``"cpu:2"``, a file, a preset), a device count N or None (1): ``cpu:N``, or for a GPU
    ``target`` N of that GPU (``"h200"`` -> ``h200xN``). ``out_dir``: where to write; a fresh
    temporary directory when None (``Artifact.save`` copies it elsewhere). ``build_options``: the
    backend's options, e.g. ``{"tune_trials": 64, "tuning_db": "db/"}`` or ``{"pipeline": "zero"}``
    for TVM (``backends/tvm/build.py``). ``source``: the model
    ``run --check`` compares against (default: ``model`` as loaded, before the passes).
    ``constants``: inputs bound to values (``{"sr": 16000}``, the CLI's ``--const``); they become
    initializers, so the artifact no longer takes them as inputs.
    """
    import onnx_ir as ir

    from partitioner.cluster import resolve_cluster
    from partitioner.cost.threads import build_threads
    from partitioner.partition import partition

    path = source_path if source_path is not None else model
    original_sha = None
    if isinstance(path, (str, os.PathLike)) and Path(path).is_file():
        original_sha = sha256_file(path)
    if isinstance(model, ir.Model):
        if constants:
            raise UsageError("constants= binds inputs while loading; pass a path or ModelProto, or load with "
                             "partitioner.load(..., constants=...) first")
        prepared = model  # lazy weights stay lazy: each rank's shard is streamed into rank<i>.data
        if source is None:  # nothing to refer to: the source is serialised, its weights with it
            from partitioner.lowering.lazy_weights import read_in_external

            source = ir.serde.serialize_model(read_in_external(model))
    else:
        prepared, raw_source = prepare(model, batch=batch, shapes=shapes, passes=passes, keep_source=source is None,
                                       constants=constants)
        source = source if source is not None else raw_source
    if (cluster is None or isinstance(cluster, int)) and backend == "tvm" and target is not None:
        from backends.tvm.target import gpu_cluster_spec  # a GPU target plans for N of that GPU

        cluster = gpu_cluster_spec(target, cluster or 1) or cluster
    from partitioner.lowering.lazy_weights import lazy_weights_dir

    weights_dir = lazy_weights_dir(prepared)  # lazy shard references are streamed from there
    cluster_obj = resolve_cluster(cluster, backend)  # cpu:N: this backend's calibrated figures
    result = partition(prepared, cluster_obj, strategy=strategy, microbatches=microbatches, objective=objective,
                       memory_limit=memory_limit)
    if backend == "tvm" and target is not None:
        from backends.tvm.target import target_dict

        target = target_dict(target)  # validate early (one line on a bad spec); the build takes the dict
    out = Path(out_dir) if out_dir is not None else Path(tempfile.mkdtemp(prefix="partitioner-artifact-")) / "artifact"
    html, sim = _simulate_and_render(prepared, result, cluster_obj)
    prediction = dict(result.prediction or {})
    if sim is not None:
        prediction["simulated"] = sim
        prediction["step_latency_s"] = sim["step_latency_s"]
    if backend == "tvm" and "threads" not in (build_options or {}):  # rule 5
        build_options = {**(build_options or {}), "threads": build_threads(cluster_obj, result.plan.world_size)}
    return build_artifact(out, result.models, result.bindings, source=source, backend=backend, target=target,
                          plan=result.plan.to_json(), cluster=cluster_obj.to_json(),
                          prediction=prediction, explanation=result.explanation,
                          report_html=html, jobs=jobs, fallback=fallback,
                          source_sha256=original_sha, progress=progress, build_options=build_options,
                          weights_dir=weights_dir)


def _simulate_and_render(model: Any, result: Any, cluster: Any) -> tuple[str | None, dict[str, Any] | None]:
    """The report and the simulated step that :func:`partition` already computed (nothing is
    simulated twice). The report is left out, not fatal, when it cannot be drawn."""
    from partitioner.report_graph import plan_report_html

    sim = result.simulation
    if sim is None:
        return None, None
    try:
        html = plan_report_html(model, result, cluster)
    except PartitionerError:
        html = None
    return html, sim.to_json()


# ------------------------------------------------------------------------------------------------
# build + write


def build_artifact(out_dir: str | os.PathLike[str], programs: Sequence[ir.Model | onnx.ModelProto], bindings: Bindings, *,
                   source: onnx.ModelProto | bytes | str | os.PathLike[str], backend: str = "onnxruntime",
                   target: Any = None, plan: Mapping[str, Any] | None = None,
                   cluster: Mapping[str, Any] | None = None, prediction: Mapping[str, Any] | None = None,
                   explanation: str | None = None, report_html: str | None = None, jobs: int | None = None,
                   fallback: str | None = None, source_sha256: str | None = None,
                   progress: bool | None = None, build_options: Mapping[str, Any] | None = None,
                   weights_dir: str | os.PathLike[str] | None = None) -> Artifact:
    """Build per-rank programs with ``backend`` and write them as an artifact directory (the
    mechanism under :func:`compile`; tests use it with hand-built programs). Returns the verified
    artifact. ``programs`` from the lowering are onnx-ir: this is where they are serialised, once
    (``core.programs.to_proto``). ``weights_dir``: the folder the programs' lazy weight references
    point into; each rank's weights are streamed from it into ``rank<i>.data`` and the build then
    sees programs whose weights are references into those files (never every weight in one process)."""
    programs = [to_proto(p) for p in programs]
    _artifact.check_layout(programs, bindings)
    ort_marked = False
    if backend == "tvm" and fallback == "onnxruntime":
        from backends.tvm import fallback as tvm_fallback

        programs, ort_marked = tvm_fallback.mark_programs(programs)

    def build(tmp: Path, programs: Sequence[onnx.ModelProto]) -> _artifact.BuildOutcome:
        return _build(tmp, programs, backend, target, jobs, progress, build_options, fallback, ort_marked)

    root = _artifact.write_artifact(out_dir, list(programs), bindings, source=source, build=build, plan=plan,
                                    cluster=cluster, prediction=prediction, explanation=explanation,
                                    report_html=report_html, source_sha256=source_sha256,
                                    weights_dir=weights_dir)
    return load_artifact(root)


def _build(tmp: Path, programs: Sequence[onnx.ModelProto], backend: str, target: Any, jobs: int | None,
           progress: bool | None, options: Mapping[str, Any] | None, fallback: str | None,
           ort_marked: bool) -> _artifact.BuildOutcome:
    """Rule 3: build every rank into ``tmp``, falling back to ``fallback`` when asked."""
    fallback_note = None
    try:
        suffix, facts = _build_backend_files(tmp, programs, backend, target, jobs, progress, options)
    except Exception as exc:  # noqa: BLE001 - any build failure may fall back, when asked to
        if not fallback or fallback == backend:
            if isinstance(exc, PartitionerError):
                raise
            raise BackendError(f"backend {backend}: build failed: {str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__}") from exc
        for path in tmp.iterdir():
            if _artifact.RANK_FILE.match(path.name) and path.suffix not in (".onnx", ".data"):
                path.unlink()
        fallback_note = {"from": backend, "to": fallback, "reason": str(exc).splitlines()[0]}
        backend, target = fallback, None
        suffix, facts = _build_backend_files(tmp, programs, backend, target, jobs, progress)
    segments_per_rank: list[list[dict[str, Any]]] = [[] for _ in programs]
    if ort_marked and backend == "tvm":
        from backends.tvm import fallback as tvm_fallback

        segments_per_rank = tvm_fallback.write_segments(tmp, programs)
        fallback_note = tvm_fallback.segments_note(segments_per_rank)
    elif fallback_note is not None:
        fallback_note["scope"] = "ranks"
    return _artifact.BuildOutcome(backend, target, suffix, facts, fallback_note, segments_per_rank)


def _build_backend_files(tmp: Path, programs: Sequence[onnx.ModelProto], backend: str, target: Any,
                         jobs: int | None, progress: bool | None,
                         options: Mapping[str, Any] | None = None) -> tuple[str, list[dict]]:
    from backends import get_backend

    mod = get_backend(backend)
    suffix = mod.FILE_SUFFIX
    if suffix == ".onnx":  # the program file itself is what this backend runs
        return suffix, [{} for _ in programs]
    work = tmp / ".build"  # the backend may leave scratch files: only rank<i><suffix> is kept
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    try:
        build_all = getattr(mod, "build_all", None)
        if build_all is not None:
            if options and options.get("tune_trials"):
                jobs = 1  # tuning writes one database: ranks must not tune it concurrently
                if progress is not False:  # the tuning bar (trials done, best time) on stderr
                    options = {**options, "tune_progress": True}
            facts = build_all(list(programs), work, target=target, jobs=jobs, progress=progress,
                              options=dict(options) if options else None)
        else:
            facts = [mod.build(p, work / f"rank{i}{suffix}", target=target, options=dict(options) if options else None)
                     for i, p in enumerate(programs)]
        for i in range(len(programs)):
            if not (work / f"rank{i}{suffix}").is_file():
                raise BackendError(f"backend {backend}: the build wrote no rank{i}{suffix}")
            os.replace(work / f"rank{i}{suffix}", tmp / f"rank{i}{suffix}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return suffix, list(facts)


__all__ = ["Artifact", "build_artifact", "compile", "load_artifact", "prepare"]
