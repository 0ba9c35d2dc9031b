"""Conv + bias + ReLU layers of the zoo's resnet18 / resnet50 / mobilenet and the held-out U-Net (the
per_device sizes, and resnet18 at 224x224 as bench_runtime.py runs it), one layer at a time: our builds against
ONNX Runtime, in one process, 1 thread.

    python benchmarks/conv_layers.py [--batches 1,8] [--variants direct,im2col] [--repeats 7] [--json FILE]
                                     [--only resnet18] [--layers 512x4,256x7] [--baseline MODULE.ATTR=VALUE]

Each layer is a one-node-chain ONNX model (Conv with bias, Relu; seeded random He-scaled
weights) built through the ``scheduled`` pipeline once per variant (``direct``: the default
rules; ``im2col`` / ``winograd``: ``conv_algorithm``), every build checked against ONNX Runtime
(rtol 1e-4, atol 1e-5). Times: the calling thread's CPU time (``time.thread_time``), median over
interleaved rounds (each round calls every implementation for ~20 ms), so a loaded machine's
time slicing matters less; ``pct_peak`` = FLOPs / time / the measured one-core FMA peak.
The model's NCHW input and output are transposed to and from NHWC inside our build, so on layers
with few FLOPs per output byte (1x1 convs with K <= 64, the 3-channel stem) the ratio to ORT
includes those copies, which a whole model pays once.
``--baseline MODULE.ATTR=VALUE`` (repeatable) also builds each ``direct`` layer with those
schedule settings (variant ``base``: the "before" of a schedule change), timed in the same
interleaved rounds; ``--layers CIxSIZE,..`` keeps only those layers;
``--only resnet18_224 --batches 4,8`` times the layers one data-parallel rank of
``bench_runtime.py``'s resnet runs (batch 8 split over 2 ranks).
Results: ``benchmarks/results/conv_layers.json`` (not committed from a loaded machine).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")

import numpy as np  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "conv_layers.json"
#: (model, input channels, size, output channels, kernel, stride): the layers carrying most
#: conv FLOPs in the per_device zoo sizes (resnet18 112x112, resnet50 64x64, mobilenet 112x112)
LAYERS = [
    ("resnet18", 64, 28, 64, 3, 1), ("resnet18", 128, 14, 128, 3, 1), ("resnet18", 256, 7, 256, 3, 1),
    ("resnet18", 512, 4, 512, 3, 1), ("resnet18", 3, 112, 64, 7, 2),
    ("resnet50", 256, 4, 256, 3, 1), ("resnet50", 64, 16, 64, 3, 1), ("resnet50", 256, 4, 1024, 1, 1),
    ("resnet50", 1024, 4, 256, 1, 1), ("resnet50", 64, 16, 256, 1, 1), ("resnet50", 512, 2, 2048, 1, 1),
    ("mobilenet", 96, 7, 576, 1, 1), ("mobilenet", 160, 4, 960, 1, 1), ("mobilenet", 24, 28, 144, 1, 1),
    ("mobilenet", 576, 7, 96, 1, 1),
    # resnet18 at 224x224 (bench_runtime's resnet; each data-parallel rank runs batch 4): the
    # convs whose input exceeds L2 at batch 4-8 (contraction.WIDE_INPUT_TILE)
    ("resnet18_224", 64, 56, 64, 3, 1), ("resnet18_224", 64, 56, 128, 3, 2),
    ("resnet18_224", 128, 28, 128, 3, 1),
    # ... and its stem (the RGB pad copy: injective.SPLIT_PAD_COPY) and stride-2 1x1 downsamples
    ("resnet18_224", 3, 224, 64, 7, 2), ("resnet18_224", 64, 56, 128, 1, 2),
    ("resnet18_224", 128, 28, 256, 1, 2), ("resnet18_224", 256, 14, 512, 1, 2),
    # the held-out U-Net (per_device size: 64x64 images, 16 base channels): its narrow 3x3 convs
    ("heldout_unet", 16, 64, 16, 3, 1), ("heldout_unet", 32, 64, 16, 3, 1), ("heldout_unet", 16, 32, 32, 3, 1),
    ("heldout_unet", 32, 32, 32, 3, 1), ("heldout_unet", 64, 32, 32, 3, 1), ("heldout_unet", 32, 16, 64, 3, 1),
    ("heldout_unet", 64, 16, 64, 3, 1),
    # the held-out Inception (64x64 images): 48-channel outputs (3 vectors of 16: contraction rule 4),
    # a stride-2 reduction, and 64 channels on 32x32
    ("heldout_inception", 32, 32, 48, 3, 1), ("heldout_inception", 48, 16, 48, 3, 1),
    ("heldout_inception", 128, 32, 64, 3, 2), ("heldout_inception", 64, 32, 64, 3, 1),
    # 1x1 convs to 24 channels (gemm_packed.FULL_WIDTH_PAD_N)
    ("mobilenet", 144, 28, 24, 1, 1), ("heldout_inception", 48, 32, 24, 1, 1), ("heldout_inception", 256, 16, 24, 1, 1),
]


def layer_model(ci: int, hw: int, co: int, k: int, s: int, batch: int) -> Any:
    from models_zoo.conv_layers import single_conv_model

    return single_conv_model(ci, hw, co, k, s, batch, seed=ci * 7 + hw * 5 + co * 3 + k + s)


def tvm_build(model: Any, target: Any, algorithm: str) -> Callable[[Any], Any]:
    import tvm
    from tvm import relax

    from backends.tvm import parallel_scope
    from backends.tvm.lower import lower_program
    from backends.tvm.pipeline import run_pipeline

    mod = run_pipeline(lower_program(model).mod, "scheduled", target, conv_algorithm=algorithm)
    fn = relax.VirtualMachine(parallel_scope.compile(mod, target), tvm.cpu())["main"]  # as backends/tvm/build.py
    return lambda x: fn(x)


def interleaved(fns: dict[str, Callable[[], Any]], repeats: int) -> dict[str, float]:
    """Median thread-CPU seconds per call of each function over interleaved rounds."""
    reps = {}
    for name, f in fns.items():
        f()
        t0 = time.thread_time()
        f()
        reps[name] = max(1, int(0.02 / max(time.thread_time() - t0, 1e-6)))
    cpu: dict[str, list[float]] = {n: [] for n in fns}
    for _ in range(repeats):
        for name, f in fns.items():
            c0 = time.thread_time()
            for _ in range(reps[name]):
                f()
            cpu[name].append((time.thread_time() - c0) / reps[name])
    return {n: statistics.median(v) for n, v in cpu.items()}


def _kernel_profile() -> Any:
    import importlib.util

    spec = importlib.util.spec_from_file_location("kernel_profile", ROOT / "benchmarks" / "kernel_profile.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def run(batches: list[int], variants: list[str], repeats: int, only: str | None,
        baseline: list[str] | None = None, layers: list[str] | None = None) -> dict[str, Any]:
    import onnxruntime as ort
    import tvm

    from backends.tvm.executable import configure_threads
    from backends.tvm.peak import measure_fma_peak
    from backends.tvm.target import resolve_target

    target = resolve_target(None)
    configure_threads(1)
    peak = measure_fma_peak(target, seconds=0.02, repeats=5)[0]
    rows = []
    for model_name, ci, hw, co, k, s in LAYERS:
        if (only and only not in model_name) or (layers and f"{ci}x{hw}" not in layers):
            continue
        for batch in batches:
            m = layer_model(ci, hw, co, k, s, batch)
            x = np.random.default_rng(1).standard_normal((batch, ci, hw, hw)).astype(np.float32)
            so = ort.SessionOptions()
            so.intra_op_num_threads, so.inter_op_num_threads = 1, 1
            sess = ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])
            ref = sess.run(None, {"x": x})[0]
            tx = tvm.runtime.tensor(x)
            fns: dict[str, Callable[[], Any]] = {"ort": lambda: sess.run(None, {"x": x})}
            builds = list(variants) + (["base"] if baseline else [])
            for v in builds:
                if v == "base":
                    with _kernel_profile().with_settings(baseline):
                        f = tvm_build(m, target, "direct")
                else:
                    f = tvm_build(m, target, v)
                res = f(tx)
                got = (res if isinstance(res, tvm.runtime.Tensor) else res[0]).numpy()
                np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-5, err_msg=f"{model_name} {v}")
                fns[v] = lambda f=f: f(tx)
            times = interleaved(fns, repeats)
            oh = (hw + 2 * ((k - 1) // 2) - k) // s + 1
            flops = 2.0 * batch * oh * oh * co * ci * k * k
            row = {"model": model_name, "ci": ci, "size": hw, "co": co, "kernel": k, "stride": s, "batch": batch,
                   "flops": flops, "thread_cpu_s": times,
                   "pct_peak": {n: 100.0 * flops / t / peak for n, t in times.items()},
                   "vs_ort": {n: t / times["ort"] for n, t in times.items()}}
            rows.append(row)
            print(f"{model_name:9s} {ci:4d}x{hw:3d}x{hw:<3d} -> {co:4d} k{k} s{s} b{batch}: " + "  ".join(
                f"{n}={t * 1e6:8.1f}us ({row['pct_peak'][n]:3.0f}%, x{row['vs_ort'][n]:.2f})" for n, t in times.items()),
                flush=True)
    return {"target": str(target), "peak_flops_per_core": peak, "repeats": repeats, "baseline": baseline or [],
            "rows": rows}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--variants", default="direct,im2col")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--only", default=None, help="only layers of this model")
    ap.add_argument("--layers", default=None, help="only these layers, as CIxSIZE (e.g. 512x4,256x7)")
    ap.add_argument("--baseline", action="append", default=[], metavar="MODULE.ATTR=VALUE",
                    help="also build with this schedule setting (variant 'base'), same rounds")
    ap.add_argument("--json", default=str(RESULTS))
    args = ap.parse_args(argv)
    data = run([int(b) for b in args.batches.split(",")], args.variants.split(","), args.repeats, args.only,
               args.baseline, args.layers.split(",") if args.layers else None)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(data, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
