"""The deployable artifact directory: build it, verify it, load it, run it.

Layout (see docs/artifact_format.md for the full format)::

    DIR/manifest.json   format name + integer version, hashes of every other file, bindings, ...
    DIR/plan.json       the partition plan (Plan.to_json())
    DIR/source.onnx     the model before partitioning (``run --check`` compares against it)
    DIR/rank<i>.onnx    the per-rank program of rank i (comm ops in domain partitioner.comm)
    DIR/rank<i>.so      the backend's per-rank executable (tvm); onnxruntime runs rank<i>.onnx
    DIR/report.html     the plan report, when the renderer is available

Invariants:
1. Every file but manifest.json is listed in ``manifest["files"]`` with its sha256 and size, and
   the manifest carries ``manifest_sha256``, the sha256 of its own canonical JSON without that key.
   :func:`verify_artifact` checks the format version first, then the manifest checksum, then the
   layout, every hash and the rank count, and raises :class:`ArtifactError` naming the file.
   Every loader calls it before it loads any program or library.
2. Only plain relative file names appear inside: the directory can be copied anywhere.
3. No timestamps, absolute paths or host names: the same model, options and toolchain give the
   same bytes, except the files listed in ``manifest["nondeterministic_files"]`` (with the reason).
4. No pickle: programs are ONNX protobuf, metadata is JSON, run-time data is ``.npz`` read with
   ``allow_pickle=False``.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from functools import cached_property
from importlib import metadata
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import onnx

from partitioner.bindings import Bindings
from partitioner.comm_ops import CommOp, is_comm
from partitioner.errors import ArtifactError, BackendError, PartitionerError, UsageError
from partitioner.segments import all_nodes

FORMAT = "partitioner-artifact"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
PLAN = "plan.json"
SOURCE = "source.onnx"
REPORT = "report.html"
_TOOLS = {"partitioner": "partitioner", "onnx": "onnx", "onnxruntime": "onnxruntime", "tvm": "apache-tvm",
          "tvm_ffi": "apache-tvm-ffi", "numpy": "numpy", "mpi4py": "mpi4py", "mpich": "mpich"}
#: build-fact keys that measure time: they would make the manifest differ between identical builds.
_TIMING_KEYS = re.compile(r"(^|_)(time|seconds|secs|elapsed|duration|wall)(_|$)|_s$")
_RANK_FILE = re.compile(r"^rank(\d+)\.")


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def manifest_checksum(manifest: Mapping[str, Any]) -> str:
    body = {k: v for k, v in manifest.items() if k != "manifest_sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def toolchain_versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for key, dist in _TOOLS.items():
        try:
            out[key] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[key] = "not installed"
    return out


def program_file(rank: int) -> str:
    return f"rank{rank}.onnx"


# ------------------------------------------------------------------------------------------------
# the in-memory view


@dataclass(frozen=True)
class Artifact:
    """A verified artifact directory. ``programs`` and ``source`` are read on first use."""

    root: Path
    manifest: dict[str, Any] = field(repr=False)
    plan: dict[str, Any] = field(repr=False)

    @property
    def world_size(self) -> int:
        return int(self.manifest["world_size"])

    @property
    def microbatches(self) -> int:
        return int(self.manifest["microbatches"])

    @property
    def backend(self) -> str:
        return str(self.manifest["backend"])

    @cached_property
    def bindings(self) -> Bindings:
        return Bindings.from_json(self.manifest["bindings"])

    @cached_property
    def programs(self) -> tuple[onnx.ModelProto, ...]:
        return tuple(onnx.load(str(self.root / r["program"])) for r in self.manifest["ranks"])

    @cached_property
    def source(self) -> onnx.ModelProto:
        return onnx.load(str(self.root / self.manifest["source_model"]["file"]))

    @property
    def files(self) -> dict[str, Path]:
        """Every file of the artifact (manifest.json included) by its relative name."""
        names = [MANIFEST, *self.manifest["files"]]
        return {n: self.root / n for n in names}

    def backend_file(self, rank: int) -> Path:
        return self.root / self.manifest["ranks"][rank]["executable"]

    def save(self, directory: str | os.PathLike[str]) -> Artifact:
        """Copy the artifact to ``directory`` (created; an earlier artifact there is replaced)."""
        dest = Path(directory)
        if dest.resolve() == self.root.resolve():
            return self
        tmp = _staging_dir(dest)
        for name, path in self.files.items():
            shutil.copyfile(path, tmp / name)
        _replace_dir(tmp, dest)
        return load_artifact(dest)

    def run(self, inputs: Mapping[str, np.ndarray] | str | os.PathLike[str], *, check: bool = False,
            ranks_per_host: int | None = None, in_process: bool = False, timeout: float | None = None,
            rtol: float = 1e-4, atol: float = 1e-5, outputs: str | os.PathLike[str] | None = None) -> Any:
        """Run on ``inputs`` (a dict of arrays or an .npz path) the way ``partitioner run`` does.

        Returns a :class:`partitioner.runtime.launch.RunResult` (``outputs``, ``check``, ``wall_s``).
        """
        from partitioner.runtime.launch import run_artifact

        return run_artifact(self, inputs, check=check, ranks_per_host=ranks_per_host, in_process=in_process,
                            timeout=timeout, rtol=rtol, atol=atol, outputs_path=outputs)


# ------------------------------------------------------------------------------------------------
# verification and loading


def _read_manifest(root: Path) -> dict[str, Any]:
    if not root.is_dir():
        raise ArtifactError(f"{root}: not an artifact directory (it does not exist or is not a directory)")
    path = root / MANIFEST
    if not path.is_file():
        raise ArtifactError(f"{path}: missing; this is not an artifact directory (build one with `partitioner compile`)")
    try:
        manifest = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ArtifactError(f"{path}: cannot be read as JSON ({exc})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ArtifactError(f"{path}: not a {FORMAT} manifest")
    version = manifest.get("format_version")
    if version != FORMAT_VERSION:
        raise ArtifactError(f"{path}: artifact format {version} is not supported by this partitioner "
                            f"(supports {FORMAT_VERSION}); recompile the model with this partitioner")
    if manifest.get("manifest_sha256") != manifest_checksum(manifest):
        raise ArtifactError(f"{path}: edited or corrupted (its manifest_sha256 does not match its contents); "
                            "recompile the artifact")
    return manifest


def _safe_name(name: Any, where: Path) -> str:
    if not isinstance(name, str) or not name or "/" in name or "\\" in name or name in (".", "..") \
            or name == MANIFEST:
        raise ArtifactError(f"{where}: bad file name {name!r} (only plain relative names are allowed)")
    return name


def verify_artifact(directory: str | os.PathLike[str]) -> dict[str, Any]:
    """Check format version, manifest checksum, layout, rank count and every file hash.

    Returns the manifest. Raises :class:`ArtifactError` naming the first bad file.
    """
    root = Path(directory)
    manifest = _read_manifest(root)
    mpath = root / MANIFEST
    try:
        world = int(manifest["world_size"])
        files: dict[str, Any] = manifest["files"]
        ranks: list[dict[str, Any]] = manifest["ranks"]
        bindings = Bindings.from_json(manifest["bindings"])
        int(manifest["microbatches"])
        manifest["backend"], manifest["source_model"]["file"]
    except (KeyError, TypeError, ValueError) as exc:
        raise ArtifactError(f"{mpath}: missing or malformed entry {exc}") from None
    for name in files:
        _safe_name(name, mpath)
    if len(ranks) != world or bindings.world_size != world or world < 1:
        raise ArtifactError(f"{mpath}: rank count mismatch (world_size {world}, {len(ranks)} rank entries, "
                            f"bindings for {bindings.world_size})")
    required = [PLAN, manifest["source_model"]["file"]]
    for i, entry in enumerate(ranks):
        if entry.get("rank") != i:
            raise ArtifactError(f"{mpath}: rank entry {i} is for rank {entry.get('rank')}")
        required += [_safe_name(entry.get("program"), mpath), _safe_name(entry.get("executable"), mpath)]
    for name in required:
        if name not in files:
            raise ArtifactError(f"{root / name}: required by the layout but not listed in the manifest")
    for name, info in files.items():
        path = root / name
        if not path.is_file():
            raise ArtifactError(f"{path}: missing (the manifest lists it); the artifact is incomplete")
        if path.stat().st_size != info.get("size") or sha256_file(path) != info.get("sha256"):
            raise ArtifactError(f"{path}: sha256 does not match the manifest (the file was changed or corrupted)")
    for path in root.iterdir():
        m = _RANK_FILE.match(path.name)
        if m and int(m.group(1)) >= world:
            raise ArtifactError(f"{path}: rank file beyond the artifact's world_size {world}; wrong rank count")
    return manifest


def load_artifact(directory: str | os.PathLike[str]) -> Artifact:
    """Verify, then load an artifact directory (plan and manifest; programs on first use)."""
    root = Path(directory)
    manifest = verify_artifact(root)
    try:
        plan = json.loads((root / PLAN).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ArtifactError(f"{root / PLAN}: cannot be read as JSON ({exc})") from None
    return Artifact(root, manifest, plan)


# ------------------------------------------------------------------------------------------------
# building


def comm_groups(programs: Sequence[onnx.ModelProto]) -> list[list[int]]:
    """Every collective group used by any program, sorted: the order in which runtimes create
    sub-communicators (all ranks must create them in the same order)."""
    groups: set[tuple[int, ...]] = set()
    for program in programs:
        for node in all_nodes(program.graph):
            if is_comm(node):
                op = CommOp.from_node(node)
                if op.group:
                    groups.add(op.group)
    return [list(g) for g in sorted(groups, key=lambda g: (len(g), g))]


def _staging_dir(dest: Path) -> Path:
    dest.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))


def _replace_dir(tmp: Path, dest: Path) -> None:
    if dest.exists():
        if not dest.is_dir() or (any(dest.iterdir()) and not (dest / MANIFEST).exists()):
            shutil.rmtree(tmp, ignore_errors=True)
            raise ArtifactError(f"{dest}: exists and is not an artifact directory; refusing to overwrite it")
        shutil.rmtree(dest)
    os.replace(tmp, dest)
    os.chmod(dest, 0o755)


def _clean_facts(facts: Any, drop_timing: bool = True) -> Any:
    """JSON-safe copy; build facts also lose measured times (they would break reproducibility)."""
    if isinstance(facts, dict):
        return {str(k): _clean_facts(v, drop_timing) for k, v in facts.items()
                if not (drop_timing and _TIMING_KEYS.search(str(k)))}
    if isinstance(facts, (list, tuple)):
        return [_clean_facts(v, drop_timing) for v in facts]
    if isinstance(facts, (np.generic,)):
        return facts.item()
    if isinstance(facts, (str, int, float, bool)) or facts is None:
        return facts
    return str(facts)


def _source_bytes(source: onnx.ModelProto | bytes | str | os.PathLike[str]) -> bytes:
    if isinstance(source, bytes):
        return source
    if isinstance(source, onnx.ModelProto):
        return source.SerializeToString()
    return Path(source).read_bytes()


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


def build_artifact(out_dir: str | os.PathLike[str], programs: Sequence[onnx.ModelProto], bindings: Bindings, *,
                   source: onnx.ModelProto | bytes | str | os.PathLike[str], backend: str = "onnxruntime",
                   target: Any = None, plan: Mapping[str, Any] | None = None,
                   cluster: Mapping[str, Any] | None = None, prediction: Mapping[str, Any] | None = None,
                   explanation: str | None = None, report_html: str | None = None, jobs: int | None = None,
                   fallback: str | None = None, source_sha256: str | None = None,
                   progress: bool | None = None, build_options: Mapping[str, Any] | None = None) -> Artifact:
    """Write an artifact directory from per-rank programs and their bindings (the mechanism under
    :func:`compile`; tests use it with hand-built programs). Returns the verified artifact."""
    bindings.check()
    if len(programs) != bindings.world_size:
        raise ArtifactError(f"{len(programs)} programs for bindings of {bindings.world_size} ranks")
    dest = Path(out_dir)
    tmp = _staging_dir(dest)
    try:
        files: dict[str, dict[str, Any]] = {}
        src = _source_bytes(source)
        (tmp / SOURCE).write_bytes(src)
        programs, ort_marked = _mark_fallback_segments(programs, backend, fallback)
        plan_json = dict(plan) if plan is not None else {"strategy": "given", "world_size": bindings.world_size}
        (tmp / PLAN).write_text(json.dumps(plan_json, indent=2, sort_keys=True, default=_json_default) + "\n")
        for i, p in enumerate(programs):
            (tmp / program_file(i)).write_bytes(p.SerializeToString())
        fallback_note = None
        try:
            suffix, facts = _build_backend_files(tmp, programs, backend, target, jobs, progress, build_options)
        except Exception as exc:  # noqa: BLE001 - any build failure may fall back, when asked to
            if not fallback or fallback == backend:
                if isinstance(exc, PartitionerError):
                    raise
                raise BackendError(f"backend {backend}: build failed: {str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__}") from exc
            for path in tmp.iterdir():
                if _RANK_FILE.match(path.name) and path.suffix != ".onnx":
                    path.unlink()
            fallback_note = {"from": backend, "to": fallback, "reason": str(exc).splitlines()[0]}
            backend, target = fallback, None
            suffix, facts = _build_backend_files(tmp, programs, backend, target, jobs, progress)
        segments_per_rank: list[list[dict[str, Any]]] = [[] for _ in programs]
        if ort_marked and backend == "tvm":
            segments_per_rank = _write_fallback_segments(tmp, programs)
            fallback_note = _segment_fallback_note(segments_per_rank)
        elif fallback_note is not None:
            fallback_note["scope"] = "ranks"
        if report_html is not None:
            (tmp / REPORT).write_text(report_html)
        ranks = [{"rank": i, "program": program_file(i), "executable": f"rank{i}{suffix}",
                  "build": _clean_facts(facts[i] if i < len(facts) else {}),
                  **({"fallback_segments": segments_per_rank[i]} if segments_per_rank[i] else {})}
                 for i in range(len(programs))]
        for path in sorted(tmp.iterdir()):
            files[path.name] = {"sha256": sha256_file(path), "size": path.stat().st_size}
        # a backend that cannot build byte-identical files says so in its facts (checked: apache-tvm
        # 0.27 exports identical rank<i>.so for identical programs, target and toolchain)
        nondet = [{"file": f"rank{i}{suffix}", "reason": str(f["nondeterministic_reason"])}
                  for i, f in enumerate(facts) if isinstance(f, dict) and f.get("nondeterministic_reason")]
        manifest: dict[str, Any] = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "world_size": bindings.world_size,
            "microbatches": bindings.microbatches,
            "backend": backend,
            "target": _clean_facts(target, False),
            "fallback": fallback_note,
            "source_model": {"file": SOURCE, "sha256": files[SOURCE]["sha256"],
                             "original_sha256": source_sha256 or files[SOURCE]["sha256"]},
            "toolchain": toolchain_versions(),
            "cluster": _clean_facts(dict(cluster), False) if cluster is not None else None,
            "plan_summary": _plan_summary(plan_json, bindings),
            "prediction": _clean_facts(dict(prediction), False) if prediction else None,
            "explanation": explanation,
            "bindings": bindings.to_json(),
            "comm_groups": comm_groups(programs),
            "ranks": ranks,
            "files": files,
            "nondeterministic_files": nondet,
        }
        manifest["manifest_sha256"] = manifest_checksum(manifest)
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True, default=_json_default) + "\n")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _replace_dir(tmp, dest)
    return load_artifact(dest)


def _mark_fallback_segments(programs: Sequence[onnx.ModelProto], backend: str,
                            fallback: str | None) -> tuple[list[onnx.ModelProto], bool]:
    """With ``backend="tvm", fallback="onnxruntime"``, mark the programs holding ops TVM cannot
    import so that the TVM lowering runs just those segments under ONNX Runtime
    (:mod:`backends.tvm.fallback`). Other programs are left byte-identical."""
    if backend != "tvm" or fallback != "onnxruntime":
        return list(programs), False
    from backends.tvm import fallback as tvm_fallback

    out, marked = [], False
    for p in programs:
        if tvm_fallback.needs_fallback(p):
            p, marked = tvm_fallback.mark_program(p), True
        out.append(p)
    return out, marked


def _write_fallback_segments(tmp: Path, programs: Sequence[onnx.ModelProto]) -> list[list[dict[str, Any]]]:
    """Write ``rank<i>.seg<k>.onnx`` for every ORT segment; return their descriptions per rank."""
    from backends.tvm import fallback as tvm_fallback

    described: list[list[dict[str, Any]]] = []
    for i, p in enumerate(programs):
        rows = []
        for seg in tvm_fallback.ort_segments(p):
            name = tvm_fallback.segment_file(f"rank{i}.so", seg.key)
            (tmp / name).write_bytes(seg.model.SerializeToString(deterministic=True))
            rows.append({"file": name, **seg.describe()})
        described.append(rows)
    return described


def _segment_fallback_note(segments_per_rank: list[list[dict[str, Any]]]) -> dict[str, Any]:
    parts = [f"rank {i} segment {s['segment']} ({', '.join(s['op_types'])}: nodes {', '.join(s['nodes'])})"
             for i, rows in enumerate(segments_per_rank) for s in rows]
    ops = sorted({t for rows in segments_per_rank for s in rows for t in s["op_types"]})
    return {"from": "tvm", "to": "onnxruntime", "scope": "segments",
            "reason": f"TVM cannot import {', '.join(ops)}; ONNX Runtime runs only these segments inside "
                      f"their rank: {'; '.join(parts)}",
            "segments": [{"rank": i, **s} for i, rows in enumerate(segments_per_rank) for s in rows]}


def _plan_summary(plan: Mapping[str, Any], bindings: Bindings) -> dict[str, Any]:
    keep = ("strategy", "objective", "world_size", "microbatches", "stages", "num_stages")
    summary = {k: _clean_facts(plan[k], False) for k in keep if k in plan and not isinstance(plan[k], (dict, list))}
    summary.setdefault("world_size", bindings.world_size)
    summary.setdefault("microbatches", bindings.microbatches)
    return summary


def _json_default(o: Any) -> Any:
    if isinstance(o, np.generic):
        return o.item()
    if isinstance(o, np.ndarray):
        return o.tolist()
    if hasattr(o, "to_json"):
        return o.to_json()
    if isinstance(o, (set, frozenset, tuple)):
        return list(o)
    return str(o)


def compile(model: Any, cluster: Any = None, *, strategy: str = "auto", target: Any = None, backend: str = "tvm",
            microbatches: int | None = None, objective: str = "latency", memory_limit: int | None = None,
            out_dir: str | os.PathLike[str] | None = None, batch: int | None = None,
            shapes: Mapping[str, Sequence[int]] | None = None, passes: Sequence[str] | None = None,
            fallback: str | None = None, jobs: int | None = None, progress: bool | None = None,
            source: onnx.ModelProto | bytes | None = None, source_path: str | None = None,
            build_options: Mapping[str, Any] | None = None,
            constants: Mapping[str, Any] | None = None) -> Artifact:
    """Load, partition and build ``model`` into an artifact directory.

    ``constants``: inputs bound to values (``{"sr": 16000}``, the CLI's ``--const``); they become
    initializers, so the artifact no longer takes them as inputs.

    ``model``: an .onnx path, an ``onnx.ModelProto``, a zoo name or an (already prepared)
    ``onnx_ir.Model``. ``cluster``: a :class:`partitioner.cluster.Cluster`, a spec string
    (``"cpu:2"``, a file, a preset) or None (``cpu:1``). ``out_dir``: where to write; a fresh
    temporary directory when None (``Artifact.save`` copies it elsewhere). ``build_options``: the
    backend's options, e.g. ``{"tune_trials": 64, "tuning_db": "db/"}`` or ``{"pipeline": "zero"}``
    for TVM (``backends/tvm/build.py``). ``source``: the model
    ``run --check`` compares against (default: ``model`` as loaded, before the passes).
    """
    import onnx_ir as ir

    from partitioner.partition import partition

    path = source_path if source_path is not None else model
    original_sha = None
    if isinstance(path, (str, os.PathLike)) and Path(path).is_file():
        original_sha = hashlib.sha256(Path(path).read_bytes()).hexdigest()
    if isinstance(model, ir.Model):
        if constants:
            raise UsageError("constants= binds inputs while loading; pass a path or ModelProto, or load with "
                             "partitioner.load(..., constants=...) first")
        prepared = model
        if source is None:
            source = ir.serde.serialize_model(model)
    else:
        from partitioner.load import load
        from passes import run_pipeline

        raw = load(model, batch=batch, shapes=dict(shapes) if shapes else None, constants=constants)
        if source is None:
            source = ir.serde.serialize_model(raw)  # before the passes: --check compares against this
        prepared = run_pipeline(raw, None if passes is None else list(passes))
    cluster_obj = _resolve_cluster(cluster)
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
    return build_artifact(out, result.programs, result.bindings, source=source, backend=backend, target=target,
                          plan=result.plan.to_json(), cluster=cluster_obj.to_json(),
                          prediction=prediction, explanation=result.explanation,
                          report_html=html, jobs=jobs, fallback=fallback,
                          source_sha256=original_sha, progress=progress, build_options=build_options)


def _resolve_cluster(cluster: Any) -> Any:
    from partitioner.cluster import Cluster

    if cluster is None:
        return Cluster.resolve("cpu:1")
    if isinstance(cluster, str):
        return Cluster.resolve(cluster)
    if isinstance(cluster, int):
        return Cluster.resolve(f"cpu:{cluster}")
    return cluster


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


__all__ = ["Artifact", "FORMAT", "FORMAT_VERSION", "build_artifact", "compile", "load_artifact", "verify_artifact"]
