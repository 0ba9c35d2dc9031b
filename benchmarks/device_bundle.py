"""Prepare ``.gpu/``: what a lent GPU machine needs to run ``make gpu-check``'s artifacts, built here.

    python benchmarks/device_bundle.py [--out .gpu] [--models resnet,bert,gpt] [--python 3.12]
    # then, on the device (its command):  bash benchmarks/device_run.sh   (carry: .gpu)

Why a bundle: the lent machine (``.library/device``) has Python 3.12 with torch, onnx, onnxruntime
(CPU provider only) and cuda-bindings, but no TVM and no MPI, cannot reach PyPI, and takes at most
64 MiB per call (the working tree included). TVM's wheel is 100 MB, 96% of it ``libtvm_compiler``,
which running an artifact does not need. So:

1. Wheels for the device's Python (``pip download --python-version``, no dependencies): apache-tvm-ffi,
   mpi4py and mpich (mpiexec and libmpi), onnx-ir (the device has an older one), and onnx2torch
   (gpu_check's PyTorch reference, ``benchmarks/torch_reference.py``: the device has torch, and
   no ``onnxruntime-gpu``, whose 255 MB wheel does not fit).
2. ``tvm_runtime.tar.xz``: this environment's ``tvm`` package without ``libtvm_compiler.so``, its
   vendored sources and caches (about 3 MB compressed); the device imports it with
   ``TVM_USE_RUNTIME_LIB=1`` (``backends/tvm/executable.py`` rule: a runtime-only TVM loads
   artifacts; ``load_device_runtimes`` loads the CUDA runtime).
3. ``artifacts.tar.xz``: ``gpu_check.py --build-only --small`` cross-compiled here (NVRTC, no GPU):
   every model for 1 and 2 GPUs. xz's window keeps one copy of the weights that an artifact
   stores three times.

It fails in one line (exit 2) when the bundle would not fit the transfer.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIMIT_BYTES = 64 * 2**20  # the device tool's transfer limit, working tree included
WHEELS = ("apache-tvm-ffi", "mpi4py", "mpich", "onnx-ir")  # pinned to this environment's versions
# not installed here: gpu_check's PyTorch reference on the device (benchmarks/torch_reference.py)
DEVICE_ONLY_WHEELS = ("onnx2torch==1.5.15",)
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64",
             "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64", "manylinux_2_5_x86_64")
TVM_LEFT_OUT = ("libtvm_compiler.so", "__pycache__", "3rdparty")


def pinned(name: str) -> str:
    from importlib.metadata import version

    return f"{name}=={version(name)}"


def download_wheels(out: Path, python: str) -> None:
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
           "--python-version", python, "--implementation", "cp", "-d", str(out)]
    for p in PLATFORMS:
        cmd += ["--platform", p]
    subprocess.run(cmd + [pinned(n) for n in WHEELS] + list(DEVICE_ONLY_WHEELS), check=True)


def tvm_runtime_tar(out: Path) -> None:
    """The installed ``tvm`` package (and its dist-info) without the compiler library."""
    import tvm

    site = Path(tvm.__file__).resolve().parents[1]
    members = [site / "tvm", *site.glob("apache_tvm-*.dist-info")]

    def keep(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
        return None if any(part in TVM_LEFT_OUT for part in Path(info.name).parts) else info

    with tarfile.open(out, "w:xz") as tar:
        for m in members:
            tar.add(m, arcname=m.name, filter=keep)


def artifacts_tar(out: Path, models: str) -> None:
    with tempfile.TemporaryDirectory(prefix="device-bundle-") as tmp:
        subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--build-only", tmp,
                        "--small", "--models", models], check=True)
        with tarfile.open(out, "w:xz", preset=9) as tar:
            for d in sorted(Path(tmp).iterdir()):
                tar.add(d, arcname=d.name)


def tree_bytes() -> int:
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           check=True, capture_output=True).stdout.split(b"\0")
    return sum((ROOT / f.decode()).stat().st_size for f in files if f and (ROOT / f.decode()).is_file())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / ".gpu"), help="bundle folder (default .gpu, ignored by git)")
    ap.add_argument("--models", default="resnet,bert,gpt", help="models to build (gpu_check.py names)")
    ap.add_argument("--python", default="3.12", help="the device's Python version (default 3.12)")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for old in out.iterdir():
        old.unlink()
    download_wheels(out, args.python)
    tvm_runtime_tar(out / "tvm_runtime.tar.xz")
    artifacts_tar(out / "artifacts.tar.xz", args.models)
    bundle = sum(f.stat().st_size for f in out.iterdir())
    tree = tree_bytes()
    for f in sorted(out.iterdir()):
        print(f"  {f.stat().st_size / 2**20:7.2f} MiB  {f.name}")
    print(f"device-bundle: {bundle / 2**20:.1f} MiB in {out} + {tree / 2**20:.1f} MiB of working tree "
          f"(limit {LIMIT_BYTES / 2**20:.0f} MiB)")
    if bundle + tree > LIMIT_BYTES:
        print("device-bundle: over the transfer limit; build fewer models (--models)", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
