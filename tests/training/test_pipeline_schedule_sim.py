"""benchmarks/pipeline_schedule.py's replay of a 2-stage 1F1B step from per-call times (messages
free), on hand-made calls whose step length is worked out by hand."""

from __future__ import annotations

import importlib

import pytest


def _simulate():
    return importlib.import_module("benchmarks.pipeline_schedule").simulate  # a namespace package from the repo root


def test_one_f_one_b_replay() -> None:
    """2 micro-batches, stage 0: F0 F1 B0 B1 U (1F1B with one warm-up forward), the last stage:
    FB0 FB1 U. F = 2, FB = 5, B = 3, U = 1: F0 ends at 2, FB0 runs 2-7, F1 2-4, FB1 7-12, B0
    7-10, B1 12-15, U 15-16; the last stage's U 12-13: the step is 16."""
    stage0 = [("F", 2.0), ("F", 2.0), ("B", 3.0), ("B", 3.0), ("U", 1.0)]
    last = [("FB", 5.0), ("FB", 5.0), ("U", 1.0)]
    assert _simulate()(stage0, last) == pytest.approx(16.0)


def test_tail_replay() -> None:
    """The same with the last micro-batch's weight gradients (2) deferred (rule 7's tail): FBt1
    runs 7-10 and W 10-12, so B1 runs 10-13 beside W and the step is 14: the tail shrank by
    min(w, b) = 2."""
    stage0 = [("F", 2.0), ("F", 2.0), ("B", 3.0), ("B", 3.0), ("U", 1.0)]
    last = [("FB", 5.0), ("FBt", 3.0), ("W", 2.0), ("U", 1.0)]
    assert _simulate()(stage0, last) == pytest.approx(14.0)
