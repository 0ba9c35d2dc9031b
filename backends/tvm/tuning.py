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
   when no task needs trials it does nothing. A kernel with records but no count (a database
   from before ``trials.json``, or a run killed before it wrote the count) counts the valid
   records it has (:func:`_had`): a killed run is topped up, not taken as complete.
5. :func:`apply_database` compiles with the database: tuned kernels replace their default
   schedule, the rest get the default schedules; it never tunes.
6. Never worse than the default (:data:`NEVER_WORSE`, env ``PARTITIONER_TUNED_NEVER_WORSE=0``
   turns it off). MetaSchedule's search space does not contain our default schedules (the
   packed-B GEMM micro-kernel, the fused epilogues), so its best can be slower than them. When
   :func:`tune` has brought a kernel to its trials (or finds a tuned kernel with no comparison,
   or one made at fewer trials), it times the database's best schedule and the kernel's default
   schedule with the same in-process runner, :data:`COMPARE_ROUNDS` interleaved rounds, and
   records both medians in ``compare.json`` beside ``trials.json``; :func:`apply_database`
   applies a tuned schedule only where it measured faster (a kernel with no comparison, from an
   older database, keeps its tuned schedule). Both are timed as MetaSchedule times candidates:
   layout-rewrite (weight packing) blocks removed, as the build folds them for constant
   weights; a per-call pack of an activation (attention's K^T/V panels) is therefore not
   counted on either side.
7. A budget (``budget_s`` of :func:`tune_tasks_to`): kernels are topped up one at a time, the
   largest total work first (FLOPs x occurrences, :func:`task_flops`), each given the trials
   its remaining time allows at the seconds per trial measured so far on this database
   (``tuning_time.json``; :data:`ASSUMED_S_PER_TRIAL` before any), and the run stops before a
   kernel that would get fewer than :data:`MIN_BUDGET_TRIALS`. ``trials.json`` is written after
   every kernel, so a run stopped by the budget (or killed) leaves a consistent database and the
   next run continues from the counts. :func:`plan` reports the same tasks without tuning.
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
COMPARE_FILE = "compare.json"  # per kernel: default vs tuned time, which one the build uses (rule 6)
TIME_FILE = "tuning_time.json"  # seconds spent tuning and trials asked, for budgets and plans (rule 7)

#: rule 6: a tuned schedule replaces the default only where it measured faster
NEVER_WORSE = os.environ.get("PARTITIONER_TUNED_NEVER_WORSE", "1") != "0"
#: rule 6: interleaved rounds (default, tuned, tuned, default, ...) per comparison; each round is
#: one MetaSchedule measurement (3 runs, at least 20 ms), the median of the rounds counts
COMPARE_ROUNDS = 7
#: rule 7: seconds per trial before this database has measured any (session 5: 2432 trials in
#: ~35 min on 2 cores); replaced by ``tuning_time.json``'s figure once one run finished a kernel
ASSUMED_S_PER_TRIAL = 0.86
#: rule 7: a budget too small to give the next kernel this many trials ends the run
MIN_BUDGET_TRIALS = 16
# MetaSchedule's measurement, the same for candidates and for the comparison of rule 6
_EVALUATOR = {"number": 3, "repeat": 1, "min_repeat_ms": 20, "enable_cpu_cache_flush": False}


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

    config = EvaluatorConfig(**_EVALUATOR)

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


def _had(db: Any, task: Any, target: Any, done: dict[str, int]) -> int:
    """Trials ``task`` has had: ``trials.json``'s count, else its valid records (rule 4)."""
    key = _task_key(task)
    if key in done:
        return done[key]
    if not _covered(db, task, target):
        return 0
    return len(db.get_top_k(db.commit_workload(task.dispatched[0]), 1 << 20))


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _write_json(path: Path, data: dict[str, Any]) -> None:
    """Write ``data`` whole or not at all (a killed run leaves the previous file)."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
        os.replace(tmp, path)
    except OSError as e:
        raise BackendError(f"{path}: cannot write the tuning bookkeeping ({e.strerror})") from None


def comparisons(db_dir: str | Path, target: Any) -> dict[str, dict[str, Any]]:
    """``compare.json`` (rule 6): per kernel key, ``default_us``, ``tuned_us``, ``trials`` (the
    trials the kernel had when compared) and ``use`` (``"tuned"`` or ``"default"``)."""
    return _read_json(database_dir(db_dir, target) / COMPARE_FILE)


def seconds_per_trial(db_dir: str | Path, target: Any) -> tuple[float, str]:
    """Seconds per trial on this database (``tuning_time.json``) and where the figure comes from."""
    t = _read_json(database_dir(db_dir, target) / TIME_FILE)
    if float(t.get("trials", 0)) > 0 and float(t.get("seconds", 0)) > 0:
        return float(t["seconds"]) / float(t["trials"]), f"measured ({int(t['trials'])} trials)"
    return ASSUMED_S_PER_TRIAL, "assumed"


def task_flops(task: Any) -> float:
    """FLOPs of one call of ``task``'s kernel (TVM's estimate; 0 where it cannot tell)."""
    try:
        from tvm.s_tir.analysis import estimate_tir_flops

        return float(estimate_tir_flops(task.dispatched[0]))
    except Exception:
        return 0.0


def prepare_for_database(mod: Any, target: Any, db_dir: str | Path, conv_algorithm: str = "direct") -> tuple[Any, dict[str, Any]]:
    """``(prepared module, conv facts)`` for :func:`tune` and :func:`apply_database`: prepared once
    when a build does both (the layout and constant folding take seconds on a resnet)."""
    target = tuning_target(target)
    facts: dict[str, Any] = {}
    return prepare(mod, target, conv_algorithm, conv_cache_file(db_dir, target), facts), facts


def tune(mod: Any, target: Any, trials: int, db_dir: str | Path, progress: bool = True,
         conv_algorithm: str = "direct", prepared: Any = None, budget_s: float | None = None) -> Any:
    """Bring every contraction kernel of ``mod`` to ``trials`` trials in total; return the database.

    A kernel the database has no record of gets ``trials`` trials; one tuned before with fewer
    (``trials.json`` beside the records) gets the difference, and MetaSchedule's search starts
    from the records it already has; one with as many or more is skipped (rule 4). Kernels
    grouped by the trials they still need are tuned together. ``prepared``: the module from
    :func:`prepare_for_database` (with the same ``conv_algorithm``), when the caller has it.
    ``budget_s``: rule 7.
    """
    target = tuning_target(target)
    if prepared is None:
        prepared, _ = prepare_for_database(mod, target, db_dir, conv_algorithm)
    tune_tasks_to(extract_tasks(prepared, target), target, trials, db_dir, progress, budget_s)
    return open_database(db_dir, target)


def _unique(tasks: list[Any]) -> list[Any]:
    """One task per kernel key (a kernel of several models or batches is tuned once), weights summed."""
    from tvm.s_tir.meta_schedule.extracted_task import ExtractedTask

    out: dict[str, Any] = {}
    for t in tasks:
        k = _task_key(t)
        if k in out:
            o = out[k]
            out[k] = ExtractedTask(o.task_name, o.mod, o.target, list(o.dispatched), int(o.weight) + int(t.weight))
        else:
            out[k] = t
    return list(out.values())


def plan(labelled: list[tuple[str, Any]], target: Any, trials: int, db_dir: str | Path) -> dict[str, Any]:
    """What :func:`tune_tasks_to` would do, without tuning: per distinct kernel its trials done and
    left, FLOPs x occurrences, the models it is in (``labelled``: (model label, task) pairs) and
    the time left at this database's seconds per trial (rule 7)."""
    where: dict[str, list[str]] = {}
    for label, t in labelled:
        where.setdefault(_task_key(t), []).append(label)
    tasks = [t for _, t in labelled]
    target = tuning_target(target)
    db = open_database(db_dir, target)
    done = _trials_done(db_dir, target)
    cmp = comparisons(db_dir, target)
    s_per_trial, source = seconds_per_trial(db_dir, target)
    rows = []
    for t in sorted(_unique(tasks), key=lambda t: -task_flops(t) * int(t.weight)):
        key = _task_key(t)
        had = _had(db, t, target, done)
        c = cmp.get(key, {})
        rows.append({"kernel": t.task_name, "key": key, "models": sorted(set(where.get(key, []))),
                     "occurrences": int(t.weight), "flops": task_flops(t),
                     "trials_done": had, "trials_left": max(0, trials - had),
                     "est_s_left": round(max(0, trials - had) * s_per_trial, 1),
                     **({"default_us": c.get("default_us"), "tuned_us": c.get("tuned_us"), "use": c.get("use")} if c else {})})
    left = sum(r["trials_left"] for r in rows)
    return {"database": str(database_dir(db_dir, target)), "trials_target": trials, "tasks": len(rows),
            "trials_done": sum(min(trials, r["trials_done"]) for r in rows), "trials_left": left,
            "s_per_trial": round(s_per_trial, 3), "s_per_trial_source": source,
            "est_s_left": round(left * s_per_trial, 1), "kernels": rows}


def tune_tasks_to(tasks: list[Any], target: Any, trials: int, db_dir: str | Path, progress: bool = True,
                  budget_s: float | None = None) -> dict[str, Any]:
    """Bring ``tasks`` (from :func:`extract_tasks`, any number of modules) to ``trials`` trials each
    (rule 4), within ``budget_s`` seconds when given (rule 7), then compare each against its
    default schedule (rule 6). Returns ``{"tuned": [keys], "stopped_by_budget": bool}``."""
    import sys
    import time

    from tvm.s_tir import meta_schedule as ms

    started = time.monotonic()
    target = tuning_target(target)
    db = open_database(db_dir, target)
    work_dir = database_dir(db_dir, target)
    done = _trials_done(db_dir, target)
    tasks = _unique(tasks)
    had = {_task_key(t): _had(db, t, target, done) for t in tasks}
    need: dict[int, list[Any]] = {}
    for t in tasks:
        if trials - had[_task_key(t)] > 0:
            need.setdefault(trials - had[_task_key(t)], []).append(t)
    out: dict[str, Any] = {"tuned": [], "stopped_by_budget": False}
    if need and trials > 0:
        n_tasks = sum(len(ts) for ts in need.values())
        if progress:
            print(f"tuning {n_tasks} kernel(s) up to {trials} trials each"
                  + (f" within {budget_s:.0f} s" if budget_s is not None else "") + f", database {work_dir} "
                  f"(MetaSchedule's logs in its logs/ folder; PARTITIONER_TUNING_VERBOSE=1 shows them here)",
                  file=sys.stderr, flush=True)
        if budget_s is None:
            groups = sorted(need.items(), reverse=True)
        else:  # rule 7: one kernel at a time, the largest work first
            order = sorted((t for ts in need.values() for t in ts), key=lambda t: -task_flops(t) * int(t.weight))
            groups = [(trials - had[_task_key(t)], [t]) for t in order]
        with _quiet_metaschedule():
            for remaining, group in groups:
                if budget_s is not None:
                    s_per_trial, _ = seconds_per_trial(db_dir, target)
                    fit = int((budget_s - (time.monotonic() - started)) / s_per_trial)
                    if fit < min(remaining, MIN_BUDGET_TRIALS):
                        out["stopped_by_budget"] = True
                        break
                    remaining = min(remaining, fit)
                _tune_group(ms, group, remaining, db, work_dir, done, had, progress)
                out["tuned"] += [_task_key(t) for t in group]
                if NEVER_WORSE:
                    for t in group:
                        if _covered(db, t, target):
                            compare_kernel(t, target, db_dir, db)
    if NEVER_WORSE:  # tuned kernels never compared, or compared at fewer trials than they have now
        cmp = comparisons(db_dir, target)
        done = _trials_done(db_dir, target)
        for t in tasks:
            key = _task_key(t)
            if _covered(db, t, target) and cmp.get(key, {}).get("trials", -1) < done.get(key, 0):
                compare_kernel(t, target, db_dir, db)
    return out


class _quiet_metaschedule:
    """MetaSchedule's loggers while tuning: its tables in ``<database>/logs`` only, and no
    unnamed handler for its dictConfig to trip over."""

    def __enter__(self) -> None:
        # MetaSchedule's console handler takes this logger's level: WARNING keeps its per-round
        # tables and XGBoost lines out of the terminal; they still go to <database>/logs/*.log
        self.logger = logging.getLogger("tvm.s_tir.meta_schedule")
        self.logger.setLevel(logging.DEBUG if os.environ.get("PARTITIONER_TUNING_VERBOSE") else logging.WARNING)
        # MetaSchedule re-creates its loggers with dictConfig, naming every handler already on this
        # logger; an unnamed one (pytest's capture handler, an application's own) made it fail with
        # "'NoneType' object has no attribute 'format'": set those aside while tuning
        self.unnamed = [h for h in self.logger.handlers if not h.get_name()]
        for h in self.unnamed:
            self.logger.removeHandler(h)

    def __exit__(self, *exc: Any) -> None:
        for h in self.unnamed:
            self.logger.addHandler(h)


def _tune_group(ms: Any, tasks: list[Any], n: int, db: Any, work_dir: Path, done: dict[str, int],
                had: dict[str, int], progress: bool) -> None:
    """``n`` more trials for each of ``tasks``, tuned together; the counts and the time recorded."""
    import sys
    import time

    # the counts before this group, written first: a killed run is resumed from them
    for t in tasks:
        done[_task_key(t)] = had[_task_key(t)]
    _write_json(work_dir / TRIALS_FILE, done)
    bar = TuningProgress(len(tasks), n, sys.stderr) if progress else None
    t0 = time.monotonic()
    try:
        _run_metaschedule(ms, tasks, n, db, work_dir, bar)
    except Exception as e:
        msg = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        raise BackendError(f"MetaSchedule tuning failed ({msg}); check apache-tvm-ffi==0.1.14.post0, psutil and xgboost are installed") from None
    if bar is not None:
        bar.close()
    for t in tasks:
        key = _task_key(t)
        had[key] = done[key] = had[key] + n
    _write_json(work_dir / TRIALS_FILE, done)
    spent = _read_json(work_dir / TIME_FILE)
    _write_json(work_dir / TIME_FILE, {"seconds": round(float(spent.get("seconds", 0)) + time.monotonic() - t0, 1),
                                       "trials": int(spent.get("trials", 0)) + n * len(tasks)})


def _run_metaschedule(ms: Any, tasks: list[Any], n: int, db: Any, work_dir: Path, bar: TuningProgress | None) -> None:
    """MetaSchedule's search: ``n`` trials for each of ``tasks`` into ``db``. Its first call in a
    process imports ``tvm.s_tir.tensor_intrin`` (via the builder and the x86 rules): measured 260 s
    at load ~7 on 2 cores, before the first trial."""
    callbacks = [ms.measure_callback.AddToDatabase(), ms.measure_callback.UpdateCostModel()]
    contexts, weights = ms.relax_integration.extracted_tasks_to_tune_contexts(tasks, str(work_dir), seed=0)
    builder, runner = _in_process_builder_runner(bar)
    ms.tune_tasks(tasks=contexts, task_weights=weights, work_dir=str(work_dir / "logs"),
                  max_trials_global=n * len(contexts), max_trials_per_task=n,
                  num_trials_per_iter=max(1, min(64, n)), database=db, builder=builder,
                  runner=runner, cost_model="xgb",
                  # no RemoveBuildArtifact: in-process artifacts are not files
                  measure_callbacks=callbacks)


def default_schedule(task: Any, target: Any) -> Any:
    """``task``'s kernel with the default CPU schedules (what the build gives it untuned)."""
    from tvm.s_tir import dlight as dl

    from .schedules import default_rules

    import tvm

    # on a copy: the pass rewrote the task's own module in place (its structural key changed)
    mod = task.dispatched[0]
    copy = tvm.IRModule(dict(mod.functions.items()), attrs=mod.attrs)
    with target:
        return dl.ApplyDefaultSchedule(*default_rules(target))(copy)


def _kernel_timer(mod: Any, target: Any) -> Any:
    """A function timing one scheduled kernel module as MetaSchedule's runner does (seconds)."""
    import tvm
    from tvm.s_tir.meta_schedule.arg_info import ArgInfo
    from tvm.s_tir.meta_schedule.runner import EvaluatorConfig
    from tvm.s_tir.meta_schedule.runner.local_runner import default_alloc_argument
    from tvm.s_tir.meta_schedule.runner.utils import run_evaluator_common
    from tvm.s_tir.transform import RemoveWeightLayoutRewriteBlock

    from . import parallel_scope

    # what MetaSchedule's default_build does, compiled as the build compiles (parallel_scope); not
    # default_build itself: its first call imports tvm.s_tir.tensor_intrin, 260 s under load
    rt_mod = parallel_scope.compile(RemoveWeightLayoutRewriteBlock(skip_tensor_rewrite=True)(mod), target)
    rt_mod = getattr(rt_mod, "mod", rt_mod)  # tvm.compile's Executable wraps the runtime module
    dev = tvm.cpu(0) if str(target.kind.name) == "llvm" else tvm.device(str(target.kind.name), 0)
    args = default_alloc_argument(dev, [a.as_json() for a in ArgInfo.from_entry_func(mod, True)], 1)
    config = EvaluatorConfig(**_EVALUATOR)
    return lambda: min(run_evaluator_common(rt_mod, dev, config, args))


def compare_kernel(task: Any, target: Any, db_dir: str | Path, db: Any = None,
                   tuned_mod: Any = None) -> dict[str, Any]:
    """Time ``task``'s best tuned schedule against its default one and record it (rule 6).

    ``tuned_mod``: the scheduled module to compare instead of the database's best (tests)."""
    import statistics

    target = tuning_target(target)
    db = db if db is not None else open_database(db_dir, target)
    key = _task_key(task)
    if tuned_mod is None:
        tuned_mod = db.query_ir_module(task.dispatched[0], target, "main")
    entry: dict[str, Any] = {"kernel": task.task_name, "trials": _trials_done(db_dir, target).get(key, 0)}
    try:
        timers = {"default": _kernel_timer(default_schedule(task, target), target),
                  "tuned": _kernel_timer(tuned_mod, target)}
        times: dict[str, list[float]] = {"default": [], "tuned": []}
        for r in range(COMPARE_ROUNDS):
            for name in (("default", "tuned") if r % 2 == 0 else ("tuned", "default")):
                times[name].append(timers[name]())
        d, t = statistics.median(times["default"]), statistics.median(times["tuned"])
        entry.update(default_us=round(d * 1e6, 2), tuned_us=round(t * 1e6, 2), use="tuned" if t < d else "default")
    except Exception as e:  # the default schedule does not build alone: keep the tuned one
        msg = str(e).strip().splitlines()[-1][:200] if str(e).strip() else type(e).__name__
        entry.update(use="tuned", error=msg)
    path = database_dir(db_dir, target) / COMPARE_FILE
    _write_json(path, {**_read_json(path), key: entry})
    return entry


def conv_cache_file(db_dir: str | Path, target: Any) -> Path:
    """Where ``conv_algorithm="auto"`` keeps its measurements beside the tuning records."""
    from .conv_algorithms import CACHE_FILE

    return database_dir(db_dir, target) / CACHE_FILE


def _kept_records(db: Any, tasks: list[Any], target: Any, use_default: set[str]) -> Any:
    """An in-memory database with the best record of each covered task except ``use_default``."""
    from tvm.s_tir import meta_schedule as ms

    mem = ms.database.MemoryDatabase()
    for t in tasks:
        if _task_key(t) in use_default:
            continue
        rec = db.query_tuning_record(t.dispatched[0], target, "main")
        if rec is not None:
            mem.commit_tuning_record(ms.database.TuningRecord(rec.trace, mem.commit_workload(t.dispatched[0]),
                                                              rec.run_secs, rec.target, rec.args_info))
    return mem


def apply_database(mod: Any, target: Any, db_dir: str | Path, pipeline: str = "scheduled",
                   conv_algorithm: str = "direct", prepared: tuple[Any, dict[str, Any]] | None = None
                   ) -> tuple[Any, dict[str, Any]]:
    """Compile-ready module: tuned kernels from the database, default schedules for the rest.

    Returns ``(module, facts)`` with facts ``{"tuned": bool, "tuned_kernels": n,
    "untuned_kernels": [names], "default_kept_kernels": [names] (rule 6), "database": dir}``.
    """
    import tvm
    from tvm import relax

    target = tuning_target(target)
    if pipeline != "scheduled":
        raise BackendError(f"a tuning database needs the 'scheduled' pipeline, not {pipeline!r}")
    db = open_database(db_dir, target)
    prepared, conv_facts = prepared if prepared is not None else prepare_for_database(mod, target, db_dir, conv_algorithm)
    tasks = extract_tasks(prepared, target)
    covered = [t for t in tasks if _covered(db, t, target)]
    missing = [t.task_name for t in tasks if not _covered(db, t, target)]
    kept: list[str] = []
    use = db
    if NEVER_WORSE:
        cmp = comparisons(db_dir, target)
        slower = {_task_key(t) for t in covered if cmp.get(_task_key(t), {}).get("use") == "default"}
        kept = [t.task_name for t in covered if _task_key(t) in slower]
        use = _kept_records(db, covered, target, slower) if slower else db
    with target, use:
        applied = relax.transform.MetaScheduleApplyDatabase()(prepared)
        out = tvm.transform.Sequential(schedule_passes(target))(applied)
    n_tuned = len(covered) - len(kept)
    facts = {"tuned": n_tuned > 0, "tuned_kernels": n_tuned,
             "untuned_kernels": missing, "default_kept_kernels": kept,
             "database": str(database_dir(db_dir, target)), **conv_facts}
    return out, facts
