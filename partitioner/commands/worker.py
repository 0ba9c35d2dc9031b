"""``partitioner worker DIR --inputs in.npz``: one MPI rank, for a user's own ``mpiexec``/``srun``.

Example: ``mpiexec -n 2 partitioner worker art/ --inputs in.npz --outputs out.npz``. It is the same
program ``partitioner run`` starts (:mod:`partitioner.runtime.worker`).
"""

from __future__ import annotations

import argparse

NAME = "worker"
HELP = "run one MPI rank of an artifact (start it under your own mpiexec or srun)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    from partitioner.runtime.worker import add_arguments as worker_arguments

    worker_arguments(p)


def run(args: argparse.Namespace) -> int:
    from partitioner.runtime.worker import run_worker

    return run_worker(args)
