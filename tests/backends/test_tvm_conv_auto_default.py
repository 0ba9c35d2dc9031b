"""``conv_algorithm="auto"`` as the TVM build's default (backends/tvm/conv_algorithms.py rule 2):
a build that names no algorithm measures each distinct eligible conv once per machine, keeps the
choice in this machine's cache (``$PARTITIONER_CACHE_DIR/tvm/...``), and a second compile in a new
process measures nothing; the timing is interleaved and a non-direct algorithm needs a 5% lead;
a corrupt cache is ignored with one line; convs with weights as graph inputs (training graphs)
build exactly as with ``direct``. Outputs are checked against ONNX Runtime (seeded, rtol 1e-4,
atol 1e-5). The suite pins ``direct`` (tests/conftest.py); these tests unset that pin."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import backends.tvm as bt
from backends.tvm import conv_algorithms as ca
from partitioner.runtime.comm_local import LocalWorld

ROOT = Path(__file__).resolve().parents[2]
RTOL, ATOL = 1e-4, 1e-5


def _two_convs(weights_as_inputs: bool = False) -> onnx.ModelProto:
    """3x3 (8 -> 16) then 3x3 stride 2 (16 -> 16) on 2x8x10x10, each with ReLU."""
    rng = np.random.default_rng(3)
    w1 = (rng.standard_normal((16, 8, 3, 3)) / np.sqrt(72)).astype(np.float32)
    w2 = (rng.standard_normal((16, 16, 3, 3)) / np.sqrt(144)).astype(np.float32)
    nodes = [helper.make_node("Conv", ["x", "w1"], ["c1"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c1"], ["r1"]),
             helper.make_node("Conv", ["r1", "w2"], ["c2"], pads=[1, 1, 1, 1], strides=[2, 2]),
             helper.make_node("Relu", ["c2"], ["y"])]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8, 10, 10])]
    inits = [numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(w2, "w2")]
    if weights_as_inputs:
        inputs += [helper.make_tensor_value_info(t.name, TensorProto.FLOAT, list(t.dims)) for t in inits]
        inits = []
    g = helper.make_graph(nodes, "two_convs", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    return onnx.shape_inference.infer_shapes(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]))


def _feeds(m: onnx.ModelProto) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    return {i.name: rng.standard_normal([d.dim_value for d in i.type.tensor_type.shape.dim]).astype(np.float32)
            for i in m.graph.input}


def _check_against_ort(m: onnx.ModelProto, so: Path) -> None:
    feeds = _feeds(m)
    got = bt.load(m, so).run(feeds, LocalWorld(1).communicator(0))["y"]
    want = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(["y"], feeds)[0]
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)


@pytest.fixture
def auto_default(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The build default as shipped (no pin), an empty machine cache, an empty process cache."""
    monkeypatch.delenv(ca.DEFAULT_ENV, raising=False)
    monkeypatch.setenv("PARTITIONER_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(ca, "_MEASURED", {})
    return tmp_path / "cache"


def _counting(monkeypatch: pytest.MonkeyPatch) -> list[dict]:
    calls: list[dict] = []
    real = ca._time_candidates

    def counted(p, target):
        calls.append(p)
        return real(p, target)

    monkeypatch.setattr(ca, "_time_candidates", counted)
    return calls


_SECOND_BUILD = """
import json, sys
import onnx
from backends.tvm import conv_algorithms as ca
import backends.tvm as bt

def refuse(p, target):
    raise SystemExit("measured again: " + json.dumps(p["data"]))

ca._time_candidates = refuse
facts = bt.build(onnx.load(sys.argv[1]), sys.argv[2], options={})
print(json.dumps(facts.get("conv_choices")))
"""


def test_second_compile_in_a_new_process_measures_nothing(auto_default: Path, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    m = _two_convs()
    calls = _counting(monkeypatch)
    facts = bt.build(m, tmp_path / "a.so", options={})  # no conv_algorithm: the default, auto
    assert len(calls) == 2  # two distinct eligible convs, each measured once
    assert [c["from"] for c in facts["conv_choices"]] == ["measured", "measured"]
    assert sum(facts["conv_algorithms"].values()) == 2
    _check_against_ort(m, tmp_path / "a.so")
    (cache,) = auto_default.glob(f"tvm/*/{ca.CACHE_FILE}")
    assert len(json.loads(cache.read_text())) == 2
    onnx.save(m, tmp_path / "m.onnx")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", _SECOND_BUILD, str(tmp_path / "m.onnx"), str(tmp_path / "b.so")],
                         capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    second = json.loads(out.stdout.strip().splitlines()[-1])
    assert [c["from"] for c in second] == ["cache", "cache"]
    assert [c["algorithm"] for c in second] == [c["algorithm"] for c in facts["conv_choices"]]
    _check_against_ort(m, tmp_path / "b.so")


def test_direct_default_measures_nothing(auto_default: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _counting(monkeypatch)
    monkeypatch.setattr(ca, "DEFAULT_ALGORITHM", "direct")
    facts = bt.build(_two_convs(), tmp_path / "a.so", options={})
    assert calls == [] and "conv_choices" not in facts and "conv_algorithms" not in facts


def test_weights_as_inputs_build_exactly_as_direct(auto_default: Path, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Training graphs feed the weights as inputs: not eligible, never measured, same library."""
    m = _two_convs(weights_as_inputs=True)
    calls = _counting(monkeypatch)
    auto = bt.build(m, tmp_path / "auto.so", options={})
    direct = bt.build(m, tmp_path / "direct.so", options={"conv_algorithm": "direct"})
    assert calls == [] and "conv_choices" not in auto
    assert auto["sha256"] == direct["sha256"]
    _check_against_ort(m, tmp_path / "auto.so")


@pytest.mark.parametrize("flush", [0, 1 << 20])
def test_candidates_are_timed_interleaved(monkeypatch: pytest.MonkeyPatch, flush: int) -> None:
    order: list[str] = []
    monkeypatch.setattr(ca, "_build_alone", lambda p, a, target: (lambda: order.append(a)))
    monkeypatch.setattr(ca, "AUTO_FLUSH_BYTES", flush)
    p = {"im2col": True, "winograd": True}
    times = ca._time_candidates(p, None)
    assert set(times) == {"direct", "im2col", "winograd"}
    runs = [a for i, a in enumerate(order) if i == 0 or order[i - 1] != a]  # consecutive repeats collapsed
    names = ["direct", "im2col", "winograd"]
    rounds = 3 * ca.AUTO_ROUNDS if flush else ca.AUTO_ROUNDS
    rotated = [a for r in range(rounds) for a in names[r % 3:] + names[:r % 3]]
    assert runs == names + rotated  # warm-up (+ direct's calibration call, merged), then rotating rounds


def test_cold_cache_timing_calls_each_candidate_once_per_round(monkeypatch: pytest.MonkeyPatch) -> None:
    """AUTO_FLUSH_BYTES: one call per candidate per round, after the caches were flushed (off: a
    round repeats the call until it lasts AUTO_ROUND_S, hot)."""
    order: list[str] = []
    monkeypatch.setattr(ca, "_build_alone", lambda p, a, target: (lambda: order.append(a)))
    ca._time_candidates({"im2col": True, "winograd": False}, None)
    assert order.count("im2col") == 1 + 3 * ca.AUTO_ROUNDS  # warm-up + one cold call a round


def test_one_thread_builds_time_thread_cpu() -> None:
    """A 1-thread build's candidates are timed by the calling thread's CPU time (preemption by
    other processes not counted); a parallel build's by wall time."""
    import time

    from backends.tvm.schedules.threads import building_for

    with building_for(1):
        assert ca._clock() is time.thread_time
    with building_for(None):
        assert ca._clock() is time.perf_counter


def test_pick_needs_the_margin(monkeypatch: pytest.MonkeyPatch) -> None:
    assert ca.pick({"direct": 1.0, "im2col": 0.97, "winograd": 0.99}) == "direct"  # 3% lead: noise
    assert ca.pick({"direct": 1.0, "im2col": 0.97, "winograd": 0.90}) == "winograd"
    assert ca.pick({"direct": 0.9, "im2col": 1.0}) == "direct"
    monkeypatch.setattr(ca, "AUTO_MARGIN", 0.0)
    assert ca.pick({"direct": 1.0, "im2col": 0.97, "winograd": 0.99}) == "im2col"


def test_corrupt_cache_is_ignored_with_one_line_and_merged(auto_default: Path, tmp_path: Path, capsys) -> None:
    cache = tmp_path / "c" / ca.CACHE_FILE
    cache.parent.mkdir()
    cache.write_text("{not json")
    p = {"data": [1, 6, 6, 8], "weight": [3, 3, 8, 8], "strides": (1, 1), "dilation": (1, 1), "padding": (1, 1, 1, 1),
         "im2col": True, "winograd": True}
    times = {"direct": 1.0, "im2col": 0.5, "winograd": 2.0}
    orig = ca._time_candidates
    try:
        ca._time_candidates = lambda p, target: dict(times)
        assert ca.measure(p, None, cache) == ("im2col", "measured")
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "unreadable conv algorithm cache" in err[0]
        ca._MEASURED.clear()
        q = {**p, "data": [1, 7, 7, 8]}
        times["winograd"] = 0.1
        assert ca.measure(q, None, cache) == ("winograd", "measured")
        ca._MEASURED.clear()
        assert ca.measure(p, None, cache) == ("im2col", "cache")  # the first entry survived the second write
    finally:
        ca._time_candidates = orig
    assert len(json.loads(cache.read_text())) == 2 and not list(cache.parent.glob("*.tmp"))


def test_bad_default_from_the_environment_is_one_line_exit_2(tmp_path: Path, monkeypatch, capsys) -> None:
    from partitioner.cli import main

    monkeypatch.setenv(ca.DEFAULT_ENV, "fft")
    assert main(["compile", "mlp", "-o", str(tmp_path / "a")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and ca.DEFAULT_ENV in err[0]
