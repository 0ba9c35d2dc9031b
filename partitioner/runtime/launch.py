"""Start a run: ``mpiexec -n R python -m partitioner.runtime.worker DIR ...`` (or threads in-process).

Rules:
1. The artifact is verified and the inputs are checked against its bindings *before* anything is
   started: bad inputs end with :class:`InputError` (exit 2) naming the input.
2. ``mpiexec`` is the one from the ``mpich`` wheel, next to ``sys.executable``; else the first
   on ``PATH``.
3. The launcher starts mpiexec in a new session (its own process group) and, on ``timeout`` or
   when it ends, kills that whole group and every process it saw descend from it: no orphans.
4. A failed run raises :class:`RunFailed` naming the rank, taken from the worker's one-line
   report ``rank R: <op>: <message>`` or from mpiexec's report of a rank that died.
5. ``--check`` runs ONNX Runtime on the artifact's source model (``source.onnx``, or the model it
   refers to) with the same inputs and compares every output (``|got - want| <= atol + rtol *
   |want|``); a large source runs in its own process, or the check is skipped with a reason when
   it cannot fit (:mod:`partitioner.runtime.reference`).
6. The watcher that names a silently dead rank (:class:`_RankWatcher`) scans the process tree
   (about 2 ms of CPU per scan, every 5 ms) only until it has found every rank, then every
   ``RESCAN_POLLS``-th poll (about once a second), while the ranks' liveness is still read every
   5 ms where rule 7 cannot block instead: in that steady state the watcher takes 0.055 ms of
   CPU per poll, 1.1% of a core (0.16 ms, 3%, when it rescanned every 20th poll; measured).
   A rank is a child running the launched worker module (``partitioner.runtime.worker``, or
   ``partitioner.training.mpi_worker`` for training). Were a rank never recognised, the scan
   would take about a quarter of a core for the whole run, from the cores the ranks are pinned to.
7. Once every rank is known, the watcher no longer wakes every 5 ms: it blocks on the ranks'
   pidfds (``os.pidfd_open``, Linux 5.3+) until one ends, ``stop`` is called, or the next rescan
   is due (``STEADY_WAIT_S``), so an exit is still recorded at once and in order. For MPI ranks
   pinned one per core the 5 ms wake-up preempted a rank 36 times per 178 ms data-parallel mlp
   step (4x1024, batch 1024, TVM): the rank on the launcher's core spent 10.9 ms per step waiting
   for its core and its peer 13 ms waiting for it in the AllReduce (measured, docs/training.md).
   ``PIDFD_WATCH = False``, or a system without pidfds, keeps the 5 ms polling.
8. The watcher reads the ranks' liveness before it rescans the tree, and a rank whose pidfd woke
   it is recorded before the others are read. When rank 1 dies, mpiexec kills rank 0 within a
   few ms; reading liveness only after the 2 ms scan let both deaths land on the same poll, and
   the run then failed with "mpiexec exited with status 3: no message" instead of naming rank 1
   (seen once in CI on a loaded machine).
"""

from __future__ import annotations

import os
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from partitioner.core.errors import RunFailed

_RANK_LINE = re.compile(r"^rank (\d+): (.*)$", re.M)
#: rule 6: once every rank is known, the process tree is rescanned (for the final kill sweep) on
#: every this-many-th 5 ms poll, about once a second
RESCAN_POLLS = 200
#: rule 7: block on the ranks' pidfds once every rank is known (no 5 ms wake-ups)
PIDFD_WATCH = True
#: rule 7: the longest a blocked watcher waits before its next tree rescan (about once a second)
STEADY_WAIT_S = 1.0


def find_mpiexec(required: bool = True) -> str | None:
    """``mpiexec`` next to the running interpreter (the mpich wheel), else the first on PATH.
    Without one: :class:`RunFailed` saying how to get it, or None when not ``required``."""
    here = Path(sys.executable).parent / "mpiexec"
    if here.is_file() and os.access(here, os.X_OK):
        return str(here)
    found = shutil.which("mpiexec")
    if not found and required:
        raise RunFailed("mpiexec not found: install the mpich wheel (pip install mpich) or put mpiexec on PATH")
    return found


@dataclass(frozen=True)
class OutputCheck:
    name: str
    max_abs: float
    max_rel: float
    ok: bool
    note: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "max_abs": self.max_abs, "max_rel": self.max_rel, "ok": self.ok, "note": self.note}


@dataclass(frozen=True)
class CheckReport:
    rtol: float
    atol: float
    outputs: tuple[OutputCheck, ...]
    skipped: str = ""  # why no reference was computed (the model cannot fit this machine)

    @property
    def ok(self) -> bool:
        return all(o.ok for o in self.outputs)

    def to_json(self) -> dict[str, Any]:
        return {"ok": self.ok, "rtol": self.rtol, "atol": self.atol, "outputs": [o.to_json() for o in self.outputs],
                **({"skipped": self.skipped} if self.skipped else {})}


@dataclass(frozen=True)
class RunResult:
    outputs: dict[str, np.ndarray] = field(repr=False)
    wall_s: float
    check: CheckReport | None = None
    timings: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        return {"wall_s": self.wall_s,
                "outputs": {k: {"shape": list(v.shape), "dtype": str(v.dtype)} for k, v in self.outputs.items()},
                "check": self.check.to_json() if self.check else None, "timings": self.timings}


# ------------------------------------------------------------------------------------------------


class _RankWatcher:
    """Follows the launcher's descendants: every pid (for the final sweep), each worker's rank
    (from its ``PMI_RANK``) and when each worker vanished, so that a rank that died without a word
    (SIGKILL, ``os._exit``) can still be named."""

    def __init__(self, proc: subprocess.Popen, world_size: int = 0, interval: float = 0.005,
                 module: str = "partitioner.runtime.worker") -> None:
        self.proc = proc
        self.module = module  # rule 6: the worker module that marks a rank's command line
        self.world_size = world_size
        self.interval = interval
        self.seen: dict[int, Any] = {}  # pid -> psutil.Process (which guards against pid reuse)
        self.rank_of: dict[int, int] = {}
        self.gone: dict[int, int] = {}  # rank -> poll index at which its process was no longer running
        self._polls = 0
        self._stop = threading.Event()
        self._wake_r, self._wake_w = os.pipe()  # rule 7: stop() wakes a watcher blocked in select
        self._pidfds: dict[int, int] | None = None  # rank pid -> pidfd (rule 7), once every rank is known
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        if self._wake_w < 0:  # already stopped
            return
        self._stop.set()
        os.write(self._wake_w, b"x")
        if self._thread.ident is not None:  # started (a caller may poll by hand and never start it)
            self._thread.join(timeout=2)
        for fd in [self._wake_r, self._wake_w, *(self._pidfds or {}).values()]:
            try:
                os.close(fd)
            except OSError:
                pass
        self._pidfds, self._wake_r, self._wake_w = {}, -1, -1

    def _scan(self) -> None:
        try:
            import psutil
        except ImportError:
            return
        try:
            children = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.Error:
            return
        for child in children:
            self.seen.setdefault(child.pid, child)
            if child.pid in self.rank_of:
                continue
            try:  # a just-forked child still shows its parent's command line: look again next scan
                if self.module in child.cmdline():
                    rank = child.environ().get("PMI_RANK")
                    if rank is not None:
                        self.rank_of[child.pid] = int(rank)
            except psutil.Error:
                pass

    @staticmethod
    def _running(pid: int) -> bool:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return False
        return stat[stat.rindex(")") + 2] not in "ZXx"

    def poll(self, rescan: bool = False, ended: Sequence[int] = ()) -> None:
        """Record which known ranks have ended, then scan the tree when due (rule 6).

        Liveness is read *before* the scan (rule 8): the scan takes about 2 ms, long enough for
        mpiexec to kill the surviving ranks after the first one died, and a tie names no rank.
        ``ended`` are rank pids whose pidfd said they ended: they are recorded one poll earlier
        than any rank found dead only by the liveness read."""
        self._polls += 1
        if ended:
            for pid in ended:
                self.gone.setdefault(self.rank_of[pid], self._polls)
            self._polls += 1
        for pid, rank in self.rank_of.items():
            if rank not in self.gone and not self._running(pid):
                self.gone[rank] = self._polls
        # the (costly) tree scan runs until every rank is known, and then every RESCAN_POLLS-th (rule 6)
        if rescan or len(self.rank_of) < self.world_size or self._polls % RESCAN_POLLS == 0:
            known = len(self.rank_of)
            self._scan()
            if len(self.rank_of) > known:  # ranks first seen now: read their liveness too
                for pid, rank in self.rank_of.items():
                    if rank not in self.gone and not self._running(pid):
                        self.gone[rank] = self._polls

    def _open_pidfds(self) -> dict[int, int] | None:
        """Rule 7: a pidfd per known rank, or None (not all ranks known yet, turned off, no pidfds)."""
        if not PIDFD_WATCH or len(self.rank_of) < self.world_size or not hasattr(os, "pidfd_open"):
            return None
        fds: dict[int, int] = {}
        try:
            for pid in self.rank_of:
                fds[pid] = os.pidfd_open(pid)
        except OSError:  # a rank already gone (the 5 ms poll records it), or pidfds unsupported
            for fd in fds.values():
                os.close(fd)
            return None
        return fds

    def _loop(self) -> None:
        while not self._stop.is_set():
            if self._pidfds is None:
                self._pidfds = self._open_pidfds()
            if self._pidfds is None:
                if self._stop.wait(self.interval):
                    return
                self.poll()
                continue
            live = {fd: pid for pid, fd in self._pidfds.items() if self.rank_of[pid] not in self.gone}
            ready, _, _ = select.select([self._wake_r, *live], [], [], STEADY_WAIT_S)
            if self._stop.is_set():
                return
            # woken by a rank's end or the rescan timeout (rule 7); the ended ranks first (rule 8)
            self.poll(rescan=True, ended=[live[fd] for fd in ready if fd in live])

    def first_gone(self) -> list[int]:
        if not self.gone or len(set(self.rank_of.values())) < self.world_size:
            return []
        first = min(self.gone.values())
        return sorted(r for r, k in self.gone.items() if k == first)


def _kill_tree(proc: subprocess.Popen, watcher: _RankWatcher) -> None:
    """Kill the session's process group and every descendant we saw, by pid."""
    watcher.poll()
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    for child in list(watcher.seen.values()):
        try:
            child.kill()  # psutil checks the pid still names the same process
        except Exception:  # noqa: BLE001 - already gone (psutil.NoSuchProcess) or not ours
            pass
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass
    try:  # wait until the killed processes are really gone (not merely signalled)
        import psutil

        psutil.wait_procs(list(watcher.seen.values()), timeout=5)
    except ImportError:
        pass


_HYDRA_PID = re.compile(r"BAD TERMINATION OF ONE OF YOUR APPLICATION PROCESSES\s*=\s*PID (\d+)[^=]*=\s*(EXIT CODE: \d+)")


def failure_message(output: str, rc: int, watcher: _RankWatcher | None = None) -> str:
    """One line naming the rank that failed, from the worker's and mpiexec's reports."""
    lines = [(int(m.group(1)), m.group(2)) for m in _RANK_LINE.finditer(output)]
    direct = [(r, msg) for r, msg in lines if "timed out after" not in msg]
    if direct:
        r, msg = direct[0]
        return f"run failed on rank {r}: {msg}"
    rank_of = watcher.rank_of if watcher else {}
    for m in _HYDRA_PID.finditer(output):
        code = int(m.group(2).split(":")[1])
        why = f"killed by signal {code}" if code in (6, 9, 11, 15) else f"exit code {code}"
        if int(m.group(1)) in rank_of:
            return f"run failed on rank {rank_of[int(m.group(1))]}: the process ended abnormally ({why})"
    if lines:  # only time-outs: the first rank that gave up names what it waited for
        r, msg = lines[0]
        return f"run failed on rank {r}: {msg}"
    gone = watcher.first_gone() if watcher else []
    if len(gone) == 1:
        return (f"run failed on rank {gone[0]}: the process ended abnormally without a message "
                f"(mpiexec status {rc})")
    tail = output.strip().splitlines()[-1] if output.strip() else "no message"
    return f"run failed: mpiexec exited with status {rc}: {tail}"


def launch_mpi(artifact_dir: str | os.PathLike[str], world_size: int, worker_args: Sequence[str], *,
               ranks_per_host: int | None = None, timeout: float | None = None,
               env: Mapping[str, str] | None = None, module: str = "partitioner.runtime.worker") -> tuple[str, str]:
    """Run the workers under mpiexec; returns (stdout, stderr) or raises RunFailed.

    A failing rank also writes its one-line reason to an error file: MPI_Abort can end the job
    before mpiexec has forwarded that rank's stderr, and the message must still name the rank."""
    with tempfile.TemporaryDirectory(prefix="partitioner-launch-") as tmp:
        error_file = Path(tmp) / "errors.txt"
        try:
            return _launch(artifact_dir, world_size, [*worker_args, "--error-file", str(error_file)],
                           ranks_per_host=ranks_per_host, timeout=timeout, env=env, module=module)
        except RunFailed as exc:
            said = error_file.read_text(errors="replace") if error_file.exists() else ""
            if said and not _RANK_LINE.search(str(exc)):
                raise RunFailed(failure_message(said, -1)) from None
            raise


def _launch(artifact_dir: str | os.PathLike[str], world_size: int, worker_args: Sequence[str], *,
            ranks_per_host: int | None, timeout: float | None, env: Mapping[str, str] | None,
            module: str = "partitioner.runtime.worker") -> tuple[str, str]:
    cmd = [find_mpiexec(), "-n", str(world_size)]
    if ranks_per_host:
        cmd += ["-ppn", str(ranks_per_host)]
    cmd += [sys.executable, "-m", module, str(artifact_dir), *worker_args]
    if ranks_per_host:
        cmd += ["--ranks-per-host", str(ranks_per_host)]
    child_env = dict(os.environ if env is None else env)
    root = str(Path(__file__).resolve().parents[2])  # the project root, so the workers import this code
    child_env["PYTHONPATH"] = os.pathsep.join(p for p in (root, child_env.get("PYTHONPATH", "")) if p)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env,
                            start_new_session=True)
    watcher = _RankWatcher(proc, world_size, module=module)
    watcher.start()
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_tree(proc, watcher)
        out, err = proc.communicate()
        watcher.stop()
        said = failure_message(err, -1) if _RANK_LINE.search(err) else "no rank reported an error"
        raise RunFailed(f"run timed out after {timeout:g} s and was stopped (all ranks killed); {said}") from None
    except BaseException:
        _kill_tree(proc, watcher)
        watcher.stop()
        raise
    watcher.stop()
    _kill_tree(proc, watcher)  # sweep anything left in the group (normally nothing)
    if proc.returncode != 0:
        raise RunFailed(failure_message(err + "\n" + out, proc.returncode, watcher))
    return out, err


# ------------------------------------------------------------------------------------------------


def load_inputs(art: Any, inputs: Mapping[str, np.ndarray] | str | os.PathLike[str]) -> dict[str, np.ndarray]:
    from partitioner.core.bindings import check_inputs
    from partitioner.runtime.worker import read_npz

    feeds = read_npz(inputs) if isinstance(inputs, (str, os.PathLike)) else {k: np.asarray(v) for k, v in inputs.items()}
    check_inputs(art.bindings, feeds)
    return feeds


def run_artifact(art: Any, inputs: Mapping[str, np.ndarray] | str | os.PathLike[str], *, check: bool = False,
                 ranks_per_host: int | None = None, in_process: bool = False, timeout: float | None = None,
                 rtol: float = 1e-4, atol: float = 1e-5, outputs_path: str | os.PathLike[str] | None = None,
                 warmup: int = 0, repeat: int = 1, extra_worker_args: Sequence[str] = ()) -> RunResult:
    """Run a loaded artifact on ``inputs``; see the module rules."""
    from backends.cuda_devices import require_matching_gpu
    from partitioner.runtime.worker import read_npz, write_npz

    require_matching_gpu(art.manifest, str(art.root))  # a GPU artifact on a machine without its GPU
    feeds = load_inputs(art, inputs)
    t0 = time.perf_counter()
    timings = None
    if in_process:
        outputs, timings = run_in_process(art, feeds, timeout=timeout)
    else:
        with tempfile.TemporaryDirectory(prefix="partitioner-run-") as tmp:
            in_path = Path(tmp) / "inputs.npz"
            if isinstance(inputs, (str, os.PathLike)):
                in_path = Path(inputs).resolve()
            else:
                write_npz(in_path, feeds)
            out_path = Path(tmp) / "outputs.npz"
            t_path = Path(tmp) / "timings.json"
            args = ["--inputs", str(in_path), "--outputs", str(out_path), "--timings", str(t_path),
                    "--warmup", str(warmup), "--repeat", str(repeat), *extra_worker_args]
            launch_mpi(art.root.resolve(), art.world_size, args, ranks_per_host=ranks_per_host, timeout=timeout)
            if not out_path.exists():
                raise RunFailed("run failed: rank 0 wrote no outputs although every rank exited normally")
            outputs = read_npz(out_path, what="outputs")
            import json

            timings = json.loads(t_path.read_text()) if t_path.exists() else None
    wall = time.perf_counter() - t0
    if outputs_path is not None:
        write_npz(outputs_path, outputs)
    report = check_outputs(art, feeds, outputs, rtol=rtol, atol=atol) if check else None
    return RunResult(outputs, wall, report, timings)


def run_in_process(art: Any, feeds: Mapping[str, np.ndarray], *,
                   timeout: float | None = None) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Run every rank as a thread with the in-process communicator (no MPI), through the one
    in-process runner (:func:`partitioner.runtime.in_process.run_ranks`)."""
    from backends import get_backend
    from partitioner.core.bindings import gather_outputs, scatter_inputs
    from partitioner.runtime.comm_local import DEFAULT_TIMEOUT_S, LocalWorld
    from partitioner.runtime.in_process import run_ranks
    from partitioner.runtime.schedule import run_step

    world = LocalWorld(art.world_size, timeout_s=timeout or DEFAULT_TIMEOUT_S)
    per_rank_feeds = scatter_inputs(art.bindings, feeds)
    backend = get_backend(art.backend)
    threads = max(1, (os.cpu_count() or 1) // art.world_size)

    def one(rank: int, comm: Any) -> list[dict[str, np.ndarray]]:
        exe = backend.load(art.programs[rank], art.backend_file(rank), threads=threads)
        return run_step(exe, per_rank_feeds[rank], comm)

    t0 = time.perf_counter()
    results, failed, _ = run_ranks(world, one)
    if failed:
        errors = [f"rank {rank}: {str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__}"
                  for rank, exc in failed.items()]
        direct = [e for e in errors if "aborted while waiting" not in e]
        raise RunFailed(f"run failed on {(direct or errors)[0]}")
    outputs = gather_outputs(art.bindings, results)
    return outputs, {"world_size": art.world_size, "threads_per_rank": threads, "warmup": 0,
                     "times_s": [time.perf_counter() - t0], "median_s": time.perf_counter() - t0}


def reference_outputs(art: Any, feeds: Mapping[str, np.ndarray], *,
                      threads: int | None = None) -> tuple[dict[str, np.ndarray] | None, str]:
    """Rule 5: ONNX Runtime on the artifact's source model (:mod:`partitioner.runtime.reference`:
    a large one in its own process, or skipped when it cannot fit); (outputs, skip reason)."""
    from partitioner.artifact import source_model_path
    from partitioner.runtime.reference import reference_outputs as run_reference

    return run_reference(source_model_path(art.root, art.manifest), feeds, threads=threads)


def check_outputs(art: Any, feeds: Mapping[str, np.ndarray], outputs: Mapping[str, np.ndarray], *,
                  rtol: float = 1e-4, atol: float = 1e-5) -> CheckReport:
    want, skipped = reference_outputs(art, feeds)
    if want is None:
        return CheckReport(rtol, atol, (), skipped)
    checks = []
    for b in art.bindings.outputs:
        got, ref = outputs.get(b.name), want.get(b.name)
        if got is None or ref is None:
            checks.append(OutputCheck(b.name, float("inf"), float("inf"), False,
                                      "missing from the run" if got is None else "missing from the reference"))
            continue
        if got.shape != ref.shape:
            checks.append(OutputCheck(b.name, float("inf"), float("inf"), False,
                                      f"shape {list(got.shape)} but the reference has {list(ref.shape)}"))
            continue
        diff = np.abs(got.astype(np.float64) - ref.astype(np.float64))
        refabs = np.abs(ref.astype(np.float64))
        max_abs = float(diff.max()) if diff.size else 0.0
        nz = refabs > 0
        max_rel = float((diff[nz] / refabs[nz]).max()) if nz.any() else (0.0 if max_abs == 0 else float("inf"))
        ok = bool(np.all(diff <= atol + rtol * refabs)) and not np.isnan(diff).any()
        checks.append(OutputCheck(b.name, max_abs, max_rel, ok))
    return CheckReport(rtol, atol, tuple(checks))

