"""Pipeline (layer pipelining) formulas (COST_MODEL.md, "Strategies"; GPipe).

With p stages and m micro-batches in a fill-drain schedule:

- the idle (bubble) fraction of every stage is (p−1)/(m+p−1) when stages take equal time;
- the step time is the time for the first micro-batch to cross every stage and send, plus
  (m−1) times the slowest stage (a send overlaps the next micro-batch's compute, so the
  bottleneck is max(stage time, send time)):

      T = Σ t_i + Σ s_i + (m−1)·max(max t_i, max s_i)

  which is (m+p−1)·t + Σ s_i for equal stage times t and sends shorter than a stage;
- the latency of one sample is Σ t_i + Σ s_i.
"""

from __future__ import annotations

from typing import Sequence

from partitioner.core.errors import PlanError


def bubble_fraction(p: int, m: int) -> float:
    """GPipe idle fraction (p−1)/(m+p−1)."""
    if p < 1 or m < 1:
        raise PlanError(f"pipeline needs p >= 1 stages and m >= 1 micro-batches (got p={p}, m={m})")
    return (p - 1) / (m + p - 1)


def pipeline_step_time(stage_times: Sequence[float], send_times: Sequence[float], m: int) -> float:
    """Fill-drain step time for ``m`` micro-batches (formula in the module docstring).

    ``send_times[i]`` is the time of the send from stage i to stage i+1 (p−1 entries)."""
    p = len(stage_times)
    if p == 0:
        return 0.0
    if len(send_times) != p - 1:
        raise PlanError(f"{p} pipeline stages need {p - 1} send times, got {len(send_times)}")
    if m < 1:
        raise PlanError(f"micro-batch count must be at least 1, got {m}")
    bottleneck = max(max(stage_times), max(send_times, default=0.0))
    return sum(stage_times) + sum(send_times) + (m - 1) * bottleneck


def pipeline_latency(stage_times: Sequence[float], send_times: Sequence[float]) -> float:
    """Latency of one sample: Σ stage times + Σ sends."""
    return sum(stage_times) + sum(send_times)


def pipeline_throughput(stage_times: Sequence[float], send_times: Sequence[float], m: int,
                        samples_per_microbatch: float = 1.0) -> float:
    """Samples per second of one fill-drain step of m micro-batches."""
    t = pipeline_step_time(stage_times, send_times, m)
    return m * samples_per_microbatch / t if t > 0 else float("inf")
