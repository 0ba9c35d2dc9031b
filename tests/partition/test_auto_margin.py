"""``auto`` keeps ``single`` unless a split is predicted faster by more than the cost model's error
(``strategies/search.py``, ``SPLIT_MARGIN``): the rule on its own, on hand-made predictions."""

from __future__ import annotations

import pytest

from partitioner.strategies.costing import Prediction
from partitioner.strategies.search import SPLIT_MARGIN, Candidate, prefer_single


def _cand(name: str, latency: float, fits: bool = True) -> Candidate:
    p = Prediction((latency,), (0.0,), (0.0,), (1.0,), latency, 8 / latency, fits=fits)
    return Candidate(name, None, p)


@pytest.mark.parametrize("split_latency, chosen", [
    (0.50, "data x2"),  # 2x predicted: a gain well beyond the model's error
    ((1 - SPLIT_MARGIN) * 0.99, "data x2"),  # just past the margin
    ((1 - SPLIT_MARGIN) * 1.01, "single x1"),  # just inside it: not a gain to count on
    (0.95, "single x1"),
])
def test_split_must_beat_single_by_the_margin(split_latency: float, chosen: str) -> None:
    ranked = [_cand("data x2", split_latency), _cand("single x1", 1.0)]
    best, note = prefer_single(ranked, "latency")
    assert best.name == chosen
    assert ("kept single x1" in note) == (chosen == "single x1")


def test_throughput_objective_uses_the_same_margin() -> None:
    ranked = [_cand("pipeline x2", 0.9), _cand("single x1", 1.0)]
    assert prefer_single(ranked, "throughput")[0].name == "single x1"
    ranked = [_cand("pipeline x2", 0.5), _cand("single x1", 1.0)]
    assert prefer_single(ranked, "throughput")[0].name == "pipeline x2"


def test_single_that_does_not_fit_is_not_kept() -> None:
    ranked = [_cand("tensor x2", 0.95), _cand("single x1", 1.0, fits=False)]
    assert prefer_single(ranked, "latency")[0].name == "tensor x2"


def test_per_layer_sync_splits_need_the_larger_margin() -> None:
    """tensor/spatial/hybrid synchronise inside every layer; their measured error was far beyond
    25% (search.SYNC_SPLIT_MARGIN), so a 1.44x predicted gain (light SqueezeNet's tensor x2) is
    not enough, while the same gain from a data split is."""
    from partitioner.strategies.search import SYNC_SPLIT_MARGIN, split_margin

    assert split_margin("tensor x2") == split_margin("spatial x4") == SYNC_SPLIT_MARGIN > SPLIT_MARGIN
    assert split_margin("data x2") == split_margin("pipeline x2") == SPLIT_MARGIN
    ranked = [_cand("tensor x2", 1 / 1.44), _cand("single x1", 1.0)]
    best, note = prefer_single(ranked, "latency")
    assert best.name == "single x1" and "tensor x2" in note
    ranked = [_cand("data x2", 1 / 1.44), _cand("single x1", 1.0)]
    assert prefer_single(ranked, "latency")[0].name == "data x2"


def test_next_split_that_passes_its_margin_wins() -> None:
    """The first candidate in rank order that beats single by its own margin is taken."""
    ranked = [_cand("tensor x2", 0.6), _cand("data x2", 0.7), _cand("single x1", 1.0)]
    best, note = prefer_single(ranked, "latency")
    assert best.name == "data x2" and "tensor x2" in note and "chose data x2" in note


def test_a_split_that_does_not_fit_is_never_taken_over_single() -> None:
    ranked = [_cand("tensor x2", 0.9), _cand("data x2", 0.3, fits=False), _cand("single x1", 1.0)]
    assert prefer_single(ranked, "latency")[0].name == "single x1"
