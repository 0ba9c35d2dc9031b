"""The per-machine calibration cache: where ``partitioner calibrate`` leaves its figures and where
the ``cpu:N`` preset (and ``--devices N``) reads them, so the planner predicts with measured device
figures by default.

Rules:

1. One file per (CPU model, core count, threads per device, backend):
   ``$PARTITIONER_CACHE_DIR/calibration/<key>.json``, where the cache directory defaults to
   ``~/.cache/partitioner``. The key (:func:`machine_key`) names the CPU model, so a home
   directory shared by two kinds of machine never applies one's figures to the other; the thread
   count, because a device of the cost model is one core (one thread per rank); the backend,
   because TVM's and ONNX Runtime's kernels differ in efficiency and launch overhead.
2. The file holds the one-device cluster (``cluster``, the format of docs/cluster_format.md) and
   the raw calibration (``calibration``); ``cpu:N`` replicates that device N times.
3. A file whose key does not match this machine is never read (it is a different file name).
   A file that does not parse is ignored (the nominal figures are used) and named on stderr
   once: a broken cache must never stop a compile.
4. ``PARTITIONER_CACHE_DIR`` moves the whole cache (tests point it at a temporary folder so no
   test depends on what the machine has cached); ``PARTITIONER_AUTO_CALIBRATE=0`` turns off the
   quick calibration that ``plan`` and ``compile`` run on first use (:func:`ensure_calibrated`).
   A first-use calibration that fails leaves ``<key>.failed`` beside the cache file and is not
   tried again on first use (``partitioner calibrate`` tries again and removes it).
5. Other per-machine caches live beside it, one folder per (CPU model, core count, compiler
   target): :func:`target_cache_dir` (``$PARTITIONER_CACHE_DIR/tvm/<cpu>-<cores>c-<target key>/``;
   ``conv_algorithms.json`` there holds the TVM build's measured convolution algorithms,
   :mod:`backends.tvm.conv_algorithms` rule 2). Deleting a file there makes the next build
   measure again.

This module imports only the ground floor; :mod:`partitioner.cluster` builds the cluster from
the JSON it returns, and :mod:`partitioner.calibrate` fills it.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path
from typing import Any, Callable

from partitioner.core.machine import cpu_model

CACHE_DIR_ENV = "PARTITIONER_CACHE_DIR"
AUTO_ENV = "PARTITIONER_AUTO_CALIBRATE"
DEFAULT_BACKEND = "tvm"
_warned: set[str] = set()


def cache_dir() -> Path:
    """``$PARTITIONER_CACHE_DIR`` or ``~/.cache/partitioner``."""
    env = os.environ.get(CACHE_DIR_ENV)
    return Path(env) if env else Path(os.path.expanduser("~")) / ".cache" / "partitioner"


def _cpu_slug() -> str:
    """``<cpu model slug>-<cores>c``: the machine part of every key here."""
    slug = re.sub(r"[^a-z0-9]+", "-", cpu_model().lower()).strip("-")[:60] or "cpu"
    return f"{slug}-{os.cpu_count() or 1}c"


def machine_key(backend: str = DEFAULT_BACKEND, threads: int = 1) -> str:
    """``<cpu model slug>-<cores>c-<threads>t-<backend>`` (rule 1)."""
    return f"{_cpu_slug()}-{threads}t-{backend}"


def target_cache_dir(target_key: str, backend: str = DEFAULT_BACKEND) -> Path:
    """This machine's cache folder for one compiler target of ``backend`` (rule 5)."""
    return cache_dir() / backend / f"{_cpu_slug()}-{target_key}"


def cache_path(backend: str = DEFAULT_BACKEND, threads: int = 1) -> Path:
    """The cache file of this machine for ``backend`` (rule 1)."""
    return cache_dir() / "calibration" / f"{machine_key(backend, threads)}.json"


def load_cached(backend: str = DEFAULT_BACKEND, threads: int = 1) -> dict[str, Any] | None:
    """The cached document (``{"key", "cluster", "calibration"}``) or None (rule 3)."""
    return read_json_object(cache_path(backend, threads), "calibration cache",
                            "run `partitioner calibrate` to refresh it", require="cluster")


def read_json_object(path: Path, what: str, hint: str, require: str | None = None) -> dict[str, Any] | None:
    """A per-machine cache file's JSON object: None when the file is missing, and when it is
    unreadable, not an object or lacks the object ``require`` (one warning line per file and
    process, naming ``what`` and ``hint``: a corrupt cache is measured again, never a crash)."""
    if not path.is_file():
        return None
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(doc, dict) or (require is not None and not isinstance(doc.get(require), dict)):
            raise ValueError(f"no '{require}' object" if require else "not a JSON object")
        return doc
    except (OSError, ValueError) as exc:
        if str(path) not in _warned:
            _warned.add(str(path))
            sys.stderr.write(f"partitioner: ignoring the unreadable {what} {path} ({exc}); {hint}\n")
        return None


def save_cached(cluster_json: dict[str, Any], calibration_json: dict[str, Any], backend: str,
                threads: int = 1) -> Path:
    """Write this machine's cache file for ``backend`` and return its path."""
    path = cache_path(backend, threads)
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"key": machine_key(backend, threads), "cluster": cluster_json, "calibration": calibration_json}
    path.with_suffix(".failed").unlink(missing_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    os.replace(tmp, path)  # readers never see a half-written file
    return path


def auto_calibrate_enabled() -> bool:
    return os.environ.get(AUTO_ENV, "1").strip().lower() not in ("0", "no", "off", "false")


def ensure_calibrated(backend: str = DEFAULT_BACKEND,
                      run: Callable[[str], None] | None = None) -> dict[str, Any] | None:
    """The cached calibration for ``backend``, running ``run(backend)`` (a quick calibration that
    fills the cache) first when there is none and :func:`auto_calibrate_enabled`. A failed
    calibration is reported on stderr in one line and the nominal figures stay in use."""
    doc = load_cached(backend)
    failed = cache_path(backend).with_suffix(".failed")
    if doc is not None or run is None or not auto_calibrate_enabled() or failed.is_file():
        return doc
    sys.stderr.write(f"partitioner: calibrating this machine for the {backend} backend once "
                     f"(about 20 s; cached in {cache_path(backend).parent}) ...\n")
    sys.stderr.flush()
    try:
        run(backend)
    except Exception as exc:  # noqa: BLE001 - calibration is an improvement, never a reason to fail
        sys.stderr.write(f"partitioner: calibration failed ({exc}); using nominal figures (not retried on "
                         f"first use; `partitioner calibrate` tries again)\n")
        try:  # a machine where calibration fails must not pay for it on every command
            failed.parent.mkdir(parents=True, exist_ok=True)
            failed.write_text(f"{exc}\n", encoding="utf-8")
        except OSError:
            pass
        return None
    return load_cached(backend)
