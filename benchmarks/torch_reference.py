"""A GPU speed reference for ``gpu_check.py`` where ONNX Runtime's CUDA provider is missing.

PyTorch runs the *same* ONNX model (the same weights), converted by ``onnx2torch``, on the same
inputs, on the GPU. Rules:

1. Like ours and ORT's ``session.run``, one step includes the host -> device copies of the
   inputs and the device -> host copies of the outputs (``.cpu()`` waits for the GPU).
2. float32 throughout: TF32 is off for cuDNN convolutions and cuBLAS products (PyTorch turns
   it on for convolutions by default). ``cudnn.benchmark`` is on, so PyTorch picks its fastest
   convolution algorithms during the warm-up steps.
3. The converted model's outputs are compared with ONNX Runtime's (``max_abs_vs_reference``):
   a time is only reported next to outputs that match, so a wrong conversion is visible.
4. Eager mode, no ``torch.compile`` (what a user converting an ONNX model runs first).
Anything missing (torch, onnx2torch, a CUDA device, an op onnx2torch cannot convert) gives
``(None, reason)`` and no time.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from timing import median_seconds


def torch_cuda_reference(model: Any, feeds: dict[str, np.ndarray], want: dict[str, np.ndarray], warmup: int,
                         repeat: int) -> tuple[dict[str, Any] | None, str | None]:
    """``({"median_s", "max_abs_vs_reference", "versions"}, None)`` or ``(None, why not)``."""
    try:
        import torch
        from onnx2torch import convert
    except ImportError as e:
        return None, f"no PyTorch reference ({e.name} is not installed)"
    if not torch.cuda.is_available():
        return None, "no PyTorch reference (torch sees no CUDA device)"
    torch.backends.cudnn.allow_tf32 = False  # rule 2
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.benchmark = True
    try:
        module = convert(model).eval().cuda()
    except Exception as e:  # noqa: BLE001 - an unconvertible op is a reason, not a crash
        return None, f"no PyTorch reference (onnx2torch: {str(e).strip().splitlines()[0][:120]})"
    names = [i.name for i in model.graph.input if i.name in feeds]

    def step() -> list[np.ndarray]:
        with torch.inference_mode():
            out = module(*[torch.from_numpy(np.ascontiguousarray(feeds[n])).cuda() for n in names])
            return [o.cpu().numpy() for o in (out if isinstance(out, (tuple, list)) else [out])]

    got = step()
    median_s = median_seconds(step, warmup, repeat)
    ref = list(want.values())
    if len(got) != len(ref) or any(g.shape != r.shape for g, r in zip(got, ref)):
        return None, "no PyTorch reference (the converted model's outputs differ in number or shape)"
    err = max(float(np.max(np.abs(g.astype(np.float64) - r.astype(np.float64)), initial=0.0))
              for g, r in zip(got, ref))
    return {"median_s": median_s, "max_abs_vs_reference": err,
            "versions": {"torch": torch.__version__, "onnx2torch": _version("onnx2torch"),
                         "gpu": torch.cuda.get_device_name(0)}}, None


def _version(name: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return "?"
