"""MetaSchedule tuning for the CPU kernels of a rank, with one shared, resumable database.

Rules:
1. The database lives in ``db_dir/<sha256 of the target JSON>[:16]/`` (a MetaSchedule
   ``JSONDatabase``: ``database_workload.json`` + ``database_tuning_record.json``), so a
   database tuned for another CPU is never applied silently; ``target.json`` beside it says
   which target it is for.
2. Tasks are the fused PrimFuncs that the ``"scheduled"`` pipeline produces before its
   schedule phase (same layout, same fusion), keyed structurally: a kernel that appears in
   several ranks or models is one task, tuned once.
3. Only contraction kernels (a PrimFunc with a reduction block: conv, matmul, pooling) are
   tuned; elementwise kernels keep the default schedules.
4. :func:`tune` skips every task the database already has a record for (resume), and does
   nothing when all are covered. ``trials`` is the number of trials per task.
5. :func:`apply_database` compiles with the database: tuned kernels replace their default
   schedule, the rest get the default schedules; it never tunes.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from partitioner.errors import BackendError

from .pipeline import layout_passes, legalize_passes, schedule_passes, simplify_passes

_BUILT: dict[str, Any] = {}  # artifact key -> runtime module, between builder and runner
WORKLOAD_FILE = "database_workload.json"
RECORD_FILE = "database_tuning_record.json"


def tuning_target(target: Any) -> Any:
    """``target`` with ``num-cores`` set (MetaSchedule needs it on the CPU): the host's count."""
    import os

    import tvm

    export = dict(target.export())
    if str(target.kind.name) != "llvm" or export.get("num-cores"):
        return target
    export = {k: v for k, v in export.items() if k not in ("keys", "features") and v is not None}
    export["num-cores"] = os.cpu_count() or 1
    try:
        return tvm.target.Target(export)
    except Exception:
        d = {k: v for k, v in export.items() if k in ("kind", "mcpu", "mtriple", "mattr")}
        return tvm.target.Target({**d, "num-cores": os.cpu_count() or 1})


def target_key(target: Any) -> str:
    """Stable key of a target: sha256 of its JSON export, first 16 hex digits."""
    return hashlib.sha256(_target_json(target).encode()).hexdigest()[:16]


def _target_json(target: Any) -> str:
    try:
        export = dict(target.export())
    except Exception:  # older/newer Target without export(): fall back to its text
        return str(target)
    return json.dumps({k: str(v) for k, v in export.items()}, sort_keys=True)


def database_dir(db_dir: str | Path, target: Any) -> Path:
    """Where the database for ``target`` lives inside ``db_dir``."""
    return Path(db_dir) / target_key(target)


def open_database(db_dir: str | Path, target: Any) -> Any:
    """The JSONDatabase for ``target`` under ``db_dir`` (created empty when missing)."""
    from tvm.s_tir import meta_schedule as ms

    d = database_dir(db_dir, target)
    try:
        d.mkdir(parents=True, exist_ok=True)
        (d / "target.json").write_text(_target_json(target) + "\n")
    except OSError as e:
        raise BackendError(f"{d}: cannot create the tuning database directory ({e.strerror}); pass a writable --tuning-db") from None
    return ms.database.JSONDatabase(str(d / WORKLOAD_FILE), str(d / RECORD_FILE), allow_missing=True)


def prepare(mod: Any, target: Any) -> Any:
    """The module as the scheduled pipeline has it just before its schedule phase."""
    import tvm

    with target:
        return tvm.transform.Sequential(simplify_passes(target) + layout_passes(target) + legalize_passes(target))(mod)


def _has_reduction(func: Any) -> bool:
    """Whether any block of ``func`` has a reduction iterator."""
    from tvm import s_tir, tirx

    sch = s_tir.Schedule(func)
    stack = [sch.get_sblock("root")]
    while stack:
        b = stack.pop()
        if any(iv.iter_type == tirx.IterVar.CommReduce for iv in sch.get(b).iter_vars):
            return True
        stack.extend(sch.get_child_blocks(b))
    return False


def extract_tasks(prepared: Any, target: Any) -> list[Any]:
    """MetaSchedule tasks for the contraction kernels of a prepared module."""
    from tvm.s_tir import meta_schedule as ms

    tasks = ms.relax_integration.extract_tasks(prepared, target)
    return [t for t in tasks if _has_reduction(t.dispatched[0]["main"])]


def _in_process_builder_runner() -> tuple[Any, Any]:
    """A MetaSchedule builder and runner that work in this process.

    TVM's ``LocalBuilder``/``LocalRunner`` ship candidates to worker processes through
    cloudpickle; building and timing in-process needs neither that dependency nor pickle, and
    on a small machine it avoids starting worker interpreters. Candidates are timed one after
    another on this thread (the TVM thread pool still runs their parallel loops).
    """
    import itertools

    from tvm.s_tir import meta_schedule as ms
    from tvm.s_tir.meta_schedule.builder import BuilderResult, PyBuilder
    from tvm.s_tir.meta_schedule.builder.local_builder import default_build
    from tvm.s_tir.meta_schedule.runner import EvaluatorConfig, PyRunner
    from tvm.s_tir.meta_schedule.runner.local_runner import LocalRunnerFuture, default_alloc_argument
    from tvm.s_tir.meta_schedule.runner.utils import run_evaluator_common
    from tvm.ir.utils import derived_object

    counter = itertools.count()

    @derived_object
    class InProcessBuilder(PyBuilder):
        def build(self, build_inputs):  # noqa: ANN001 - MetaSchedule's interface
            results = []
            for inp in build_inputs:
                try:
                    key = f"inproc-{next(counter)}"
                    _BUILT[key] = default_build(inp.mod, inp.target, None)
                    results.append(BuilderResult(key, None))
                except Exception as e:  # a candidate that does not build is a failed trial
                    results.append(BuilderResult(None, f"{type(e).__name__}: {e}"))
            return results

    config = EvaluatorConfig(number=3, repeat=1, min_repeat_ms=20, enable_cpu_cache_flush=False)

    @derived_object
    class InProcessRunner(PyRunner):
        def run(self, runner_inputs):  # noqa: ANN001 - MetaSchedule's interface
            import tvm

            futures = []
            for inp in runner_inputs:
                rt_mod = _BUILT.pop(inp.artifact_path, None)
                try:
                    if rt_mod is None:
                        raise KeyError(inp.artifact_path)
                    dev = tvm.runtime.device(inp.device_type, 0)
                    args = default_alloc_argument(dev, [a.as_json() for a in inp.args_info], 1)
                    futures.append(LocalRunnerFuture(res=run_evaluator_common(rt_mod, dev, config, args)))
                except Exception as e:
                    futures.append(LocalRunnerFuture(error_message=f"{type(e).__name__}: {e}"))
            return futures

    del ms
    return InProcessBuilder(), InProcessRunner()


def _covered(db: Any, task: Any, target: Any) -> bool:
    return db.query_schedule(task.dispatched[0], target, "main") is not None


def missing_tasks(mod: Any, target: Any, db_dir: str | Path) -> list[str]:
    """Names of the contraction kernels of ``mod`` that the database has no record for."""
    target = tuning_target(target)
    db = open_database(db_dir, target)
    return [t.task_name for t in extract_tasks(prepare(mod, target), target) if not _covered(db, t, target)]


def tune(mod: Any, target: Any, trials: int, db_dir: str | Path, progress: bool = True) -> Any:
    """Tune the uncovered contraction kernels of ``mod`` (``trials`` each); return the database."""
    target = tuning_target(target)
    import sys

    from tvm.s_tir import meta_schedule as ms

    db = open_database(db_dir, target)
    tasks = [t for t in extract_tasks(prepare(mod, target), target) if not _covered(db, t, target)]
    if not tasks or trials <= 0:
        return db
    if progress:
        print(f"tuning {len(tasks)} kernel(s), {trials} trials each, database {database_dir(db_dir, target)}",
              file=sys.stderr, flush=True)
    work_dir = database_dir(db_dir, target)
    contexts, weights = ms.relax_integration.extracted_tasks_to_tune_contexts(tasks, str(work_dir / "logs"), seed=0)
    per_iter = max(1, min(64, trials))
    builder, runner = _in_process_builder_runner()
    try:
        ms.tune_tasks(tasks=contexts, task_weights=weights, work_dir=str(work_dir / "logs"),
                      max_trials_global=trials * len(contexts), max_trials_per_task=trials,
                      num_trials_per_iter=per_iter, database=db, builder=builder, runner=runner,
                      cost_model="xgb",
                      # no RemoveBuildArtifact: in-process artifacts are not files
                      measure_callbacks=[ms.measure_callback.AddToDatabase(), ms.measure_callback.UpdateCostModel()])
    except Exception as e:
        msg = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        raise BackendError(f"MetaSchedule tuning failed ({msg}); check apache-tvm-ffi==0.1.14.post0, psutil and xgboost are installed") from None
    return db


def apply_database(mod: Any, target: Any, db_dir: str | Path, pipeline: str = "scheduled") -> tuple[Any, dict[str, Any]]:
    """Compile-ready module: tuned kernels from the database, default schedules for the rest.

    Returns ``(module, facts)`` with facts ``{"tuned": bool, "tuned_kernels": n,
    "untuned_kernels": [names], "database": dir}``.
    """
    import tvm
    from tvm import relax

    target = tuning_target(target)
    if pipeline != "scheduled":
        raise BackendError(f"a tuning database needs the 'scheduled' pipeline, not {pipeline!r}")
    db = open_database(db_dir, target)
    prepared = prepare(mod, target)
    tasks = extract_tasks(prepared, target)
    missing = [t.task_name for t in tasks if not _covered(db, t, target)]
    with target, db:
        applied = relax.transform.MetaScheduleApplyDatabase()(prepared)
        out = tvm.transform.Sequential(schedule_passes(target))(applied)
    facts = {"tuned": len(tasks) > len(missing), "tuned_kernels": len(tasks) - len(missing),
             "untuned_kernels": missing, "database": str(database_dir(db_dir, target))}
    return out, facts
