"""The ``run --check`` reference: ONNX Runtime on the source model, in a process of its own.

Rules:
1. A source model of at most :data:`IN_PROCESS_MAX_BYTES` (its .onnx plus external data) runs in
   the launcher's process, as before: a fresh interpreter costs about a second.
2. A larger one runs in a fresh ``python -m partitioner.runtime.reference`` process, which reads
   the inputs from an .npz and writes the outputs to one: the launcher never holds the whole model,
   and its memory is given back when the process ends.
3. Before starting it, the model's bytes (times :data:`HEADROOM`) are compared with the memory
   the machine has available (``psutil``); a model that cannot fit is not run, and the check is
   *skipped* with a one-line reason instead of swapping the machine to death.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Mapping

import numpy as np

from partitioner.core.errors import RunFailed

IN_PROCESS_MAX_BYTES = 256 * 2**20
HEADROOM = 1.3  # ORT's session holds the weights once more while it initialises some of them


def model_bytes(path: Path) -> int:
    """The .onnx file's size plus that of every external data file it names."""
    import onnx
    from onnx.external_data_helper import _get_all_tensors

    proto = onnx.load(str(path), load_external_data=False)
    names = {e.value for t in _get_all_tensors(proto) for e in t.external_data if e.key == "location"}
    return path.stat().st_size + sum((path.parent / n).stat().st_size for n in names if (path.parent / n).is_file())


def available_bytes() -> int | None:
    try:
        import psutil
    except ImportError:
        return None
    return int(psutil.virtual_memory().available)


def run_ort(path: Path, feeds: Mapping[str, np.ndarray], threads: int, *,
            lean: bool = False) -> dict[str, np.ndarray]:
    """ONNX Runtime on ``path`` (loaded by path, so its external data is found beside it);
    ``lean`` (the separate process) turns off weight prepacking, a second copy of every GEMM weight."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = max(1, threads)
    opts.log_severity_level = 3
    if lean:
        opts.add_session_config_entry("session.disable_prepacking", "1")
    try:
        sess = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
    except Exception as exc:  # noqa: BLE001 - ORT raises its own classes
        raise RunFailed(f"{path}: ONNX Runtime cannot load the source model for the check "
                        f"({str(exc).splitlines()[0]})") from None
    names = [o.name for o in sess.get_outputs()]
    wanted = {i.name for i in sess.get_inputs()}
    return dict(zip(names, sess.run(names, {k: v for k, v in feeds.items() if k in wanted})))


def reference_outputs(path: Path, feeds: Mapping[str, np.ndarray], *,
                      threads: int | None = None) -> tuple[dict[str, np.ndarray] | None, str]:
    """Rules 1-3: (outputs, "") or (None, why the check was skipped)."""
    threads = threads or os.cpu_count() or 1
    size = model_bytes(path)
    if size <= IN_PROCESS_MAX_BYTES:
        return run_ort(path, feeds, threads), ""
    avail = available_bytes()
    if avail is not None and size * HEADROOM > avail:
        return None, (f"check skipped: the source model ({size / 2**30:.2f} GiB) cannot fit this machine's "
                      f"available memory ({avail / 2**30:.2f} GiB) for the ONNX Runtime reference")
    from partitioner.runtime.worker import read_npz, write_npz

    with tempfile.TemporaryDirectory(prefix="partitioner-reference-") as tmp:
        inp, out = Path(tmp) / "inputs.npz", Path(tmp) / "outputs.npz"
        write_npz(inp, dict(feeds))
        root = str(Path(__file__).resolve().parents[2])
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p))
        proc = subprocess.run([sys.executable, "-m", "partitioner.runtime.reference", str(path), str(inp), str(out),
                               "--threads", str(threads)], capture_output=True, text=True, env=env)
        if proc.returncode != 0 or not out.is_file():
            lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
            raise RunFailed(f"the ONNX Runtime reference process failed: {lines[-1] if lines else proc.returncode}")
        return read_npz(out, what="reference outputs"), ""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m partitioner.runtime.reference",
                                description="ONNX Runtime on a model: inputs .npz in, outputs .npz out.")
    p.add_argument("model")
    p.add_argument("inputs")
    p.add_argument("outputs")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    from partitioner.runtime.worker import read_npz, write_npz

    try:
        write_npz(args.outputs, run_ort(Path(args.model), read_npz(args.inputs), args.threads, lean=True))
    except Exception as exc:  # noqa: BLE001 - one line for the launcher
        sys.stderr.write(f"{str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__}\n")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
