"""Runtimes that execute per-rank programs: in-process (threads) and MPI (one process per rank)."""
