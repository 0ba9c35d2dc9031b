"""Compile per-rank programs into TVM shared libraries (``rank<i>.so``).

Rules:
1. One rank: lower (:mod:`backends.tvm.lower`) -> the Relax pipeline of
   :mod:`backends.tvm.pipeline` (``options["pipeline"]``: ``"scheduled"`` by default = NHWC
   layout, legalize/fuse, then the default CPU schedules of :mod:`backends.tvm.schedules`;
   ``"zero"`` = TVM's zero pipeline alone) -> ``tvm.compile(mod, target)`` ->
   ``export_library``. With ``options["tune_trials"] > 0`` the fused kernels are first tuned
   with MetaSchedule into ``options["tuning_db"]`` (see :mod:`backends.tvm.tuning`); a
   database that already covers every kernel is applied without tuning again. On CUDA the
   same pipeline schedules with dlight's GPU rules (:mod:`backends.tvm.schedules.gpu`), since
   unscheduled kernels do not build for a GPU; the build cross-compiles with NVRTC and needs no
   GPU, tuning for CUDA does (it times candidates).
2. Many ranks (:func:`build_all`): ranks whose programs are byte-identical once the graph name
   is cleared are compiled once and the library copied; distinct programs compile in parallel,
   each in a fresh ``python -m backends.tvm.compile_worker`` process (see that module for why
   not multiprocessing). Progress goes to stderr (see progress.py).
3. Build facts are plain JSON-able dicts for the manifest: target dict, versions, sha256, times.
4. ``options["threads"]``: the threads each rank's library will run on, when the caller knows it
   (``partitioner.compiler``: the plan's threads per rank on one node's CPU cores); the default
   schedules are chosen for it (:func:`backends.tvm.schedules.threads.building_for`: a build for
   1 thread has no parallel loops). Absent: unknown, the schedules' thresholds decide as before.
5. After scheduling, a program that names its step constants (training pipeline stages) has its
   weight-only kernels lifted into ``main_transform_params``
   (:mod:`backends.tvm.lift_step_constants`); any other program builds unchanged.
6. ``options["conv_algorithm"]`` (:mod:`backends.tvm.conv_algorithms`, CPU ``scheduled`` pipeline):
   absent means :func:`~backends.tvm.conv_algorithms.default_algorithm`, ``"auto"`` unless
   ``$PARTITIONER_CONV_ALGORITHM`` says otherwise: each distinct eligible conv measured once per
   machine (cached in the tuning database when one is given, else in this machine's cache,
   ``partitioner.calibrate_cache`` rule 5). The facts name the algorithm per conv
   (``conv_algorithms``: counts; ``conv_choices``: per distinct conv, measured or from the cache).
7. The facts give ``constant_bytes``, the weights and other constants the library holds as built
   (:func:`~backends.tvm.weight_params.library_constant_bytes`: after Winograd, packing and folding),
   which ``bench`` prices the rank's peak memory with (``cost/memory.py``,
   ``with_library_constants``). Absent for a rank with ONNX Runtime fallback segments: their
   sessions hold weights the library does not.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import Any, Callable

import onnx

from partitioner.core.errors import BackendError, PartitionerError
from partitioner.core.files import sha256_file

from . import lift_step_constants, parallel_scope
from .lower import lower_program
from .progress import BuildProgress
from .schedules.gpu import cuda_kernel_count
from .schedules.threads import building_for
from .target import gpu_facts, target_dict
from .weight_params import library_constant_bytes

NAME = "tvm"
FILE_SUFFIX = ".so"
DEFAULT_PIPELINE = "scheduled"  # see backends/tvm/pipeline.py

# Found by building the same program twice and comparing sha256 (tests/backends/test_tvm_backend.py
# checks it stays true): TVM's codegen and the host linker are deterministic for a fixed target
# and toolchain, and export_library links from fixed object-file names.
REPRODUCIBLE = {"reproducible": True, "why": "same program + target + TVM/LLVM/linker versions give a byte-identical .so"}


def program_key(program: onnx.ModelProto) -> str:
    """sha256 of the program with its graph name cleared, and the file, offset and length of every
    weight that is built as a parameter (only its name, type and shape reach the library):
    equal keys build equal libraries."""
    p = onnx.ModelProto()
    p.CopyFrom(program)
    p.graph.name = ""
    for t in p.graph.initializer:
        if t.data_location == onnx.TensorProto.EXTERNAL and not t.raw_data:
            del t.external_data[:]
    return hashlib.sha256(p.SerializeToString(deterministic=True)).hexdigest()


def _versions() -> dict[str, str]:
    import tvm

    return {"tvm": str(tvm.__version__), "onnx": onnx.__version__}


def _cpu_module(mod: Any, target: Any, pipeline: str, options: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """Run the CPU pipeline; tune into / apply the tuning database when options ask for it."""
    from .pipeline import run_pipeline

    trials = int(options.get("tune_trials") or 0)
    db_dir = options.get("tuning_db")
    from .conv_algorithms import ALGORITHMS, default_algorithm, machine_cache_file

    conv = str(options.get("conv_algorithm") or default_algorithm())  # rule 6
    if conv not in ALGORITHMS:
        raise BackendError(f"unknown conv_algorithm {conv!r}; use one of {', '.join(ALGORITHMS)}")
    if trials > 0 and str(target.kind.name) == "cuda":
        from .schedules.gpu import require_gpu_for_tuning

        require_gpu_for_tuning(target)
    if trials <= 0 and not db_dir:
        facts: dict[str, Any] = {}
        cache = machine_cache_file(target) if conv == "auto" else None
        return run_pipeline(mod, pipeline, target, conv_algorithm=conv, conv_cache=cache, facts=facts), facts
    from . import tuning

    if not db_dir:
        raise BackendError("options tune_trials > 0 needs a tuning database directory; pass --tuning-db DIR")
    prepared = tuning.prepare_for_database(mod, target, db_dir, conv)  # once, for tuning and applying
    if trials > 0:
        tuning.tune(mod, target, trials, db_dir, progress=bool(options.get("tune_progress", False)),
                    conv_algorithm=conv, prepared=prepared[0])
    return tuning.apply_database(mod, target, db_dir, pipeline=pipeline, conv_algorithm=conv, prepared=prepared)


def build_one(
    program: onnx.ModelProto,
    out_path: Path,
    tdict: dict[str, Any],
    options: dict[str, Any] | None = None,
    report: Callable[[str], None] = lambda stage: None,
) -> dict[str, Any]:
    """Build one rank with an already-resolved target dict; ``report(stage)`` tracks progress.
    The build runs on a thread with a large stack (:mod:`backends.tvm.deep_stack`: TVM's passes
    recurse along the graph; an unrolled decoder overflowed the main thread's 8 MiB)."""
    from . import deep_stack

    return deep_stack.run(_build_one, program, out_path, tdict, options, report)


def _thread_threshold_facts(tdict: dict[str, Any], options: dict[str, Any]) -> dict[str, Any]:
    """The FLOP threshold for parallel kernels and its source (schedules/threads.py), for CPU
    builds that may use more than one thread."""
    if tdict.get("kind") == "cuda" or int(options.get("threads") or 0) == 1:
        return {}
    from .schedules.threads import parallel_min_flops_and_source

    value, source = parallel_min_flops_and_source()
    return {"parallel_min_flops": {"value": round(value), "source": source}}


def _build_one(program: onnx.ModelProto, out_path: Path, tdict: dict[str, Any], options: dict[str, Any] | None,
               report: Callable[[str], None]) -> dict[str, Any]:
    import tvm

    options = dict(options or {})
    pipeline = options.get("pipeline", DEFAULT_PIPELINE)
    out_path = Path(out_path)
    times: dict[str, float] = {}
    tuning: dict[str, Any] = {}
    conv_used = conv_choices = None

    report("import")
    t0 = time.perf_counter()
    lowered = lower_program(program)
    times["import_s"] = time.perf_counter() - t0

    report("build")
    t0 = time.perf_counter()
    try:
        target = tvm.target.Target(tdict)
        # one pipeline for both (backends/tvm/pipeline.py): on CUDA it schedules with dlight's GPU rules
        with building_for(options.get("threads")):  # rule 4: a 1-thread build has no parallel loops
            mod, tuning = _cpu_module(lowered.mod, target, pipeline, options)
        mod = lift_step_constants.lift(mod, program, len(lowered.comm_ops))  # weight-only kernels once per change
        conv_used = tuning.pop("conv_algorithms", None)
        conv_choices = tuning.pop("conv_choices", None)
        prim_funcs = sum(1 for _, f in mod.functions.items() if isinstance(f, tvm.tirx.PrimFunc))
        # rule 7: the constants the library will hold (none priced for ranks with ORT segments)
        constant_bytes = None if lowered.fallback_segments else library_constant_bytes(mod)
        ex = parallel_scope.compile(mod, target)  # parallel loop bodies with no-alias pointers
    except PartitionerError:
        raise
    except Exception as e:
        msg = tvm_error_line(e)
        raise BackendError(f"graph {program.graph.name!r}: TVM build failed for target {tdict} ({msg})") from None
    times["build_s"] = time.perf_counter() - t0

    report("export")
    t0 = time.perf_counter()
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_path.with_name(out_path.name + ".tmp" + FILE_SUFFIX)
    try:
        ex.export_library(str(tmp))
        os.replace(tmp, out_path)
    except Exception as e:
        raise BackendError(f"{out_path}: export_library failed ({str(e).strip().splitlines()[-1] if str(e).strip() else e}); is a C compiler (cc/g++) installed?") from None
    finally:
        if tmp.exists():
            tmp.unlink()
    times["export_s"] = time.perf_counter() - t0
    report("done")

    return {
        "backend": NAME,
        "file": out_path.name,
        "sha256": sha256_file(out_path),
        "bytes": out_path.stat().st_size,
        "target": dict(tdict),
        **({"gpu": {**(gpu_facts(tdict) or {}), "kernels": cuda_kernel_count(ex.mod), "prim_funcs": prim_funcs}}
           if tdict.get("kind") == "cuda" else {}),
        "pipeline": pipeline,
        **({"threads": int(options["threads"])} if options.get("threads") else {}),
        **_thread_threshold_facts(tdict, options),
        "tuned": bool(tuning.get("tuned", False)),
        **({"tuning": tuning} if tuning else {}),
        **({"conv_algorithms": conv_used} if conv_used else {}),
        **({"conv_choices": conv_choices} if conv_choices else {}),
        **({"constant_bytes": constant_bytes} if constant_bytes is not None else {}),
        "segments": lowered.segments,
        "comm_ops": len(lowered.comm_ops),
        "program_sha256": program_key(program),
        "versions": _versions(),
        "times": {k: round(v, 3) for k, v in times.items()},
        "compiled": True,
        **REPRODUCIBLE,
    }


def build(program: onnx.ModelProto, out_path: Path, *, target: Any = None, options: dict[str, Any] | None = None) -> dict[str, Any]:
    """Backend contract: compile ``program`` to ``out_path`` and return the build facts."""
    return build_one(program, Path(out_path), target_dict(target), options)


# -- many ranks -------------------------------------------------------------------------------


def tvm_error_line(exc: BaseException) -> str:
    """The informative line of a TVM error: TVM appends metadata notes ("# Metadata omitted...")
    after the message, so prefer the error line itself, then the offending call."""
    lines = [ln.strip() for ln in str(exc).strip().splitlines() if ln.strip()]
    for pattern in ("Error:", "error:", "Offending call", "Check failed"):
        hit = next((ln for ln in lines if pattern in ln and not ln.startswith("#")), None)
        if hit:
            return hit[:300]
    useful = [ln for ln in lines if not ln.startswith("#")]
    return (useful[0] if useful else type(exc).__name__)[:300]


def build_all(
    programs: list[onnx.ModelProto],
    out_dir: Path,
    *,
    target: Any = None,
    jobs: int | None = None,
    progress: bool | None = None,
    options: dict[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """Build ``rank<i>.so`` for every program into ``out_dir``; returns facts per rank.

    ``jobs``: parallel compiles (default: CPU count); 1 compiles in this process.
    ``progress``: None shows the bar only on a TTY, True forces it, False silences it.
    A rank whose program equals an earlier rank's gets ``"compiled": False, "same_as": j``.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tdict = target_dict(target)
    keys = [program_key(p) for p in programs]
    first: dict[str, int] = {}
    for i, k in enumerate(keys):
        first.setdefault(k, i)
    unique = sorted(first.values())
    paths = [out_dir / f"rank{i}{FILE_SUFFIX}" for i in range(len(programs))]
    bar = BuildProgress(unique, enabled=progress)
    jobs = max(1, min(jobs or os.cpu_count() or 1, len(unique)))
    facts: dict[int, dict[str, Any]] = {}

    if jobs == 1:
        for i in unique:
            facts[i] = build_one(programs[i], paths[i], tdict, options, lambda s, i=i: bar.update(i, s))
    else:
        facts.update(_build_in_subprocesses(programs, unique, paths, tdict, options, jobs, bar))
    bar.close()

    result = []
    for i, k in enumerate(keys):
        j = first[k]
        if i == j:
            result.append(facts[i])
            continue
        shutil.copyfile(paths[j], paths[i])
        f = dict(facts[j], file=paths[i].name, compiled=False, same_as=j)
        f["times"] = {}
        result.append(f)
    return result


def _worker_env() -> dict[str, str]:
    """The child must import this checkout's ``backends`` and ``partitioner`` packages."""
    root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ)
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def _build_in_subprocesses(programs, unique, paths, tdict, options, jobs, bar) -> dict[int, dict[str, Any]]:
    lock = threading.Lock()
    failed = threading.Event()
    procs: list[subprocess.Popen] = []
    env = _worker_env()

    with tempfile.TemporaryDirectory(prefix="tvm-build-") as tmp:

        def one(i: int) -> dict[str, Any]:
            if failed.is_set():
                raise BackendError(f"rank {i}: not built because another rank's build failed")
            program_path = Path(tmp) / f"rank{i}.onnx"
            program_path.write_bytes(programs[i].SerializeToString())
            cmd = [sys.executable, "-m", "backends.tvm.compile_worker", str(program_path), str(paths[i]),
                   json.dumps(tdict), json.dumps(options or {})]
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
            with lock:
                procs.append(proc)
            facts, error = None, None
            assert proc.stdout is not None
            for line in proc.stdout:
                kind, _, rest = line.rstrip("\n").partition(" ")
                if kind == "stage":
                    with lock:
                        bar.update(i, rest)
                elif kind == "facts":
                    facts = json.loads(rest)
                elif kind == "error":
                    error = rest
            stderr = proc.stderr.read() if proc.stderr else ""
            rc = proc.wait()
            if error is not None:
                raise BackendError(error)
            if rc != 0 or facts is None:
                last = stderr.strip().splitlines()[-1] if stderr.strip() else f"exit status {rc}"
                raise BackendError(f"rank {i}: TVM build process failed ({last})")
            return facts

        results: dict[int, dict[str, Any]] = {}
        with ThreadPoolExecutor(max_workers=jobs) as pool:
            futures = {pool.submit(one, i): i for i in unique}
            first_error: BaseException | None = None
            for fut in as_completed(futures):
                try:
                    results[futures[fut]] = fut.result()
                except BaseException as e:  # stop the other builds, report the first failure
                    if first_error is None:
                        first_error = e
                        failed.set()
                        with lock:
                            for p in procs:
                                if p.poll() is None:
                                    p.kill()
            if first_error is not None:
                raise first_error
    return results
