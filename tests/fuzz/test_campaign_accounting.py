"""The robustness figures count only examples that were really split: an ``auto`` run that chose
``single`` matches ONNX Runtime trivially and is counted apart (campaign summary and
benchmarks/robustness.py, old and new summary formats)."""

from __future__ import annotations


from onnx import TensorProto, helper

from .campaign import Campaign
from .differential import Outcome, check_reference
from .graph_strategy import FuzzGraph, FuzzPlan
from tests.bench_scripts import load as load_script


def _robustness():
    return load_script("robustness")


def _tiny(batch: int) -> FuzzGraph:
    g = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "tiny",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, 8])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, 8])])
    return FuzzGraph(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), 1, ("Relu",))


def test_outcome_records_the_ranks_that_ran() -> None:
    split = check_reference(_tiny(4), FuzzPlan("data", 2, None))
    assert split.status == "ok" and split.world_size == 2


def test_campaign_counts_unsplit_auto_apart() -> None:
    c = Campaign(seed=0)
    fg = _tiny(4)
    c.record(fg, Outcome("ok", "auto", 2, None, chosen="single", world_size=1))
    c.record(fg, Outcome("ok", "auto", 2, None, chosen="data", world_size=2))
    c.record(fg, Outcome("ok", "tensor", 4, None, chosen="tensor", world_size=4))
    c.record(fg, Outcome("not_applicable", "spatial", 2, None, detail="no conv"))
    c.record(fg, Outcome("ok", "auto", 2, None, chosen="single", world_size=1), backend="tvm")
    s = c.summary()
    assert s["split"] == {"auto": 1, "tensor": 1}
    assert s["matched_unsplit"] == {"auto": 1}
    assert s["tvm_split"] == 0 and s["tvm"] == {"ok": 1}
    split, unsplit = _robustness().split_counts(s)
    assert split == {"auto": 1, "tensor": 1} and unsplit == 1


def test_old_summaries_subtract_auto_single() -> None:
    old = {"strategies_exercised": {"auto": {"ok": 10}, "data": {"ok": 5, "not_applicable": 3}},
           "auto_chose": {"single": 4, "data": 6}}
    split, unsplit = _robustness().split_counts(old)
    assert split == {"auto": 6, "data": 5} and unsplit == 4


def test_readme_row_states_what_was_not_counted() -> None:
    row = _robustness().markdown().splitlines()[2]
    assert "split over 2-4 ranks and matched" in row and "where auto chose 1 rank" in row
