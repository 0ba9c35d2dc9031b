#!/usr/bin/env bash
# On a lent GPU machine (.library/device), from the repository root, with .gpu/ carried
# (benchmarks/device_bundle.py made it): install the bundle into a venv over the machine's Python,
# then run gpu_check.py on the cross-compiled artifacts and `partitioner run --check` on each. Results go to $OUT (gpu.json, log). Arguments are passed on to gpu_check.py.
set -u
OUT=${OUT:-/tmp/device-out}
mkdir -p "$OUT"
exec > >(tee "$OUT/log") 2>&1
B=.gpu
V=/tmp/partitioner-venv
t0=$(date +%s)
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv || true
# the machine's python3 is itself a venv (torch, onnx, onnxruntime, numpy): a venv made from it
# sees only the base interpreter, so a .pth adds the machine's packages after the bundle's
HOST_SITE=$(python3 -c 'import os, onnx; print(os.path.dirname(os.path.dirname(onnx.__file__)))') || exit 3
python3 -m venv --without-pip "$V" || exit 3
SITE=$("$V/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo "$HOST_SITE" > "$SITE/zz-host-packages.pth"
"$V/bin/python" -m pip install -q --no-index --no-deps --no-compile --ignore-installed "$B"/*.whl || exit 3
tar xJf "$B/tvm_runtime.tar.xz" -C "$SITE" || exit 3
mkdir -p /tmp/gpu-artifacts && tar xJf "$B/artifacts.tar.xz" -C /tmp/gpu-artifacts || exit 3
# libtvm_runtime_cuda.so links libcudart.so.13: the toolkit's, or the nvidia-cuda-runtime wheel's
CUDART=$(find /usr/local /opt "$HOST_SITE" /usr/lib -name 'libcudart.so.13*' 2>/dev/null | head -1)
export LD_LIBRARY_PATH="$(dirname "${CUDART:-/x/x}")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export PATH="$V/bin:$PATH" PYTHONPATH="$PWD" TVM_USE_RUNTIME_LIB=1 PYTHONUNBUFFERED=1
echo "setup: $(( $(date +%s) - t0 )) s; python $(python --version 2>&1); cudart ${CUDART:-none}"
python -c 'import tvm, tvm_ffi, onnx_ir, mpi4py; from backends.cuda_devices import visible_gpus; from backends.tvm.cuda_toolchain import nvrtc_version; print("tvm", tvm.__version__, "runtime only", tvm._RUNTIME_ONLY, "nvrtc", nvrtc_version(), "gpus", visible_gpus())' || exit 3
python benchmarks/gpu_check.py --artifacts /tmp/gpu-artifacts --small --json "$OUT/gpu.json" "$@"
rc=$?
for a in /tmp/gpu-artifacts/*gpu; do  # the CLI path, on 1 and 2 GPUs (gpu_check.py's tolerances)
  echo "== partitioner run $(basename "$a") --check"
  timeout 120 python -c 'import sys; from partitioner.cli import main; sys.exit(main())' run "$a" --check --rtol 1e-3 --atol 1e-4 || rc=1
done
echo "device_run: rc=$rc in $(( $(date +%s) - t0 )) s"
exit $rc
