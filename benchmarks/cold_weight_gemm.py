"""A pipeline stage's GEMM with its packed weight warm or evicted (issue 16, session 32).

    .venv/bin/python benchmarks/cold_weight_gemm.py [--rows 128,1024] [--runs 41] [--rounds 3] [--json FILE]

The zoo mlp's 1F1B stages (``benchmarks/train_step.py``: 1024 wide, micro-batches of 128 rows)
spend 17% more in their GEMM kernels than the 1-rank step spends on the same FLOPs
(``pipeline_runner_profile.py --compare``). This separates the kernel from the cache state it
runs in: the forward product ``relu(X W + b)`` (X ``[rows, 1024]``, W ``1024 x 1024`` packed at
build time: the same ``fused_matmul_add_relu_prepacked`` kernel a stage runs), built by
``kernel_profile.build_ours`` for one thread, called ``--runs`` times in a row (``warm``: the
packed weight stays in the caches between calls) and ``--runs`` times with a 64 MiB pass over
another array before each call (``cold``: the weight comes from memory, as inside a stage, whose
micro-batch streams its weights' packed copies and accumulators, about 22 MiB for the mlp's last
stage). Each figure is the median thread-CPU time of one call; rows are per 1024 rows too. The
rounds alternate the two orders. Measured (session 32, Zen 5, quiet; the last run's JSON in
``benchmarks/results/session32_zen5/cold_weight_gemm.json``): 128 rows warm 0.97-1.02 ms a call,
cold 1.03-1.13 (+7% to +10% over three runs); 1024 rows cold as warm (0.99-1.01x: the weight's
trip from memory is spread over 8 times the work); inside the stage, 1.18 ms a call.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

WIDTH = 1024
EVICT_BYTES = 64 << 20


def _model(rows: int, w: np.ndarray, b: np.ndarray):
    from onnx import TensorProto, helper, numpy_helper

    nodes = [helper.make_node("MatMul", ["X", "W"], ["y"]), helper.make_node("Add", ["y", "b"], ["z"]),
             helper.make_node("Relu", ["z"], ["o"])]
    graph = helper.make_graph(nodes, "stage_gemm", [helper.make_tensor_value_info("X", TensorProto.FLOAT, [rows, WIDTH])],
                              [helper.make_tensor_value_info("o", TensorProto.FLOAT, [rows, WIDTH])],
                              [numpy_helper.from_array(w, "W"), numpy_helper.from_array(b, "b")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _time(call, runs: int, junk: np.ndarray | None) -> float:
    out = []
    for _ in range(runs):
        if junk is not None:
            np.add(junk, 1.0, out=junk)  # every line of 64 MiB read and written: the caches hold none of W
        t = time.thread_time()
        call()
        out.append(time.thread_time() - t)
    return statistics.median(out)


def main(argv: list[str] | None = None) -> int:
    import tvm
    from tvm import relax

    import kernel_profile
    from backends.tvm.target import resolve_target

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="128,1024")
    p.add_argument("--runs", type=int, default=41)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    rng = np.random.default_rng(0)
    w = rng.standard_normal((WIDTH, WIDTH)).astype(np.float32)
    b = rng.standard_normal(WIDTH).astype(np.float32)
    junk = np.ones(EVICT_BYTES // 4, np.float32)
    target = resolve_target(None)
    rows_list = [int(r) for r in args.rows.split(",")]
    calls = {}
    for rows in rows_list:
        ex, _ = kernel_profile.build_ours(_model(rows, w, b), target, threads=1)
        vm = relax.VirtualMachine(ex, tvm.cpu())
        x = tvm.runtime.tensor(rng.standard_normal((rows, WIDTH)).astype(np.float32))
        calls[rows] = lambda vm=vm, x=x: vm["main"](x)
        calls[rows]()  # warm-up
    results = {r: {"warm": [], "cold": []} for r in rows_list}
    for k in range(args.rounds):
        for rows in rows_list:
            for mode in (("warm", "cold") if k % 2 == 0 else ("cold", "warm")):
                results[rows][mode].append(_time(calls[rows], args.runs, junk if mode == "cold" else None))
    doc = {"width": WIDTH, "runs": args.runs, "rounds": args.rounds, "target": str(target), "rows": []}
    for rows in rows_list:
        warm = statistics.median(results[rows]["warm"]) * 1e3
        cold = statistics.median(results[rows]["cold"]) * 1e3
        doc["rows"].append({"rows": rows, "warm_ms": warm, "cold_ms": cold, "cold_over_warm": cold / warm,
                            "warm_ms_per_1024_rows": warm * 1024 / rows, "cold_ms_per_1024_rows": cold * 1024 / rows})
        print(f"{rows:5d} rows: warm {warm:7.3f} ms, cold {cold:7.3f} ms a call ({cold / warm:.2f}x); "
              f"per 1024 rows {warm * 1024 / rows:6.2f} / {cold * 1024 / rows:6.2f} ms")
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
