"""Differential fuzzing of partitions (NNSmith-style): random valid ONNX graphs x random plans,
run partitioned and compared with an unpartitioned ONNX Runtime run on the same seeded inputs.

- ``test_reference_backend_matches_onnxruntime``: 200 applicable examples through the reference
  backend (``run_reference``), derandomized so CI is deterministic; a failure is shrunk by
  hypothesis to a small graph and printed with its plan.
- ``test_tvm_backend_matches_onnxruntime``: ~10 applicable examples built with TVM
  (``FUZZ_TVM_EXAMPLES``).
- ``test_fuzz_campaign`` (``slow`` and ``fuzz``): ``FUZZ_EXAMPLES`` (default 5,000) examples with
  seed ``FUZZ_SEED``; every ``FUZZ_TVM_EVERY``-th applicable example (default 50) also runs
  through TVM. It never stops at the first failure: it writes
  ``benchmarks/results/fuzz_summary.json`` and then fails if any mismatch or crash was found.
  ``FUZZ_EXAMPLES=5000 .venv/bin/python -m pytest tests/fuzz -m slow -q``

Tolerance: see :mod:`tests.fuzz.differential` (rtol 1e-4, atol 1e-5 scaled by the output's
magnitude and the square root of the longest reduction). A strategy that raises
StrategyNotApplicable is not a failure (the example is discarded); any other exception is. An
``auto`` example that chose 1 rank is discarded too in the CI tests (it splits nothing).
"""

from __future__ import annotations

import os

import onnx
import pytest
from hypothesis import HealthCheck, Phase, assume, given, seed, settings
from hypothesis import strategies as st

from .campaign import Campaign
from .differential import check_reference, check_tvm
from .graph_strategy import graphs, plans

CI_EXAMPLES = int(os.environ.get("FUZZ_CI_EXAMPLES", "200"))
TVM_EXAMPLES = int(os.environ.get("FUZZ_TVM_EXAMPLES", "10"))
CAMPAIGN_EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "5000"))
CAMPAIGN_SEED = int(os.environ.get("FUZZ_SEED", "0"))
TVM_EVERY = int(os.environ.get("FUZZ_TVM_EVERY", "50"))

_LENIENT = [HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large,
            HealthCheck.large_base_example]


def _report(fg, fp, outcome) -> str:  # noqa: ANN001
    return (f"{outcome.status}: strategy={fp.strategy} devices={fp.devices} microbatches={fp.microbatches} "
            f"(chose {outcome.chosen or '-'}): {outcome.detail}\n{onnx.printer.to_text(fg.model.graph)}")


@settings(max_examples=CI_EXAMPLES, deadline=None, derandomize=True, database=None,
          suppress_health_check=_LENIENT)
@given(data=st.data())
def test_reference_backend_matches_onnxruntime(data: st.DataObject) -> None:
    fg = data.draw(graphs(), label="graph")
    fp = data.draw(plans(fg.batch), label="plan")
    outcome = check_reference(fg, fp)
    assume(outcome.status != "not_applicable")
    assume(outcome.status != "ok" or outcome.world_size > 1)  # auto choosing 1 rank splits nothing
    assert outcome.status == "ok", _report(fg, fp, outcome)


@settings(max_examples=TVM_EXAMPLES, deadline=None, derandomize=True, database=None,
          suppress_health_check=_LENIENT, phases=[Phase.explicit, Phase.generate])  # shrinking TVM builds takes minutes
@given(data=st.data())
def test_tvm_backend_matches_onnxruntime(data: st.DataObject) -> None:
    fg = data.draw(graphs(max_ops=8), label="graph")
    fp = data.draw(plans(fg.batch), label="plan")
    outcome = check_tvm(fg, fp)
    assume(outcome.status != "not_applicable")
    assume(outcome.status != "ok" or outcome.world_size > 1)  # auto choosing 1 rank splits nothing
    assert outcome.status == "ok", _report(fg, fp, outcome)


@pytest.mark.slow
@pytest.mark.fuzz
def test_fuzz_campaign() -> None:
    campaign = Campaign(seed=CAMPAIGN_SEED)
    import tvm  # noqa: F401  (a broken install fails the campaign, never skips its TVM part)

    have_tvm = True
    applicable = [0]

    @seed(CAMPAIGN_SEED)
    @settings(max_examples=CAMPAIGN_EXAMPLES, deadline=None, database=None, suppress_health_check=_LENIENT)
    @given(data=st.data())
    def one(data: st.DataObject) -> None:
        fg = data.draw(graphs())
        fp = data.draw(plans(fg.batch))
        outcome = check_reference(fg, fp)
        campaign.record(fg, outcome)
        if outcome.status == "not_applicable":
            return
        applicable[0] += 1
        if have_tvm and TVM_EVERY > 0 and applicable[0] % TVM_EVERY == 0:
            campaign.record(fg, check_tvm(fg, fp), backend="tvm")
        if campaign.examples % 250 == 0:
            campaign.write()  # a partial summary survives an interrupted campaign

    one()
    path = campaign.write()
    assert campaign.examples >= CAMPAIGN_EXAMPLES * 0.9, f"only {campaign.examples} examples ran"
    failures = campaign.failures
    assert not failures, (f"{campaign.count('mismatch')} mismatch(es), {campaign.count('crash')} crash(es); see {path}: "
                          + "; ".join(f"{f['status']} {f['strategy']}x{f['devices']}: {f['detail']}" for f in failures[:5]))
