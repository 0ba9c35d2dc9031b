"""``auto``: search strategies x degrees (divisors of the device count) x mesh shapes with the
analytical cost model (:func:`costing.estimate`), objective latency or throughput, under the
memory limit. Plans that fit come first; among them the best objective wins. Returns the best
plan, the ranked alternatives with their predicted costs, and a one-paragraph explanation."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from partitioner.core.errors import PartitionerError, StrategyNotApplicable
from partitioner.core.model_view import ModelView
from partitioner.core.plan import Plan
from partitioner.strategies import costing, get_strategy


@dataclass(frozen=True)
class Candidate:
    name: str
    plan: Plan | None
    prediction: costing.Prediction | None
    reason: str = ""

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"candidate": self.name}
        if self.prediction is not None:
            out.update(latency_s=self.prediction.latency_s, throughput=self.prediction.throughput,
                       fits_memory=self.prediction.fits, peak_memory_bytes=max(self.prediction.memory_bytes))
        if self.reason:
            out["not_applicable"] = self.reason
        return out


def search(view: ModelView, cluster: Any, *, objective: str = "latency", memory_limit: float | None = None,
           microbatches: int | None = None, max_devices: int | None = None) -> tuple[Plan, list[Candidate], str]:
    n = max_devices or cluster.size
    cands: list[Candidate] = []
    degrees = [d for d in range(1, n + 1) if n % d == 0]
    for d in degrees:
        names = ["single"] if d == 1 else ["data", "pipeline", "tensor", "spatial"] + (["hybrid"] if d >= 4 else [])
        for s in names:
            label = f"{s} x{d}"
            try:
                plan = get_strategy(s).plan(view, cluster, degree=d, microbatches=microbatches,
                                            memory_limit=memory_limit, objective=objective)
                pred = costing.estimate(view, plan, cluster, memory_limit=memory_limit)
                cands.append(Candidate(label, plan, pred))
            except StrategyNotApplicable as exc:
                cands.append(Candidate(label, None, None, str(exc)))
            except PartitionerError as exc:
                cands.append(Candidate(label, None, None, f"failed: {exc}"))
    ok = [c for c in cands if c.plan is not None]
    if not ok:
        raise StrategyNotApplicable("auto: no strategy applies: " + "; ".join(c.reason for c in cands[:4]))

    def key(c: Candidate):
        p = c.prediction
        return (not p.fits, p.latency_s if objective == "latency" else -p.throughput)

    ok.sort(key=key)
    best = ok[0]
    p = best.prediction
    fit = "fits" if p.fits else "does NOT fit"
    limit = f" under the memory limit of {memory_limit / 2**20:.1f} MiB" if memory_limit else ""
    runner = f" The runner-up, {ok[1].name}, predicts {ok[1].prediction.latency_s * 1e3:.3f} ms." if len(ok) > 1 else ""
    expl = (f"auto chose {best.name} ({best.plan.notes}) for objective {objective}: predicted latency "
            f"{p.latency_s * 1e3:.3f} ms, throughput {p.throughput:.1f} samples/s, peak memory "
            f"{max(p.memory_bytes) / 2**20:.2f} MiB per device, which {fit}{limit}. It searched "
            f"{len(cands)} candidates ({len(ok)} applicable) over degrees {degrees}.{runner}")
    return best.plan, ok + [c for c in cands if c.plan is None], expl
