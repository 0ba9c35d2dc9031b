"""benchmarks/per_device.py times ONNX Runtime and the TVM builds the same way, in interleaved
blocks (:func:`paired_times`, ``BLOCKS``), so one slow stretch of a shared machine cannot move
one engine's time and not the other's.

The check runs two engines of equal cost (1 ms a call) on a fake clock, with one slow episode
(every call 3x slower) that starts when the second engine is first called and lasts 60 ms: about
one block. Timed in one block each (``BLOCKS = 1``, the old timing) the second engine's whole
block falls in the episode and it reads 3x slower than the first; interleaved, the episode
reaches one of its blocks and the median of block medians gives the true ratio, 1.
"""

from __future__ import annotations


import pytest
from tests.bench_scripts import load as load_script

COST_S = 1e-3
EPISODE_S = 0.06
SLOWDOWN = 3.0


def _per_device():
    return load_script("per_device")


class FakeMachine:
    """A clock, a sleep and engines that advance it; calls in the episode cost SLOWDOWN x."""

    def __init__(self) -> None:
        self.t = 0.0
        self.episode_start: float | None = None
        self.calls: list[str] = []

    def clock(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.t += s

    def engine(self, name: str, starts_episode: bool):
        def run() -> None:
            if starts_episode and self.episode_start is None:
                self.episode_start = self.t
            slow = self.episode_start is not None and self.episode_start <= self.t < self.episode_start + EPISODE_S
            self.t += COST_S * (SLOWDOWN if slow else 1.0)
            self.calls.append(name)

        return run


def test_interleaved_blocks_keep_one_slow_stretch_out_of_the_ratio() -> None:
    pd = _per_device()
    fake = FakeMachine()
    fns = {"ort": fake.engine("ort", False), "tvm": fake.engine("tvm", True)}
    got = pd.paired_times(fns, 5, clock=fake.clock, sleep=fake.sleep)  # the module's BLOCKS
    assert pd.BLOCKS > 1
    assert got["tvm"]["s"] / got["ort"]["s"] == pytest.approx(1.0, rel=0.05)
    # the episode is visible in the record, not hidden: one of tvm's blocks is ~3x slower
    assert max(got["tvm"]["block_ms"]) == pytest.approx(1e3 * COST_S * SLOWDOWN, rel=0.05)
    assert len(got["tvm"]["block_ms"]) == len(got["ort"]["block_ms"]) == pd.BLOCKS


def test_one_block_each_is_what_the_episode_skews() -> None:
    """The same machine timed the old way: the check above is not true by construction."""
    pd = _per_device()
    fake = FakeMachine()
    fns = {"ort": fake.engine("ort", False), "tvm": fake.engine("tvm", True)}
    got = pd.paired_times(fns, 5, 1, clock=fake.clock, sleep=fake.sleep)
    assert got["tvm"]["s"] / got["ort"]["s"] == pytest.approx(SLOWDOWN, rel=0.05)


def test_engines_take_turns_first() -> None:
    """Every other round starts with the other engine, so neither always follows the other's pool."""
    pd = _per_device()
    fake = FakeMachine()
    order: list[str] = []

    def engine(name: str):
        def run() -> None:
            if not order or order[-1] == "|":
                order[-1:] = [name]  # first call after a settle pause: a new block of ``name``
            fake.t += COST_S

        return run

    def sleep(s: float) -> None:
        order.append("|")
        fake.sleep(s)

    pd.paired_times({"ort": engine("ort"), "tvm": engine("tvm")}, 2, 4, clock=fake.clock, sleep=sleep)
    assert order == ["ort", "tvm", "tvm", "ort", "ort", "tvm", "tvm", "ort"]


def test_runtime_baseline_runs_the_same_build_with_the_setting_changed() -> None:
    """``--runtime-baseline MODULE.ATTR=VALUE``: the base engine sees VALUE during each call, the
    default engine the value in force, and the module keeps its value between calls."""
    from backends.tvm import contention

    pd = _per_device()
    seen: list[int] = []
    now, base = pd.parse_settings(["backends.tvm.contention.CONTENTION_SWITCHES=0"])
    default = contention.CONTENTION_SWITCHES
    pd.with_settings(lambda: seen.append(contention.CONTENTION_SWITCHES), base)()
    pd.with_settings(lambda: seen.append(contention.CONTENTION_SWITCHES), now)()
    assert seen == [0, default] and default != 0
    assert contention.CONTENTION_SWITCHES == default


def test_build_baseline_sets_the_setting_only_while_its_variant_builds(monkeypatch, tmp_path) -> None:
    """``--build-baseline MODULE.ATTR=VALUE``: the ``build_base`` variant is built with VALUE in
    force, the default variant with the module's own value, and the module keeps its value."""
    from backends.tvm.schedules import contraction

    pd = _per_device()
    seen: dict[str, bool] = {}

    def fake_build(m, out, opts):
        seen[out.name] = contraction.FULL_WIDTH_NARROW_TILE
        return out.name, 0.0

    monkeypatch.setattr(pd, "_tvm_build", fake_build)
    default = contraction.FULL_WIDTH_NARROW_TILE
    _, base = pd.parse_settings([f"backends.tvm.schedules.contraction.FULL_WIDTH_NARROW_TILE={not default}"])
    variants = {"scheduled": {"pipeline": "scheduled"},
                "build_base": {"pipeline": "scheduled", "build_settings": base}}
    exes, _ = pd._tvm_builds(None, "m", variants, 1, tmp_path)
    assert seen == {"m_scheduled_t1.so": default, "m_build_base_t1.so": not default}
    assert set(exes) == {"scheduled", "build_base"} and variants["build_base"]["build_settings"] == base
    assert contraction.FULL_WIDTH_NARROW_TILE == default


def test_block_load_shares() -> None:
    """Over one block of 1 s on 2 CPUs (200 ticks at 100 Hz): 150 busy ticks of which this
    process used 1.2 s leave 0.3 s to other processes (0.15 of the machine); 20 stolen ticks are
    0.1; the process ran 1.2 CPU seconds per wall second."""
    import os

    pd = _per_device()
    hz = os.sysconf("SC_CLK_TCK")
    t0 = (0, 0, 0)
    t1 = (int(1.5 * hz), int(0.2 * hz), int(2.0 * hz))
    got = pd._block_load(t0, t1, cpu_s=1.2, wall_s=1.0)
    assert got == {"cpu_per_wall": 1.2, "foreign_share": 0.15, "steal_share": 0.1}
    assert pd._block_load(None, t1, 1.0, 1.0)["foreign_share"] == -1.0


def test_paired_times_records_each_blocks_load() -> None:
    pd = _per_device()
    got = pd.paired_times({"a": lambda: sum(range(200000)), "b": lambda: sum(range(200000))}, 3, 2)
    for name in ("a", "b"):
        loads = got[name]["block_load"]
        assert len(loads) == 2
        for load in loads:  # one thread busy in Python: up to one CPU second per wall second (less
            # when other processes take the core: a CI rehearsal beside a test run measured under 0.3)
            assert 0.02 < load["cpu_per_wall"] < 1.5, load
            for share in ("foreign_share", "steal_share"):  # -1: no tick passed in so short a block
                assert load[share] == -1.0 or 0.0 <= load[share] <= 1.0, load


def test_paired_ratio_compares_blocks_of_one_round() -> None:
    """A machine with two speeds (session 21: 2-thread blocks of every engine at ~6 or ~10 ms on
    resnet18 b1) and an engine truly 0.9x ONNX Runtime. The state changes between the two blocks
    of round 3 only; the medians of 5 blocks then fall in different states (9 against 6 ms: 1.5x)
    while the ratio within each round is 0.9 in four rounds of five."""
    pd = _per_device()
    fast, slow = 6.0, 10.0
    states = [("f", "f"), ("s", "s"), ("s", "s"), ("f", "s"), ("f", "f")]  # (ORT, TVM) per round
    ort = [fast if o == "f" else slow for o, _ in states]
    tvm = [0.9 * (fast if t == "f" else slow) for _, t in states]
    assert sorted(tvm)[2] / sorted(ort)[2] == pytest.approx(1.5)  # the ratio of the two medians
    assert pd.paired_ratio(tvm, ort) == pytest.approx(0.9)
