"""Planning decoders that do not fit one device (issue 14): the memory the estimate predicts
(weights, activations, KV cache) and ``auto`` choosing a split that fits a limit.

The fast tests use a shapes-only Llama small enough to plan in seconds; the slow ones plan the
7B on ``h200:4x8`` and the 70B on ``a100:16x8`` in a subprocess and hold them to the issue's
budgets (7B under 30 s, 70B under 60 s, peak RSS under 2 GB; meaningful on a quiet machine).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import numpy_helper

import models_zoo
from models_zoo.llama import weight_bytes
from partitioner.load import load
from partitioner.partition import partition
from passes import run_pipeline

ROOT = Path(__file__).resolve().parents[2]
SMALL = dict(size="7b", hidden=512, intermediate=1376, layers=4, heads=8, kv_heads=2, vocab=4096, seq=128, batch=2)


def _export(folder: Path, **kw: object) -> Path:
    from models_zoo.export_large import save_model

    folder.mkdir(parents=True, exist_ok=True)
    model = models_zoo.build("llama", shapes_only=True, data_location="m.data", **kw)
    save_model(model, folder / "m.onnx")
    return folder / "m.onnx"


@pytest.fixture(scope="module")
def small_llama(tmp_path_factory: pytest.TempPathFactory):
    return run_pipeline(load(str(_export(tmp_path_factory.mktemp("llama"), **SMALL))))


def test_estimate_counts_weights_and_the_kv_cache(small_llama) -> None:
    res = partition(small_llama, "cpu:1", strategy="single", lower=False)
    dev = res.prediction["per_device"][0]
    b, s, layers, kv, dh, vocab = 2, 128, 4, 2, 512 // 8, 4096
    kv_cache = 2 * layers * b * kv * s * dh * 2  # key and value per layer, float16
    logits = b * s * vocab * 2
    assert dev["resident_output_bytes"] == kv_cache + logits
    inits = list(small_llama.graph.initializers.values())
    lazy = sum(v.const_value.nbytes for v in inits if isinstance(v.const_value, ir.ExternalTensor))
    norms = (2 * layers + 1) * 512 * 2  # RMSNorm scales, 1 KiB each: read in (under 64 KiB)
    assert lazy == weight_bytes(**{k: v for k, v in SMALL.items() if k != "batch"}) - norms  # on disk
    assert dev["weight_bytes"] == sum(v.const_value.nbytes for v in inits)  # + rotary tables, mask, shapes
    assert dev["peak_memory_bytes"] == pytest.approx(dev["weight_bytes"] + dev["activation_bytes"]
                                                     + dev["resident_output_bytes"])


def test_auto_splits_to_fit_a_memory_limit(small_llama) -> None:
    whole = partition(small_llama, "cpu:1", strategy="single", lower=False).prediction["per_device"][0]
    limit = 0.4 * whole["peak_memory_bytes"]  # needs at least 3 devices' worth of room
    res = partition(small_llama, "h200:4x8", strategy="auto", memory_limit=limit, lower=False)
    assert res.prediction["fits_memory"] is True
    assert res.plan.world_size >= 4
    assert max(d["peak_memory_bytes"] for d in res.prediction["per_device"]) <= limit
    over = [a for a in res.alternatives if a.get("fits_memory") is False]
    assert any(a["candidate"] == "single x1" for a in over)
    assert all(a["peak_memory_bytes"] > limit for a in over)
    assert "Over the memory limit" in res.explanation and "KV cache" in res.explanation
    assert res.programs == () and res.prediction["simulated"] is None


def test_lowered_small_plan_agrees_on_weight_bytes(small_llama) -> None:
    """With lowering, the rank programs' external weight references add up to the estimate's
    weight bytes per rank (the references carry shard dims, not bytes)."""
    res = partition(small_llama, "cpu:4", strategy="pipeline", lower=True)
    for r, prog in enumerate(res.programs):
        refs = [t for t in prog.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL]
        assert refs and all(not t.raw_data for t in refs)
        held = sum(int(np.prod(t.dims)) * 2 for t in refs)
        held += sum(numpy_helper.to_array(t).nbytes for t in prog.graph.initializer
                    if t.data_location != onnx.TensorProto.EXTERNAL)
        assert held == pytest.approx(res.prediction["per_device"][r]["weight_bytes"], rel=0.01)


_PLAN = """
import resource, sys, time
from partitioner.cli import main
from partitioner.core.machine import peak_rss_bytes
t = time.perf_counter()
rc = main(sys.argv[1:])
sys.stdout.flush()
u = resource.getrusage(resource.RUSAGE_SELF)
print("BUDGET", time.perf_counter() - t, u.ru_utime + u.ru_stime, peak_rss_bytes(), file=sys.stderr)
sys.exit(rc)
"""


def _plan_in_subprocess(*args: str) -> tuple[dict, float, float, int]:
    """(report, wall seconds, CPU seconds, peak RSS bytes) of one CLI run in a fresh process."""
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", _PLAN, *args], capture_output=True, text=True, env=env,
                          timeout=1800, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    line = next(x for x in proc.stderr.splitlines() if x.startswith("BUDGET"))
    _, wall, cpu, rss = line.split()
    return json.loads(proc.stdout), float(wall), float(cpu), int(rss)


@pytest.mark.slow
@pytest.mark.parametrize(("size", "cluster", "limit", "seconds"), [("7b", "h200:4x8", "8GiB", 30),
                                                                 ("70b", "a100:16x8", "40GiB", 60)])
def test_llm_plans_within_budget(tmp_path: Path, size: str, cluster: str, limit: str, seconds: float) -> None:
    path = tmp_path / f"llama{size}.onnx"
    t = time.perf_counter()
    models_zoo_export = [sys.executable, "-m", "partitioner.cli", "zoo", "export", "llama", "--size", size,
                         "--shapes-only", "-o", str(path)]
    subprocess.run(models_zoo_export, check=True, capture_output=True, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
                   cwd=ROOT, timeout=600)
    assert time.perf_counter() - t < 60
    data = path.with_suffix(".data")
    assert data.stat().st_size > 13e9 and data.stat().st_blocks * 512 < 2**20  # sparse: no weight bytes exist
    report, wall, cpu, rss = _plan_in_subprocess("inspect", str(path), "--json")
    assert report["param_bytes"] >= data.stat().st_size  # every weight counted, from the dims alone
    assert rss < 2 * 2**30, f"inspect peaked at {rss / 2**30:.2f} GiB"
    assert cpu < seconds, f"inspect took {cpu:.1f} s of CPU ({wall:.1f} s wall; budget {seconds} s)"
    report, wall, cpu, rss = _plan_in_subprocess("plan", str(path), "--cluster", cluster, "--strategy", "auto",
                                            "--memory-limit", limit, "--json")
    assert report["prediction"]["fits_memory"] is True
    assert report["plan"]["world_size"] > 1  # neither model fits the limit on one device
    assert rss < 2 * 2**30, f"plan peaked at {rss / 2**30:.2f} GiB"
    # The budget is wall time on a quiet machine; the planner is single-threaded, so its CPU time
    # is that figure on a machine shared with other work (where the wall clock means nothing).
    assert cpu < seconds, f"plan took {cpu:.1f} s of CPU ({wall:.1f} s wall; budget {seconds} s)"
