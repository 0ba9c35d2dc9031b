"""gpu_check.py's report (``--markdown``) and its PyTorch reference, on a CPU machine.

The device run itself is benchmarks/results/session29_h200/ (docs/gpu.md); here: the table's
ratios and notes from a hand-written results document, the size presets, and the reference's
refusal in one reason when PyTorch or a CUDA device is missing.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_check  # noqa: E402
import torch_reference  # noqa: E402


def _row(model: str, ranks: int, ours_s: float, **extra) -> dict:
    return {"model": model, "ranks": ranks, "strategy": "single" if ranks == 1 else "data",
            "params": {"width": 16}, "reference_provider": "CPUExecutionProvider", "median_s": ours_s,
            "check": {"ok": True, "outputs": [{"name": "y", "ok": True, "max_abs": 1e-6, "max_rel": 1e-3}]},
            "gpu_comm": [{"path": "staged" if ranks > 1 else "nccl"}], **extra}


def test_markdown_ratios_and_notes(tmp_path: Path) -> None:
    doc = {"machine": {"gpus": [{"name": "NVIDIA H200"}]}, "versions": {"tvm": "0.27", "onnxruntime": "1.30"},
           "target": {"kind": "cuda", "arch": "sm_90", "model": "h200"},
           "settings": {"small": True, "repeat": 20, "rtol": 1e-3, "atol": 1e-4},
           "rows": [_row("resnet", 1, 0.0016, why_no_ort_cuda="no CUDA provider", torch_cuda_median_s=0.0024,
                         torch_cuda={"median_s": 0.0024, "max_abs_vs_reference": 3e-6,
                                     "versions": {"torch": "2.11", "onnx2torch": "1.5.15"}}),
                    _row("resnet", 2, 0.0025)]}
    path = tmp_path / "gpu.json"
    path.write_text(json.dumps(doc))
    text = gpu_check.markdown(path)
    one, two = [line for line in text.splitlines() if line.startswith("| resnet")]
    assert "| 1.600 | - | - | 2.400 | 1.50x | - |" in one  # 2.4 ms / 1.6 ms; no comm on one rank
    assert two.endswith("| 2.500 | - | - | - | - | staged |")
    assert "Sizes (--small): resnet width 16." in text
    assert "No speed against ORT CUDA: no CUDA provider." in text
    assert "PyTorch 2.11 eager" in text and "within 3e-06" in text


def test_small_sizes_keep_shapes_with_a_quarter_of_the_channels() -> None:
    args = argparse.Namespace(quick=False, small=True)
    for key, (_, full, _) in gpu_check.MODELS.items():
        small = gpu_check.model_sizes(key, args)
        channels = "width" if key == "resnet" else "hidden"
        assert small[channels] * 4 == full.get(channels, 64), key  # zoo resnet's default width is 64
        others = {k: v for k, v in full.items() if k != channels}
        assert {k: v for k, v in small.items() if k != channels} == others


def test_torch_reference_gives_a_reason_without_onnx2torch(monkeypatch) -> None:
    import models_zoo

    monkeypatch.setitem(sys.modules, "onnx2torch", None)  # not importable, whether or not torch is
    ref, why = torch_reference.torch_cuda_reference(models_zoo.build("mlp"), {}, {}, 1, 1)
    assert ref is None and why.startswith("no PyTorch reference (") and why.endswith("is not installed)")


def test_median_seconds_warms_up_then_times_each_call() -> None:
    import timing

    calls = []
    assert timing.median_seconds(lambda: calls.append(1), 2, 5) >= 0.0
    assert len(calls) == 7
