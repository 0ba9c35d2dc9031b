"""GPU compile targets (issue 17, item 1): presets read from the cluster table, explicit JSON,
the planner's GPU cluster, and the one-line error when the ``cuda`` extra is missing.

No GPU is needed for any of these: compiling for a GPU cross-compiles with NVRTC.
"""

from __future__ import annotations

import argparse
import sys

import pytest

from backends.tvm.target import GPU_PRESETS, gpu_cluster_spec, gpu_facts, resolve_target, target_dict
from partitioner.cluster import Cluster, gpu_spec
from partitioner.commands._options import cluster_from_args
from partitioner.core.errors import BackendError

# the published compute capabilities (NVIDIA's CUDA GPUs list), not read from our code
EXPECTED_ARCH = {"h100": "sm_90", "h200": "sm_90", "a100": "sm_80", "l4": "sm_89"}


@pytest.mark.parametrize("name", sorted(EXPECTED_ARCH))
def test_gpu_preset_is_a_cuda_target_with_the_cluster_tables_numbers(name: str) -> None:
    d = target_dict(name)
    assert d["kind"] == "cuda" and d["arch"] == EXPECTED_ARCH[name] and d["model"] == name
    assert d["host"]["kind"] == "llvm"
    t = resolve_target(name)  # TVM accepts the dict
    assert str(t.kind.name) == "cuda" and str(t.attrs["arch"]) == EXPECTED_ARCH[name]
    facts = gpu_facts(d)
    spec = gpu_spec(name)  # one table: the preset's device numbers are the cluster preset's
    assert facts == {"arch": EXPECTED_ARCH[name], "device": name, "memory_bytes": spec["mem"],
                     "memory_bandwidth": spec["bw"], "peak_flops": spec["peak"]}
    cluster = Cluster.resolve(f"{name}x2")
    assert cluster.devices[0].memory_bytes == facts["memory_bytes"]
    assert cluster.devices[0].peak_flops == facts["peak_flops"]


def test_explicit_json_cuda_target() -> None:
    d = target_dict('{"kind": "cuda", "arch": "sm_80"}')
    assert d["arch"] == "sm_80" and d["host"]["kind"] == "llvm" and d["max_threads_per_block"] == 1024
    assert gpu_facts(d) == {"arch": "sm_80"}  # no preset named: the arch only
    assert gpu_facts(target_dict("znver4")) is None
    with pytest.raises(BackendError, match="not a CUDA architecture"):
        target_dict('{"kind": "cuda", "arch": "volta"}')
    with pytest.raises(BackendError, match="unknown target 'h300'.*h100, h200, a100, l4"):
        target_dict("h300")


def test_planner_uses_the_gpu_cluster_for_a_gpu_target() -> None:
    assert gpu_cluster_spec("h200", 2) == "h200x2"
    assert gpu_cluster_spec("h200", 16) == "h200:2x8"  # NVLink inside a node of 8, InfiniBand between
    assert gpu_cluster_spec('{"kind": "cuda", "arch": "sm_89"}', 4) == "l4x4"
    assert gpu_cluster_spec("znver4", 2) is None and gpu_cluster_spec(None, 2) is None

    def args(**kw):
        return argparse.Namespace(**{"cluster": None, "devices": None, "target": None, "backend": "tvm", **kw})

    c = cluster_from_args(args(devices=2, target="h200"))
    assert c.name == "h200x2" and c.levels[0].name == "nvlink4" and c.devices[0].kind == "gpu"
    assert cluster_from_args(args(devices=16, target="a100")).levels[1].name == "ib-hdr-200g"
    assert cluster_from_args(args(devices=2)).name == "cpu:2"
    assert cluster_from_args(args(devices=2, target="h200", cluster="cpu:2")).name == "cpu:2"  # --cluster wins


def test_missing_cuda_extra_is_one_line_naming_it(monkeypatch, capsys, tmp_path) -> None:
    """With cuda.bindings not importable, compile --target h200 exits 2 with one line naming the
    extra (the same path a machine without ``pip install .[cuda]`` takes)."""
    import models_zoo
    import onnx
    from partitioner.cli import main

    path = tmp_path / "mlp.onnx"
    onnx.save(models_zoo.build("mlp"), path)
    for mod in [m for m in sys.modules if m == "cuda" or m.startswith("cuda.")]:
        monkeypatch.delitem(sys.modules, mod)
    monkeypatch.setitem(sys.modules, "cuda", None)  # import cuda.bindings -> ImportError
    rc = main(["compile", str(path), "-o", str(tmp_path / "a"), "--target", "h200"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2
    assert len(err) == 1 and "pip install .[cuda]" in err[0] and "cuda-bindings" in err[0], err
    assert not (tmp_path / "a").exists()


def test_presets_listed_once() -> None:
    assert set(GPU_PRESETS) == set(EXPECTED_ARCH)
    for name in GPU_PRESETS:
        assert gpu_spec(name)["arch"] == EXPECTED_ARCH[name]
