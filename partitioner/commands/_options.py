"""Options shared by several sub-commands (DESIGN.md, "CLI").

Each ``add_*`` function adds one group of options; ``*_from_args`` turns the parsed values into
project objects. Heavy imports happen inside the functions.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from typing import Any

from partitioner.core.errors import UsageError
from partitioner.core.files import json_default

STRATEGIES = ("auto", "single", "data", "pipeline", "tensor", "spatial", "hybrid")

_SIZE_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "kib": 2**10, "m": 1e6, "mb": 1e6, "mib": 2**20,
               "g": 1e9, "gb": 1e9, "gib": 2**30, "t": 1e12, "tb": 1e12, "tib": 2**40}


def parse_bytes(text: str) -> int:
    """'512MiB', '8GB', '1e9' -> bytes."""
    m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _SIZE_UNITS:
        raise UsageError(f"cannot read the size {text!r}: use e.g. 512MiB, 8GB or 1e9")
    try:
        return int(float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()])
    except ValueError:
        raise UsageError(f"cannot read the size {text!r}: use e.g. 512MiB, 8GB or 1e9") from None


def parse_shape_option(items: list[str] | None) -> dict[str, list[int]]:
    """``--shape input=1,3,224,224`` (repeatable) -> {'input': [1, 3, 224, 224]}."""
    shapes: dict[str, list[int]] = {}
    for item in items or []:
        name, sep, dims = item.partition("=")
        if not sep or not name:
            raise UsageError(f"--shape {item!r}: expected NAME=D0,D1,... e.g. input=1,3,224,224")
        try:
            shapes[name] = [int(d) for d in dims.replace("x", ",").split(",") if d.strip()]
        except ValueError:
            raise UsageError(f"--shape {item!r}: dimensions must be integers") from None
        if any(d <= 0 for d in shapes[name]):
            raise UsageError(f"--shape {item!r}: dimensions must be positive")
    return shapes


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", metavar="MODEL", help="an .onnx file, or a zoo name (see `partitioner zoo list`)")
    p.add_argument("--batch", type=int, default=None, help="bind the batch (first) dimension of symbolic inputs")
    p.add_argument("--shape", action="append", metavar="NAME=DIMS",
                   help="bind an input's shape, e.g. --shape input=1,3,224,224 (repeatable)")
    p.add_argument("--const", action="append", metavar="NAME=VALUE",
                   help="bind an input to a value, e.g. --const sr=16000 or --const mask=1,0,1; the input "
                        "becomes a constant and an If on it folds (repeatable)")
    p.add_argument("--passes", default=None,
                   help="comma-separated pass names to run instead of the default clean-up pipeline "
                        "('none' runs no pass)")


def add_shapes_only_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--shapes-only", action="store_true",
                   help="accept a model whose external data file is absent (plan a model you do not have yet); "
                        "weights are never read either way (docs/large_models.md)")


def add_cluster_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_mutually_exclusive_group()
    g.add_argument("--devices", type=int, default=None, metavar="N", help="N devices of this machine (cpu:N)")
    g.add_argument("--cluster", default=None, metavar="FILE|PRESET",
                   help="a cluster file or preset: cpu:N, local, h100x8, h200x8, h200:4x8, a100:16x8, edge")


def add_strategy_arguments(p: argparse.ArgumentParser, default: str = "auto") -> None:
    p.add_argument("--strategy", choices=STRATEGIES, default=default, help=f"partitioning strategy (default {default})")
    p.add_argument("--microbatches", type=int, default=None, metavar="M", help="pipeline micro-batch count")
    p.add_argument("--objective", choices=("latency", "throughput"), default="latency")
    p.add_argument("--memory-limit", default=None, metavar="BYTES", help="per-device memory limit, e.g. 8GiB")


def add_json_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print a JSON report on stdout")


def passes_from_args(args: argparse.Namespace) -> list[str] | None:
    """``--passes a,b`` -> ['a', 'b']; 'none' -> []; absent -> None (the default pipeline)."""
    passes = getattr(args, "passes", None)
    return None if passes is None else [s for s in passes.split(",") if s and s != "none"]


def load_model_from_args(args: argparse.Namespace, keep_source: bool = False) -> Any:
    """Load (and validate) the MODEL argument, bind shapes and run the passes
    (:func:`partitioner.compiler.prepare`). Returns an ir.Model, or with ``keep_source`` the pair
    (ir.Model, the ModelProto as loaded before the passes)."""
    from partitioner.bind_inputs import parse_const_option
    from partitioner.compiler import prepare

    model, source = prepare(args.model, batch=getattr(args, "batch", None),
                            shapes=parse_shape_option(getattr(args, "shape", None)),
                            passes=passes_from_args(args), keep_source=keep_source,
                            shapes_only=getattr(args, "shapes_only", False),
                            constants=parse_const_option(getattr(args, "const", None)))
    return (model, source) if keep_source else model


def cluster_from_args(args: argparse.Namespace) -> Any:
    import re

    from partitioner.cluster import resolve_cluster

    backend = getattr(args, "backend", None) or "tvm"
    spec = getattr(args, "cluster", None)
    if spec and not re.fullmatch(r"\s*cpu(:\d+)?\s*", str(spec).lower()):
        return resolve_cluster(spec)
    if spec:
        _calibrate_on_first_use(backend)
        return resolve_cluster(spec, backend)
    devices = getattr(args, "devices", None)
    if devices is not None and devices < 1:
        raise UsageError("--devices must be at least 1")
    if getattr(args, "target", None) and getattr(args, "backend", "tvm") == "tvm":
        from backends.tvm.target import gpu_cluster_spec

        gpu = gpu_cluster_spec(args.target, devices or 1)  # --target h200: plan for H200s, not CPU cores
        if gpu is not None:
            return resolve_cluster(gpu)
    _calibrate_on_first_use(backend)
    return resolve_cluster(devices or 1, backend)


def _calibrate_on_first_use(backend: str) -> None:
    """``cpu:N`` plans with this machine's calibrated figures: run the quick calibration once
    when the cache has none (partitioner/calibrate_cache.py; off with PARTITIONER_AUTO_CALIBRATE=0)."""
    from partitioner.calibrate_cache import ensure_calibrated

    def run(b: str) -> None:
        from partitioner.calibrate import calibrate_and_cache

        calibrate_and_cache(b, quick=True)

    ensure_calibrated(backend, run)


def print_json(obj: Any) -> None:
    json.dump(obj, sys.stdout, indent=2, sort_keys=False, default=json_default)
    sys.stdout.write("\n")
