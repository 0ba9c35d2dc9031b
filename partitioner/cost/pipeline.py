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


def schedule_order(schedule: str, stage: int, stages: int, m: int, extra: int = 0) -> list[tuple[str, int]]:
    """The order stage ``stage`` of ``stages`` runs its ``("F", i)`` / ``("B", i)`` calls in (the
    last stage: one ``("FB", i)`` per micro-batch): GPipe every forward then every backward in
    reverse; 1F1B ``S - s - 1 + extra`` warm-up forwards, then one forward and one backward in
    turn, then the drain (training pipeline rule 5; its runner runs exactly this order)."""
    if stage == stages - 1:
        return [("FB", i) for i in range(m)]
    if schedule == "gpipe":
        return [("F", i) for i in range(m)] + [("B", i) for i in reversed(range(m))]
    warm = min(stages - stage - 1 + extra, m)
    order = [("F", i) for i in range(warm)]
    for i in range(m - warm):
        order += [("F", warm + i), ("B", i)]
    return order + [("B", i) for i in range(m - warm, m)]


def simulated_step_time(forward: Sequence[float], backward: Sequence[float], send_times: Sequence[float], m: int,
                        schedule: str = "1f1b", extra: int = 0) -> float:
    """The step's makespan when every stage runs :func:`schedule_order`'s calls one after another
    and a call starts once its inputs have arrived: stage ``s``'s ``F(i)`` after ``F(i)`` of stage
    ``s - 1`` plus ``send_times[s - 1]`` (the activations), its ``B(i)`` after the next stage's
    ``B(i)`` (or ``FB(i)``) plus ``send_times[s]`` (their gradients, the same bytes back); the last
    stage's ``FB(i)`` takes ``forward[-1] + backward[-1]``. Unlike the fill-drain formula it sees
    where the order makes a stage wait: with 2 stages (``t0``, ``t1`` a micro-batch each, ``c``
    one message) and no extra warm-up, stage 0's ``F(i)`` follows ``B(i - 2)``, so the last
    stage's ``FB(i)`` starts no earlier than ``FB(i - 2)`` plus ``t0 + t1 + 2 c`` (a chain through
    both ranks and both messages): the steady period is ``max(t0, t1, (t0 + t1 + 2 c) / 2)``, longer
    than the slower stage when ``2 c > |t1 - t0|``. One extra warm-up forward (``extra`` = 1)
    spreads that chain over three micro-batches (``(t0 + t1 + 2 c) / 3``). And when stage 0 is the
    slower, its first ``B`` waits for the last stage's first ``FB`` after its warm-up forwards,
    once per step: the extra forward fills part of that wait. With 3 or more stages a later
    first backward can also lengthen the step (the simulation shows it; the formula cannot)."""
    p = len(forward)
    if len(backward) != p or len(send_times) != max(p - 1, 0) or m < 1:
        raise PlanError(f"{p} stages need {p} backward and {max(p - 1, 0)} send times and m >= 1")
    orders = [schedule_order(schedule, s, p, m, extra) for s in range(p)]
    done: dict[tuple[int, int, str], float] = {}
    nxt, free = [0] * p, [0.0] * p
    while any(nxt[s] < len(orders[s]) for s in range(p)):
        moved = False
        for s in range(p):
            if nxt[s] == len(orders[s]):
                continue
            kind, i = orders[s][nxt[s]]
            dep = (s - 1, i, "F") if kind in ("F", "FB") and s > 0 else None
            if kind == "B":
                dep = (s + 1, i, "FB" if s + 1 == p - 1 else "B")
            if dep is not None and dep not in done:
                continue
            ready = 0.0 if dep is None else done[dep] + send_times[min(s, dep[0])]
            took = forward[s] * (kind != "B") + backward[s] * (kind != "F")
            free[s] = done[(s, i, kind)] = max(free[s], ready) + took
            nxt[s], moved = nxt[s] + 1, True
        if not moved:
            raise PlanError(f"{schedule} order on {p} stages deadlocks")
    return max(free)
