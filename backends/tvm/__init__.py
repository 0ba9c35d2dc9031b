"""The TVM backend: per-rank ONNX programs -> Relax -> ``rank<i>.so``, run by the Relax VM.

Modules: ``target`` (host detection, presets, specs), ``lower`` (program -> Relax IRModule with
comm ops as packed calls), ``build`` (compile/export, many ranks in parallel), ``executable``
(load a library, bind comm ops to a communicator), ``progress`` (text progress bar).
TVM itself is imported lazily, so importing this package is cheap.
"""

from __future__ import annotations

from .build import FILE_SUFFIX, NAME, build, build_all, program_key
from .executable import TvmRankExecutable, configure_threads, load
from .target import detect_host_target, resolve_target, target_dict

__all__ = [
    "FILE_SUFFIX",
    "NAME",
    "TvmRankExecutable",
    "build",
    "build_all",
    "configure_threads",
    "detect_host_target",
    "load",
    "program_key",
    "resolve_target",
    "target_dict",
]
