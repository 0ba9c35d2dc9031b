"""The deployable artifact directory: its format, and how to write, verify and load it.

Building it is the compile driver's job (:mod:`partitioner.compiler`); running it is the runtime's
(:mod:`partitioner.runtime.launch`), which calls :func:`load_artifact`.

Layout (see docs/artifact_format.md for the full format)::

    DIR/manifest.json   format name + integer version, hashes of every other file, bindings, ...
    DIR/plan.json       the partition plan (Plan.to_json())
    DIR/source.onnx     the model before partitioning (``run --check`` compares against it); for a
                        model with external data it is a reference instead (rule 5)
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
5. A source model whose weights are external data (:class:`SourceReference`) is not copied: the
   manifest's ``source_model`` has ``"file": null`` and a ``reference`` (the model's absolute path,
   the sha256 and size of its .onnx and of every external data file it names). Copying it would
   double the artifact of a model that is partitioned because it is large (docs/large_models.md).
   :func:`source_model_path` checks the reference before ``run --check`` uses it. The path is the
   one absolute path an artifact may hold (it names where the model was, on the compiling host).
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
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import onnx

from partitioner.core.bindings import Bindings
from partitioner.core.comm_ops import CommOp, is_comm
from partitioner.core.errors import ArtifactError
from partitioner.core.files import json_default, sha256_file
from partitioner.core.segments import all_nodes
from partitioner.lowering.lazy_weights import write_rank_program

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
RANK_FILE = re.compile(r"^rank(\d+)\.")


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
class SourceReference:
    """Rule 5: the source model by path (an .onnx whose weights are external data beside it)."""

    path: Path

    def to_json(self) -> dict[str, Any]:
        """The manifest's ``reference``: the path, and sha256 + size of the .onnx and its data files."""
        path = Path(self.path).resolve()
        proto = onnx.load(str(path), load_external_data=False)
        names = sorted({e.value for t in _all_tensors(proto) for e in t.external_data if e.key == "location"})
        return {"path": str(path), "sha256": sha256_file(path), "size": path.stat().st_size,
                "data": [{"file": n, "sha256": sha256_file(path.parent / n), "size": (path.parent / n).stat().st_size}
                         for n in names]}


def _all_tensors(proto: onnx.ModelProto) -> list[onnx.TensorProto]:
    from onnx.external_data_helper import _get_all_tensors

    return list(_get_all_tensors(proto))


def source_model_path(root: Path, manifest: Mapping[str, Any]) -> Path:
    """The source model's .onnx: the artifact's own ``source.onnx``, or the referenced model
    (rule 5) after checking that it and its data files still have the recorded sha256; raises
    :class:`ArtifactError` naming the file otherwise."""
    entry = manifest["source_model"]
    if entry.get("file"):
        return Path(root) / entry["file"]
    ref = entry["reference"]
    path = Path(ref["path"])
    for file, info in [(path, ref), *((path.parent / d["file"], d) for d in ref.get("data", []))]:
        if not file.is_file():
            raise ArtifactError(f"{file}: the source model this artifact refers to is missing (it is kept by "
                                "reference, not copied: docs/large_models.md)")
        if file.stat().st_size != info["size"] or sha256_file(file) != info["sha256"]:
            raise ArtifactError(f"{file}: the source model this artifact refers to has changed since compile "
                                "(sha256 differs)")
    return path


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
        return onnx.load(str(source_model_path(self.root, self.manifest)))

    def program(self, rank: int, *, load_data: bool = True) -> onnx.ModelProto:
        """Rank ``rank``'s program alone, for its worker (``programs`` reads every rank's);
        ``load_data=False`` leaves its weights in ``rank<i>.data`` (external references that the
        backend memory-maps), so one rank reads only its own."""
        return onnx.load(str(self.root / self.manifest["ranks"][rank]["program"]), load_external_data=load_data)

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
        art = load_artifact(dest)
        return type(self)(art.root, art.manifest, art.plan)


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
    _check_source_entry(manifest["source_model"], mpath)
    required = [PLAN] + ([manifest["source_model"]["file"]] if manifest["source_model"]["file"] else [])
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
        m = RANK_FILE.match(path.name)
        if m and int(m.group(1)) >= world:
            raise ArtifactError(f"{path}: rank file beyond the artifact's world_size {world}; wrong rank count")
    return manifest


def _check_source_entry(entry: Any, mpath: Path) -> None:
    """``source_model`` names a file of the artifact, or holds a well-formed reference (rule 5)."""
    if not isinstance(entry, dict):
        raise ArtifactError(f"{mpath}: malformed source_model entry")
    if entry.get("file") is not None:
        _safe_name(entry["file"], mpath)
        return
    ref = entry.get("reference")
    ok = isinstance(ref, dict) and isinstance(ref.get("path"), str) and Path(ref["path"]).is_absolute() \
        and isinstance(ref.get("sha256"), str) and isinstance(ref.get("size"), int) \
        and isinstance(ref.get("data"), list) and all(
            isinstance(d, dict) and isinstance(d.get("sha256"), str) and isinstance(d.get("size"), int)
            and isinstance(d.get("file"), str) and "/" not in d["file"] and "\\" not in d["file"]
            and d["file"] not in ("", ".", "..") for d in ref["data"])
    if not ok:
        raise ArtifactError(f"{mpath}: source_model has neither a file nor a well-formed reference")


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


def _write_source(tmp: Path, source: Any) -> dict[str, Any]:
    """Write ``source.onnx`` (or, rule 5, only record a :class:`SourceReference`); returns the
    manifest's ``source_model`` entry without ``original_sha256``."""
    if isinstance(source, SourceReference):
        ref = source.to_json()
        return {"file": None, "sha256": ref["sha256"], "reference": ref}
    (tmp / SOURCE).write_bytes(_source_bytes(source))
    return {"file": SOURCE, "sha256": sha256_file(tmp / SOURCE)}


def _source_bytes(source: onnx.ModelProto | bytes | str | os.PathLike[str]) -> bytes:
    if isinstance(source, bytes):
        return source
    if isinstance(source, onnx.ModelProto):
        return source.SerializeToString()
    return Path(source).read_bytes()


def _as_written(tmp: Path, programs: Sequence[onnx.ModelProto]) -> list[onnx.ModelProto]:
    """What the build sees: ``programs`` themselves, unless one holds lazy references into the
    source model's data; then every rank's program as written, its weights references into
    ``rank<i>.data`` in ``tmp`` (no weight is read here: the backend reads or maps its own)."""
    lazy = any(t.data_location == onnx.TensorProto.EXTERNAL for p in programs for t in p.graph.initializer)
    if not lazy:
        return list(programs)
    return [onnx.load(str(tmp / program_file(i)), load_external_data=False) for i in range(len(programs))]


@dataclass(frozen=True)
class BuildOutcome:
    """What a backend build left in the staging directory, as the manifest records it: the backend
    and target that built it (after any fallback), the per-rank file suffix, per-rank build facts,
    the fallback note and, per rank, the segments that run under another backend."""

    backend: str
    target: Any
    suffix: str
    facts: list[dict]
    fallback: dict[str, Any] | None = None
    segments_per_rank: list[list[dict[str, Any]]] = field(default_factory=list)


def check_layout(programs: Sequence[onnx.ModelProto], bindings: Bindings) -> None:
    """The bindings are consistent and there is one program per rank."""
    bindings.check()
    if len(programs) != bindings.world_size:
        raise ArtifactError(f"{len(programs)} programs for bindings of {bindings.world_size} ranks")


def write_artifact(out_dir: str | os.PathLike[str], programs: Sequence[onnx.ModelProto], bindings: Bindings, *,
                   source: onnx.ModelProto | bytes | str | os.PathLike[str] | SourceReference,
                   build: Callable[[Path, Sequence[onnx.ModelProto]], BuildOutcome],
                   plan: Mapping[str, Any] | None = None, cluster: Mapping[str, Any] | None = None,
                   prediction: Mapping[str, Any] | None = None, explanation: str | None = None,
                   report_html: str | None = None, source_sha256: str | None = None,
                   weights_dir: str | os.PathLike[str] | None = None) -> Path:
    """Write an artifact directory atomically: source, plan and programs, then ``build(staging,
    programs)`` adds the backend's per-rank files, then the report and the manifest (invariants
    1-4). The directory replaces an earlier artifact at ``out_dir``. Returns its path (verify or
    load it with :func:`load_artifact`). ``weights_dir``: the source model's folder, from which
    the programs' lazy weight references are streamed into ``rank<i>.data``."""
    check_layout(programs, bindings)
    dest = Path(out_dir)
    tmp = _staging_dir(dest)
    try:
        files: dict[str, dict[str, Any]] = {}
        source_entry = _write_source(tmp, source)
        plan_json = dict(plan) if plan is not None else {"strategy": "given", "world_size": bindings.world_size}
        (tmp / PLAN).write_text(json.dumps(plan_json, indent=2, sort_keys=True, default=json_default) + "\n")
        for i, p in enumerate(programs):  # rank<i>.onnx + rank<i>.data with only that rank's weights
            write_rank_program(p, tmp, i, base_dir=weights_dir)
        built = build(tmp, _as_written(tmp, programs))
        suffix, facts = built.suffix, built.facts
        segments_per_rank = built.segments_per_rank or [[] for _ in programs]
        if report_html is not None:
            (tmp / REPORT).write_text(report_html)
        ranks = [{"rank": i, "program": program_file(i), "executable": f"rank{i}{suffix}",
                  **({"data": f"rank{i}.data"} if (tmp / f"rank{i}.data").is_file() else {}),
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
            "backend": built.backend,
            "target": _clean_facts(built.target, False),
            "fallback": built.fallback,
            "source_model": {**source_entry, "original_sha256": source_sha256 or source_entry["sha256"]},
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
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True, default=json_default) + "\n")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _replace_dir(tmp, dest)
    return dest


def _plan_summary(plan: Mapping[str, Any], bindings: Bindings) -> dict[str, Any]:
    keep = ("strategy", "objective", "world_size", "microbatches", "stages", "num_stages")
    summary = {k: _clean_facts(plan[k], False) for k in keep if k in plan and not isinstance(plan[k], (dict, list))}
    summary.setdefault("world_size", bindings.world_size)
    summary.setdefault("microbatches", bindings.microbatches)
    return summary


__all__ = ["Artifact", "BuildOutcome", "FORMAT", "FORMAT_VERSION", "SourceReference", "load_artifact",
           "source_model_path", "verify_artifact", "write_artifact"]
