"""MetaSchedule tuning for the CPU kernels of a rank, with one shared, resumable database.

Rules:
1. The database lives in ``db_dir/<sha256 of the target JSON>[:16]/`` (a MetaSchedule
   ``JSONDatabase``: ``database_workload.json`` + ``database_tuning_record.json``), so a
   database tuned for another CPU is never applied silently; ``target.json`` beside it says
   which target it is for.
2. Tasks are the fused PrimFuncs that the ``"scheduled"`` pipeline produces before its
   schedule phase (same layout, same fusion), keyed structurally: a kernel that appears in
   several ranks or models is one task, tuned once.
3. Only contraction kernels (a reduction block that reads two or more buffers: conv, matmul,
   dense, batched matmul) are tuned; elementwise kernels and one-buffer reductions (softmax,
   LayerNorm, pooling) keep the default schedules.
4. :func:`tune` brings every task to ``trials`` trials in total: a task the database has no
   record of gets them all, one tuned with fewer before (``trials.json`` counts them) gets the
   difference (a top-up that starts from its records), one with as many is skipped (resume);
   when no task needs trials it does nothing.
5. :func:`apply_database` compiles with the database: tuned kernels replace their default
   schedule, the rest get the default schedules; it never tunes.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any

from partitioner.core.errors import BackendError

from .pipeline import legalize_passes, pre_legalize, schedule_passes

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


def prepare(mod: Any, target: Any, conv_algorithm: str = "direct", conv_cache: Any = None,
            facts: dict[str, Any] | None = None) -> Any:
    """The module as the scheduled pipeline has it just before its schedule phase."""
    import tvm

    mod = pre_legalize(mod, target, conv_algorithm, conv_cache, facts)
    with target:
        return tvm.transform.Sequential(legalize_passes(target))(mod)


def _region_name(region: Any) -> str:
    """The name of the buffer (``tensor`` in TVM 0.27's TensorRegion) a block region covers."""
    buf = getattr(region, "buffer", None) or getattr(region, "tensor", None)
    return str(buf.name) if buf is not None else str(region)


def is_contraction(func: Any) -> bool:
    """Whether ``func`` has a contraction block: a reduction over two or more buffers.

    A contraction block reduces over an axis that indexes at least two distinct input buffers:
    a multiply-accumulate (conv, matmul, dense, batched matmul). Reductions that index one
    buffer along the reduced axis (softmax's max and sum, LayerNorm's moments, pooling) are
    excluded: they are memory-bound, the default schedules serve them, and MetaSchedule's
    builder spent minutes on a single softmax candidate.
    """
    from tvm import s_tir, tirx
    from tvm.tirx.analysis import undefined_vars

    sch = s_tir.Schedule(func)
    stack = [sch.get_sblock("root")]
    while stack:
        b = stack.pop()
        block = sch.get(b)
        reduce_vars = {iv.var.name for iv in block.iter_vars if iv.iter_type == tirx.IterVar.CommReduce}
        if reduce_vars:
            written = {_region_name(w) for w in block.writes}
            indexed = set()
            for r in block.reads:
                name = _region_name(r)
                if name in written:
                    continue
                used = {v.name for rng in r.region for v in undefined_vars(rng.min)}
                if used & reduce_vars:
                    indexed.add(name)
            if len(indexed) >= 2:
                return True
        stack.extend(sch.get_child_blocks(b))
    return False


def extract_tasks(prepared: Any, target: Any) -> list[Any]:
    """MetaSchedule tasks for the contraction kernels of a prepared module."""
    from tvm.s_tir import meta_schedule as ms

    tasks = ms.relax_integration.extract_tasks(prepared, target)
    return [t for t in tasks if is_contraction(t.dispatched[0]["main"])]


def _in_process_builder_runner(progress: TuningProgress | None = None) -> tuple[Any, Any]:
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
            if progress is not None:
                secs = [min(float(x) for x in f.res) for f in futures if getattr(f, "res", None)]
                progress.measured(len(runner_inputs), min(secs) if secs else None)
            return futures

    del ms
    return InProcessBuilder(), InProcessRunner()


class TuningProgress:
    """``tuning [####......] 96/1024 trials, 2/16 kernels done, best 0.412 ms, 3m05s`` on stderr.

    Driven by the in-process runner, which sees every batch of candidates as it is timed
    (MetaSchedule's measure callbacks only run once the warm-up round over all tasks is over).
    On a TTY the line is redrawn in place; elsewhere one plain line per timed batch, so captured
    logs stay readable. ``best`` is the fastest candidate of the batch just timed.
    """

    def __init__(self, n_tasks: int, trials: int, stream: Any) -> None:
        import time

        self.total, self.per_task, self.stream = n_tasks * trials, trials, stream
        self.n_tasks = n_tasks
        self.tty = bool(getattr(stream, "isatty", lambda: False)())
        self.done = 0
        self.started = time.monotonic()
        self._bar = None
        if self.tty:
            from tqdm import tqdm

            self._bar = tqdm(total=self.total, desc="tuning", unit="trial", file=stream, dynamic_ncols=True)

    def measured(self, n: int, best: float | None) -> None:
        import time

        before, self.done = self.done, min(self.total, self.done + n)
        best_s = "" if best is None else f", best {best * 1e3:.3f} ms" if best >= 1e-3 else f", best {best * 1e6:.1f} us"
        if self._bar is not None:
            self._bar.set_postfix_str(f"{self.done // max(self.per_task, 1)}/{self.n_tasks} kernels{best_s}",
                                      refresh=False)
            self._bar.update(self.done - before)
            return
        filled = int(30 * self.done / max(self.total, 1))
        secs = int(time.monotonic() - self.started)
        line = (f"tuning [{'#' * filled}{'.' * (30 - filled)}] {self.done}/{self.total} trials, "
                f"{self.done // max(self.per_task, 1)}/{self.n_tasks} kernels{best_s}, {secs // 60}m{secs % 60:02d}s")
        self.stream.write(line + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def _covered(db: Any, task: Any, target: Any) -> bool:
    return db.query_schedule(task.dispatched[0], target, "main") is not None


def missing_tasks(mod: Any, target: Any, db_dir: str | Path) -> list[str]:
    """Names of the contraction kernels of ``mod`` that the database has no record for."""
    target = tuning_target(target)
    db = open_database(db_dir, target)
    return [t.task_name for t in extract_tasks(prepare(mod, target), target) if not _covered(db, t, target)]


TRIALS_FILE = "trials.json"  # per kernel: the trials asked of it so far (for top-ups)


def _task_key(task: Any) -> str:
    import tvm_ffi  # TVM 0.27 moved structural_hash out of tvm.ir

    return f"{task.task_name}:{tvm_ffi.structural_hash(task.dispatched[0]) & 0xFFFFFFFFFFFFFFFF:016x}"


def _trials_done(db_dir: str | Path, target: Any) -> dict[str, int]:
    path = database_dir(db_dir, target) / TRIALS_FILE
    try:
        data = json.loads(path.read_text())
        return {str(k): int(v) for k, v in data.items()} if isinstance(data, dict) else {}
    except (OSError, ValueError, TypeError):
        return {}


def prepare_for_database(mod: Any, target: Any, db_dir: str | Path, conv_algorithm: str = "direct") -> tuple[Any, dict[str, Any]]:
    """``(prepared module, conv facts)`` for :func:`tune` and :func:`apply_database`: prepared once
    when a build does both (the layout and constant folding take seconds on a resnet)."""
    target = tuning_target(target)
    facts: dict[str, Any] = {}
    return prepare(mod, target, conv_algorithm, conv_cache_file(db_dir, target), facts), facts


def tune(mod: Any, target: Any, trials: int, db_dir: str | Path, progress: bool = True,
         conv_algorithm: str = "direct", prepared: Any = None) -> Any:
    """Bring every contraction kernel of ``mod`` to ``trials`` trials in total; return the database.

    A kernel the database has no record of gets ``trials`` trials; one tuned before with fewer
    (``trials.json`` beside the records) gets the difference, and MetaSchedule's search starts
    from the records it already has; one with as many or more is skipped (rule 4). Kernels
    grouped by the trials they still need are tuned together. ``prepared``: the module from
    :func:`prepare_for_database` (with the same ``conv_algorithm``), when the caller has it.
    """
    target = tuning_target(target)
    import sys

    from tvm.s_tir import meta_schedule as ms

    db = open_database(db_dir, target)
    done = _trials_done(db_dir, target)
    need: dict[int, list[Any]] = {}
    if prepared is None:
        prepared, _ = prepare_for_database(mod, target, db_dir, conv_algorithm)
    for t in extract_tasks(prepared, target):
        # a kernel with records but no count (a database from before trials.json) counts as done
        had = done.get(_task_key(t), trials if _covered(db, t, target) else 0)
        if trials - had > 0:
            need.setdefault(trials - had, []).append(t)
    if not need or trials <= 0:
        return db
    work_dir = database_dir(db_dir, target)
    n_tasks = sum(len(ts) for ts in need.values())
    if progress:
        print(f"tuning {n_tasks} kernel(s) up to {trials} trials each, database {work_dir} "
              f"(MetaSchedule's logs in its logs/ folder; PARTITIONER_TUNING_VERBOSE=1 shows them here)",
              file=sys.stderr, flush=True)
    # MetaSchedule's console handler takes this logger's level: WARNING keeps its per-round
    # tables and XGBoost lines out of the terminal; they still go to <database>/logs/*.log
    ms_logger = logging.getLogger("tvm.s_tir.meta_schedule")
    ms_logger.setLevel(logging.DEBUG if os.environ.get("PARTITIONER_TUNING_VERBOSE") else logging.WARNING)
    # MetaSchedule re-creates its loggers with dictConfig, naming every handler already on this
    # logger; an unnamed one (pytest's capture handler, an application's own) made it fail with
    # "'NoneType' object has no attribute 'format'": set those aside while tuning
    unnamed = [h for h in ms_logger.handlers if not h.get_name()]
    for h in unnamed:
        ms_logger.removeHandler(h)
    try:
        _tune_groups(ms, need, trials, db, work_dir, done, progress)
    finally:
        for h in unnamed:
            ms_logger.addHandler(h)
    return db


def _tune_groups(ms: Any, need: dict[int, list[Any]], trials: int, db: Any, work_dir: Path, done: dict[str, int],
                 progress: bool) -> None:
    import sys

    for remaining, tasks in sorted(need.items(), reverse=True):
        bar = TuningProgress(len(tasks), remaining, sys.stderr) if progress else None
        callbacks = [ms.measure_callback.AddToDatabase(), ms.measure_callback.UpdateCostModel()]
        contexts, weights = ms.relax_integration.extracted_tasks_to_tune_contexts(tasks, str(work_dir), seed=0)
        builder, runner = _in_process_builder_runner(bar)
        try:
            ms.tune_tasks(tasks=contexts, task_weights=weights, work_dir=str(work_dir / "logs"),
                          max_trials_global=remaining * len(contexts), max_trials_per_task=remaining,
                          num_trials_per_iter=max(1, min(64, remaining)), database=db, builder=builder,
                          runner=runner, cost_model="xgb",
                          # no RemoveBuildArtifact: in-process artifacts are not files
                          measure_callbacks=callbacks)
        except Exception as e:
            msg = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
            raise BackendError(f"MetaSchedule tuning failed ({msg}); check apache-tvm-ffi==0.1.14.post0, psutil and xgboost are installed") from None
        if bar is not None:
            bar.close()
        done.update({_task_key(t): trials for t in tasks})
        try:
            (work_dir / TRIALS_FILE).write_text(json.dumps(done, indent=1, sort_keys=True) + "\n")
        except OSError as e:
            raise BackendError(f"{work_dir / TRIALS_FILE}: cannot record the trials ({e.strerror})") from None


def conv_cache_file(db_dir: str | Path, target: Any) -> Path:
    """Where ``conv_algorithm="auto"`` keeps its measurements beside the tuning records."""
    from .conv_algorithms import CACHE_FILE

    return database_dir(db_dir, target) / CACHE_FILE


def apply_database(mod: Any, target: Any, db_dir: str | Path, pipeline: str = "scheduled",
                   conv_algorithm: str = "direct", prepared: tuple[Any, dict[str, Any]] | None = None
                   ) -> tuple[Any, dict[str, Any]]:
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
    prepared, conv_facts = prepared if prepared is not None else prepare_for_database(mod, target, db_dir, conv_algorithm)
    tasks = extract_tasks(prepared, target)
    missing = [t.task_name for t in tasks if not _covered(db, t, target)]
    with target, db:
        applied = relax.transform.MetaScheduleApplyDatabase()(prepared)
        out = tvm.transform.Sequential(schedule_passes(target))(applied)
    facts = {"tuned": len(tasks) > len(missing), "tuned_kernels": len(tasks) - len(missing),
             "untuned_kernels": missing, "database": str(database_dir(db_dir, target)), **conv_facts}
    return out, facts
