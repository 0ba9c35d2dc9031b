"""GPU artifacts on a CPU machine (issue 17, items 1 and 4): ``compile --target h200`` needs no
GPU, the manifest records the arch and the device numbers, ``verify`` works, and ``run`` refuses
in one line (exit 2) before it loads any library when no visible GPU can run the cubins.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import onnx
import pytest

import models_zoo
from backends.cuda_devices import (CudaDevice, arch_runs_on, artifact_gpu_arch, gpu_mismatch,
                                              parse_arch, visible_gpus)

ROOT = Path(__file__).resolve().parents[2]


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "partitioner.cli", *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=600)


@pytest.fixture(scope="module")
def gpu_artifact(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("gpu")
    onnx.save(models_zoo.build("mlp"), d / "mlp.onnx")
    r = _cli("compile", str(d / "mlp.onnx"), "-o", str(d / "a_gpu"), "--devices", "2", "--target", "h200",
             "--strategy", "tensor", "--jobs", "1")  # auto keeps this tiny mlp on one H200
    assert r.returncode == 0, r.stderr
    return d / "a_gpu"


def test_compile_for_h200_records_arch_and_device(gpu_artifact: Path) -> None:
    m = json.loads((gpu_artifact / "manifest.json").read_text())
    assert m["world_size"] == 2 and m["backend"] == "tvm"
    assert m["target"]["kind"] == "cuda" and m["target"]["arch"] == "sm_90" and m["target"]["model"] == "h200"
    assert m["cluster"]["name"] == "h200x2"  # the planner planned for H200s over NVLink, not CPU cores
    for r in m["ranks"]:
        gpu = r["build"]["gpu"]
        assert gpu["arch"] == "sm_90" and gpu["device"] == "h200" and gpu["kernels"] >= 1
        assert gpu["memory_bytes"] == 141e9  # the H200 datasheet's 141 GB
    assert artifact_gpu_arch(m) == (True, "sm_90")


def test_verify_works_without_a_gpu(gpu_artifact: Path) -> None:
    r = _cli("verify", str(gpu_artifact), "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["ok"] is True


def test_run_refuses_in_one_line_without_a_matching_gpu(gpu_artifact: Path) -> None:
    if gpu_mismatch("sm_90") is None:
        pytest.skip(f"this machine has a GPU that runs sm_90 ({visible_gpus()}); make gpu-check runs it")
    r = _cli("run", str(gpu_artifact), "--inputs", str(_inputs(gpu_artifact)))
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2, r.stderr
    assert len(lines) == 1 and "cannot run here" in lines[0] and "sm_90" in lines[0], lines
    assert "Traceback" not in r.stderr


def test_run_refuses_before_loading_a_library(gpu_artifact: Path, monkeypatch) -> None:
    """The in-process runner is the one that loads libraries in this process: spy on the loader."""
    if gpu_mismatch("sm_90") is None:
        pytest.skip("this machine has a GPU that runs sm_90")
    import backends.tvm.executable as ex
    from partitioner.compiler import load_artifact
    from partitioner.core.errors import BackendError

    loaded = []
    monkeypatch.setattr(ex, "TvmRankExecutable", lambda *a, **k: loaded.append(a))
    art = load_artifact(gpu_artifact)
    with pytest.raises(BackendError, match="cannot run here"):
        art.run(_inputs(gpu_artifact), in_process=True)
    assert loaded == []


def _inputs(art_dir: Path) -> Path:
    import numpy as np

    from partitioner.artifact import load_artifact
    from partitioner.core.bindings import seeded_inputs

    path = art_dir.parent / "inputs.npz"
    if not path.exists():
        np.savez(path, **seeded_inputs(load_artifact(art_dir).bindings, 0))
    return path


def test_binary_compatibility_rule() -> None:
    """CUDA's rule for cubins: same major compute capability, device minor >= build minor."""
    a100, a10, l4, h100 = (CudaDevice(0, "A100", 8, 0), CudaDevice(0, "A10", 8, 6), CudaDevice(0, "L4", 8, 9),
                           CudaDevice(0, "H100", 9, 0))
    assert parse_arch("sm_90") == (9, 0) and parse_arch("sm_89") == (8, 9) and parse_arch("sm_90a") == (9, 0)
    assert parse_arch("sm_100") == (10, 0) and parse_arch("volta") is None
    assert arch_runs_on("sm_80", a100) and arch_runs_on("sm_80", a10) and arch_runs_on("sm_80", l4)
    assert not arch_runs_on("sm_89", a100) and not arch_runs_on("sm_80", h100) and not arch_runs_on("sm_90", l4)
    assert arch_runs_on("sm_90", h100)
    assert "has none visible" in gpu_mismatch("sm_90", [])
    assert "recompile" in gpu_mismatch("sm_90", [a100]) and gpu_mismatch("sm_80", [a100, h100]) is None


def test_cpu_artifact_is_not_a_gpu_artifact() -> None:
    assert artifact_gpu_arch({"target": None, "ranks": [{"build": {"target": {"kind": "llvm"}}}]}) == (False, None)


def test_gpu_check_refuses_in_one_line_without_a_gpu(tmp_path: Path) -> None:
    if visible_gpus():
        pytest.skip("this machine has a GPU: make gpu-check runs the real check")
    out = tmp_path / "gpu.json"
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--json", str(out)],
                       capture_output=True, text=True, cwd=ROOT, timeout=120)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and "no CUDA GPU is visible" in lines[0], r.stderr
    assert not out.exists()


# --- slow: every zoo model for h200 on 1 and 2 ranks ---------------------------------------------

SMALL = {
    "mlp": {}, "resnet": {"image": 32, "width": 16}, "resnet50": {"image": 32, "width": 8},
    "bert": {"seq": 8}, "gpt": {"seq": 8}, "unet": {"image": 32, "base": 8},
    "inception": {"image": 32}, "mobilenet": {"image": 32, "width_mult": 0.5}, "llama": {"size": "tiny"},
}


def _zoo_cases():
    for e in models_zoo.list_models():
        for ranks in (1, 2):
            yield pytest.param(e.name, ranks, marks=pytest.mark.slow, id=f"{e.name}-{ranks}")


@pytest.mark.parametrize(("name", "ranks"), list(_zoo_cases()))
def test_zoo_model_compiles_for_h200_and_verifies(name: str, ranks: int, tmp_path: Path) -> None:
    from partitioner.compiler import compile as compile_artifact
    from partitioner.artifact import verify_artifact
    from partitioner.core.errors import StrategyNotApplicable

    batch = {"batch": 2} if name in SMALL else {}
    model = models_zoo.build(name, **SMALL.get(name, {}), **batch)
    strategies = ("single",) if ranks == 1 else ("data", "tensor", "pipeline")
    for strategy in strategies:  # the first strategy that applies to this model
        try:
            art = compile_artifact(model, ranks, strategy=strategy, target="h200", out_dir=tmp_path / "a",
                                   jobs=1, progress=False)
            break
        except StrategyNotApplicable:
            continue
    else:
        pytest.fail(f"no 2-rank strategy applies to {name}")
    assert art.world_size == ranks and art.manifest["cluster"]["name"] == f"h200x{ranks}"
    m = verify_artifact(art.root)
    assert m["target"]["arch"] == "sm_90"
    assert all(r["build"]["gpu"]["kernels"] >= 1 for r in m["ranks"])
