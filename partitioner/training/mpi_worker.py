"""One MPI rank of a data-parallel training run:
``mpiexec -n R python -m partitioner.training.mpi_worker RUN_DIR --config RUN_DIR/train_config.json``.

``partitioner train --launcher mpi`` starts it (through the runtime's launcher, which names a
failing rank and kills every rank on failure). Each rank builds the same step program, keeps
its own state, takes its slice of every global batch and AllReduces its gradients over
``MPI.COMM_WORLD`` through the project's MPI communicator; rank 0 writes the run folder. Each
rank is pinned to its share of the host's cores as ``partitioner run``'s workers are. On any
error a rank prints ``rank R: train: <message>`` and aborts the job. Each rank writes
``memory_rank<r>.json`` (the training steps' peak RSS minus the RSS once the backend is loaded,
:mod:`partitioner.training.memory_window`) to the run folder.

Rules:
1. Each rank pins itself to its share of the host's cores (``partitioner.runtime.worker.pin_cores``)
   and sets ``TVM_BIND_THREADS=0`` before TVM starts its pool, so TVM's own binding does not
   put both ranks' threads on core 0. Measured (session 16, 2 ranks data, TVM resnet): every
   thread that did work stayed on its rank's core (rank 0 on core 0, rank 1 on core 1); only
   threads started before the pin (MPI's, idle) keep both cores; mpiexec, hydra_pmi_proxy and
   the launcher's process took 0-3 ticks of 1000 in each sampled 5-20 s window (build, steps'
   end; docs/training.md, session 16).
2. ``$PARTITIONER_RANK_NICE=N`` (:data:`RANK_NICE_ENV`; unset or 0: nothing, the default) sets
   the rank's niceness and its autogroup's to ``N`` right after the pin. ``hydra_pmi_proxy``
   starts every rank in a session (so an autogroup) of its own, and the kernel shares a core
   between autogroups before it looks at a niceness, so only the rank itself can set it. It is
   a measurement aid for a shared machine (``N`` < 0 needs root): with other sessions' work on
   the two cores the 2-rank row slows more than the 1-rank row (measured, paired, 2-rank against
   1-rank samples/s at niceness 0 and -20: TVM resnet data 1.46x and 1.91x, TVM mlp pipeline
   1.64x and 2.26x; presumably a rank that reaches an AllReduce while its peer's core runs
   another session waits out that slice; docs/training.md, session 16).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

#: rule 2: the environment variable that sets a rank's niceness and its autogroup's
RANK_NICE_ENV = "PARTITIONER_RANK_NICE"


def apply_rank_nice(value: str | None = None) -> int:
    """Rule 2: set this process's niceness and its autogroup's to ``value`` (default
    ``$PARTITIONER_RANK_NICE``); returns the niceness set (0: nothing done). A value that is not
    an integer, or a niceness the process may not take, raises ValueError / PermissionError."""
    value = os.environ.get(RANK_NICE_ENV) if value is None else value
    if not value or not value.strip():
        return 0
    try:
        nice = int(value)
    except ValueError:
        raise ValueError(f"${RANK_NICE_ENV}={value!r}: expected an integer niceness (-20..19)") from None
    if not nice:
        return 0
    os.setpriority(os.PRIO_PROCESS, 0, nice)
    try:
        Path("/proc/self/autogroup").write_text(str(nice))
    except OSError:  # no autogroups (kernel option off): the niceness alone
        pass
    return nice


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m partitioner.training.mpi_worker")
    p.add_argument("run_dir")
    p.add_argument("--config", required=True)
    p.add_argument("--error-file", default=None)
    args = p.parse_args(argv)
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    rank = world.Get_rank()
    try:
        # each rank on its share of the host's cores, before TVM/ORT start their thread pools
        from partitioner.runtime.worker import pin_cores

        local = world.Split_type(MPI.COMM_TYPE_SHARED)
        pin_cores(local.Get_rank(), local.Get_size())
        os.environ.setdefault("TVM_BIND_THREADS", "0")
        apply_rank_nice()  # rule 2
        with open(args.config, encoding="utf-8") as fh:
            cfg = json.load(fh)
        from partitioner.runtime.comm_mpi import MPICommunicator
        from partitioner.training.loop import train

        from partitioner.runtime.fault import from_env

        comm = MPICommunicator(comm_groups(world.Get_size(), cfg.get("strategy", "data"), cfg.get("stages")),
                               fault=from_env(rank))
        from partitioner.training import memory_window

        memory_window.CURRENT = memory_window.MemoryWindow(
            process_baseline_bytes=memory_window.baseline(cfg.get("backend", "onnxruntime")), armed=True)
        train(cfg["model"], cfg["data"], loss=cfg["loss"], optimizer=cfg["optimizer"], lr=cfg["lr"],
              weight_decay=cfg["weight_decay"], batch=cfg["batch"], epochs=cfg["epochs"], devices=cfg["devices"],
              strategy=cfg["strategy"], backend=cfg["backend"], out_dir=cfg["out_dir"], seed=cfg["seed"],
              progress=cfg["progress"], trainable=cfg["trainable"], comm=comm, resume=cfg.get("resume"),
              threads=int(cfg.get("threads", 1)), schedule=cfg.get("schedule", "1f1b"),
              micro_batches=cfg.get("micro_batches"), stages=cfg.get("stages"), memory_limit=cfg.get("memory_limit"))
        comm.flush()
        _write_memory(cfg["out_dir"], rank)
        comm.barrier()
        return 0
    except BaseException as exc:  # noqa: BLE001 - any failure must end every rank, now
        msg = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        sys.stderr.write(f"rank {rank}: train: {msg}\n")
        sys.stderr.flush()
        if args.error_file:
            try:
                with open(args.error_file, "a", encoding="utf-8") as fh:
                    fh.write(f"rank {rank}: train: {msg}\n")
            except OSError:
                pass
        world.Abort(1)
        return 1


def _write_memory(out_dir: str, rank: int) -> None:
    """``memory_rank<r>.json``: this rank's measured memory (:mod:`partitioner.training.memory_window`:
    baseline, the build's peak, the training steps' peak; ``training_bytes`` = that peak minus
    the baseline)."""
    from partitioner.training.memory_window import CURRENT

    Path(out_dir, f"memory_rank{rank}.json").write_text(json.dumps(CURRENT.to_json(rank)))


def comm_groups(size: int, strategy: str, stages: int | None) -> list[list[int]]:
    """Every collective group a rank may use (MPI creates them at start-up, on every rank in the
    same order): the world; for ``hybrid`` also each pipeline replica (the loss broadcast) and
    each stage's replicas (the gradient AllReduce)."""
    groups = [list(range(size))]
    if strategy == "hybrid":
        s = stages or 2
        groups += [[d * s + k for k in range(s)] for d in range(size // s)]
        groups += [[d * s + k for d in range(size // s)] for k in range(s)]
    return groups


if __name__ == "__main__":
    sys.exit(main())
