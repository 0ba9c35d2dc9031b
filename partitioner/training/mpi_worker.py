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
"""

from __future__ import annotations

import argparse
import json
import os
import sys


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
        with open(args.config, encoding="utf-8") as fh:
            cfg = json.load(fh)
        from partitioner.runtime.comm_mpi import MPICommunicator
        from partitioner.training.loop import train

        comm = MPICommunicator(comm_groups(world.Get_size(), cfg.get("strategy", "data"), cfg.get("stages")))
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
    from pathlib import Path

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
