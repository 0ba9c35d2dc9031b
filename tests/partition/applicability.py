"""Which zoo model x strategy x device count must apply, and why the others are refused.

Rule: a strategy test never treats ``StrategyNotApplicable`` as a pass. Each case in a test grid
either must partition (a refusal fails the test) or must be refused with the reason written here
(a partition that succeeds fails the test too), so a strategy that silently stops applying, or
one that starts to split a model it cannot split correctly, is caught. The table was taken from a
run of every builder at the small sizes of ``tests/partition/test_partition.py`` and
``tests/backends/test_tvm_zoo_matrix.py``; when a strategy learns to split more, edit the table.
"""

from __future__ import annotations

from typing import Callable, TypeVar

import pytest

from partitioner.core.errors import StrategyNotApplicable

T = TypeVar("T")

MODELS = ("mlp", "gpt", "bert", "resnet", "resnet50", "inception", "unet", "mobilenet")
STRATEGIES = ("data", "pipeline", "tensor", "spatial", "hybrid")
DEVICES = (2, 4)

_NO_CONV = "spatial partitioning needs a 4-D image input and Conv layers"
_NO_MESH_2 = "hybrid: no 2-D mesh applies to 2 devices"

# (model, strategy, devices) -> the refusal's text (a regex). Every other cell of
# MODELS x STRATEGIES x DEVICES must apply (at a batch of at least `devices`, see below).
REFUSED: dict[tuple[str, str, int], str] = {
    **{(m, "spatial", d): _NO_CONV for m in ("mlp", "gpt", "bert") for d in DEVICES},
    # hybrid on 2 devices is "data convs + tensor classifier" (resnet, resnet50, inception,
    # mobilenet end in a Gemm/MatMul classifier); a 2-D mesh needs 4 devices otherwise.
    **{(m, "hybrid", 2): _NO_MESH_2 for m in ("mlp", "gpt", "bert", "unet")},
}


def expected_refusal(name: str, strategy: str, devices: int, batch: int) -> str | None:
    """The regex the refusal must match, or None when the strategy must apply.

    Data parallelism with one micro-batch splits the batch, so it needs ``batch >= devices``.
    """
    if strategy in ("single", "auto"):
        return None
    if (name, strategy, devices) in REFUSED:
        return REFUSED[(name, strategy, devices)]
    if strategy == "data" and batch < devices:
        return rf"data parallelism: batch {batch} < {devices} devices"
    return None


def partition_as_expected(name: str, strategy: str, devices: int, batch: int, run: Callable[[], T]) -> T | None:
    """Call ``run`` (which partitions or compiles); assert the table's verdict both ways.

    Returns ``run()``'s result when the strategy must apply (a ``StrategyNotApplicable`` then
    propagates and fails the test), or None after checking the expected one-line refusal.
    """
    reason = expected_refusal(name, strategy, devices, batch)
    if reason is None:
        return run()
    with pytest.raises(StrategyNotApplicable, match=reason) as info:
        run()
    assert "\n" not in str(info.value), "a refusal says why in one line"
    return None
