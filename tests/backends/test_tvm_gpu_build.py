"""Every kernel of the zoo models builds for a GPU on a machine without one (issue 17, item 2).

Each model is lowered, scheduled with dlight's GPU rules (backends/tvm/schedules/gpu.py) and
compiled by NVRTC for ``sm_80`` (A100) and ``sm_90`` (H100/H200) into a ``.so``. A kernel the
rules left unscheduled would not build at all (TVM's VerifyMemory rejects an unbound loop nest),
so a build that succeeds means every kernel was scheduled and compiled; the build facts count the
``__global__`` kernels in the library, which must be at least one per PrimFunc of the module.
Running the kernels needs a GPU: ``make gpu-check`` (benchmarks/gpu_check.py).

Fast: two small zoo models. Slow (``make test-slow``): every zoo model, builders at the small
sizes of tests/test_zoo.py and the nine light models at their real sizes.
"""

from __future__ import annotations

from pathlib import Path

import onnx
import pytest

import models_zoo
from backends.tvm.build import build_one
from backends.tvm.target import target_dict

SMALL = {
    "mlp": {}, "resnet": {"image": 32, "width": 16}, "resnet50": {"image": 32, "width": 8},
    "bert": {"seq": 8}, "gpt": {"seq": 8}, "unet": {"image": 32, "base": 8},
    "inception": {"image": 32}, "mobilenet": {"image": 32, "width_mult": 0.5}, "llama": {"size": "tiny"},
}
FAST = {"mlp", "bert"}
ARCHS = ("sm_80", "sm_90")


def _model(name: str) -> onnx.ModelProto:
    return models_zoo.build(name, **SMALL.get(name, {}))


def _cases():
    names = [e.name for e in models_zoo.list_models()]
    for name in names:
        for arch in ARCHS:
            marks = () if name in FAST else (pytest.mark.slow,)
            yield pytest.param(name, arch, marks=marks, id=f"{name}-{arch}")


def test_every_zoo_model_is_listed() -> None:
    builders = {e.name for e in models_zoo.list_models() if e.kind == "builder"}
    assert builders <= set(SMALL), f"add {sorted(builders - set(SMALL))} to SMALL"


@pytest.mark.parametrize(("name", "arch"), list(_cases()))
def test_zoo_model_builds_for_gpu_without_a_gpu(name: str, arch: str, tmp_path: Path) -> None:
    model = _model(name)
    tdict = target_dict({"kind": "cuda", "arch": arch})
    facts = build_one(model, tmp_path / "rank0.so", tdict)
    assert (tmp_path / "rank0.so").stat().st_size == facts["bytes"] > 0
    assert facts["target"]["arch"] == arch and facts["gpu"]["arch"] == arch
    assert facts["gpu"]["prim_funcs"] >= 1
    # every scheduled PrimFunc became at least one CUDA kernel (TVM may split one into several)
    assert facts["gpu"]["kernels"] >= facts["gpu"]["prim_funcs"], facts["gpu"]


def test_tuning_database_for_cuda_applies_without_a_gpu_and_tuning_needs_one(tmp_path: Path) -> None:
    """A MetaSchedule database is keyed by the cuda target: applying it builds here (kernels it has
    no record of get the dlight rules); tuning, which times candidates, refuses in one line."""
    import json

    from partitioner.core.errors import BackendError
    from backends.cuda_devices import visible_gpus

    model = _model("mlp")
    tdict = target_dict("h200")
    facts = build_one(model, tmp_path / "rank0.so", tdict, {"tuning_db": str(tmp_path / "db")})
    db = Path(facts["tuning"]["database"])
    assert db.parent == tmp_path / "db" and (db / "database_workload.json").exists()
    keyed = json.loads((db / "target.json").read_text())
    assert keyed["kind"] == "cuda" and keyed["arch"] == "sm_90"
    assert facts["tuning"]["tuned_kernels"] == 0 and facts["tuning"]["untuned_kernels"]  # nothing tuned yet
    assert facts["gpu"]["kernels"] >= 1
    if not visible_gpus():
        with pytest.raises(BackendError, match="times kernels on a GPU that runs sm_90; visible GPUs: none"):
            build_one(model, tmp_path / "rank0b.so", tdict, {"tuning_db": str(tmp_path / "db"), "tune_trials": 4})
